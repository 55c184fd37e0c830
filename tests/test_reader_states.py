"""The moves of a stream reader between its states (``ReadState``), with no server: the moves that
need no query. (The readers' behaviour against a real server is tests/test_stream_readers.py's.)"""

from __future__ import annotations

import asyncio

import pytest

from pgflow._core.engine import Engine
from pgflow._core.signals import PollTicks
from pgflow._core.streams.reader import HANDED, ChunkFetcher, ReadState, StreamRead

from .helpers import CountedWaiter

pytestmark = pytest.mark.anyio


async def _no_store() -> Engine:
    raise AssertionError("these moves run no query")


def _fetcher() -> ChunkFetcher:
    return ChunkFetcher(_no_store, PollTicks(every=3600.0))


async def test_the_first_reader_asked_runs_the_query_and_hands_it_on_when_it_stops() -> None:
    fetcher = _fetcher()
    first, second = StreamRead(fetcher, None, "wf", "a", 0), StreamRead(fetcher, None, "wf", "b", 0)
    assert first.state is ReadState.NEW
    first._start()
    second._start()
    first.wake()  # asked already: asked once
    assert (first.state, first.runs_fetch, second.state, second.runs_fetch) == (
        ReadState.ASKED, True, ReadState.ASKED, False)
    first.stop()  # before it ran the query: the next reader asked runs it
    assert (first.state, second.runs_fetch) == (ReadState.CLOSED, True)
    first.wake()  # a closed reader is asked nothing
    assert first.state is ReadState.CLOSED


async def test_a_ping_while_the_reader_is_busy_is_kept_until_its_consumer_has_taken_its_chunks() -> None:
    fetcher = _fetcher()
    read = StreamRead(fetcher, None, "wf", "a", 0)
    read.sid, read.state = 7, ReadState.WAITING
    read._signal = asyncio.get_running_loop().create_future()  # (its consumer waits)
    read.hand(7, 0, b"chunk")  # news that carried the chunk it waits for: taken with no query
    assert (read.state, read.offset, fetcher.handed) == (ReadState.READY, 1, 1)
    read.wake()
    assert (read.state, read.again) == (ReadState.READY, True)
    assert await read.__anext__() == [(0, b"chunk")]
    assert read.state is ReadState.HELD
    fetcher.idle(read)  # taken: the ping kept meanwhile asks at once
    assert (read.state, read.again, read.runs_fetch) == (ReadState.ASKED, False, True)


async def test_a_reader_that_ended_or_failed_is_asked_nothing_more() -> None:
    fetcher = _fetcher()
    for state in (ReadState.ENDED, ReadState.FAILED):
        read = StreamRead(fetcher, None, "wf", "a", 0)
        read.state = state
        read.wake()
        assert (read.state, read.runs_fetch) == (state, False)


def _tick(ticks: PollTicks) -> None:
    """A tick now, in place of the one its timer would make later."""
    if ticks._timer is not None:
        ticks._timer.cancel()
    ticks._tick()


async def test_the_poll_wakes_a_waiter_only_once_it_has_waited_half_a_tick_with_no_news() -> None:
    ticks = PollTicks(every=3600.0)
    silent, fed = CountedWaiter(), CountedWaiter()
    ticks.add(silent)
    ticks.add(fed)
    _tick(ticks)  # they began to wait just before: too early for either
    assert (silent.times, fed.times) == (0, 0)
    ticks.add(fed)  # news came, it took it and waits again: a wait begun since this tick
    _tick(ticks)
    assert (silent.times, fed.times) == (1, 0)
    _tick(ticks)
    assert (silent.times, fed.times) == (1, 1)
    assert ticks._timer is None  # nobody waits: no timer
    ticks.add(silent)
    assert ticks._timer is not None
    ticks._timer.cancel()


async def test_a_chunk_a_ping_carried_is_taken_by_step_without_a_batch_or_a_query() -> None:
    fetcher = _fetcher()
    read = StreamRead(fetcher, None, "wf", "a", 0)
    read.sid, read.state = 7, ReadState.WAITING  # (as after a first query that found nothing)
    waiting = read.step()
    assert isinstance(waiting, asyncio.Future) and not waiting.done()
    read.hand(7, 0, b"chunk")
    assert waiting.done()
    assert read.step() is HANDED and read.handed == b"chunk"
    assert (read.state, read.offset, fetcher.queries) == (ReadState.HELD, 1, 0)
    waiting = read.step()  # taken: it waits for the next one
    assert isinstance(waiting, asyncio.Future) and read.state is ReadState.WAITING


async def test_the_next_chunk_carried_while_the_consumer_is_busy_is_kept_for_it_and_runs_no_query() -> None:
    fetcher = _fetcher()
    read = StreamRead(fetcher, None, "wf", "a", 0)
    read.sid, read.state = 7, ReadState.WAITING
    read._signal = asyncio.get_running_loop().create_future()
    read.hand(7, 0, b"first")
    assert read.step() is HANDED and read.handed == b"first"  # its consumer is busy with it: HELD
    read.hand(7, 1, b"second")  # the next one comes meanwhile: kept, no query asked for
    read.hand(7, 1, b"second")  # (the same news heard twice)
    assert (read.state, read.again, read.runs_fetch) == (ReadState.HELD, False, False)
    assert read.step() is HANDED and read.handed == b"second"  # the consumer comes back: handed over
    assert (read.offset, fetcher.queries, fetcher.handed) == (2, 0, 2)
    read.hand(7, 2, b"third")
    read.hand(7, 3, b"fourth")  # two ahead while it is busy: the second one is left to a query
    assert (read.state, read.again) == (ReadState.HELD, True)
    assert read.step() is HANDED and read.handed == b"third"
    assert read.step() is None and read.runs_fetch  # then it runs the query, for what came after
    assert (read.state, read.offset) == (ReadState.ASKED, 3)


async def test_a_chunk_kept_after_a_batch_cut_short_is_handed_over_before_the_query_for_the_rest() -> None:
    fetcher = _fetcher()
    read = StreamRead(fetcher, None, "wf", "a", 0)
    # A query's answer, cut at its limit (more may wait): READY with chunks 0-1, asked again once taken.
    read.sid, read.state, read.chunks, read.offset, read.again = 7, ReadState.READY, [(0, b"a"), (1, b"b")], 2, True
    read.hand(7, 2, b"c")  # the next one comes before its consumer has taken the batch: kept
    assert read.step() == [(0, b"a"), (1, b"b")]
    assert read.step() is HANDED and read.handed == b"c"  # the kept one first, in order
    assert read.step() is None and read.runs_fetch  # then the query for what the cut left
    assert (read.state, read.offset, fetcher.handed) == (ReadState.ASKED, 3, 1)
