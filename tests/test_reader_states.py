"""The moves of a stream reader between its states (``ReadState``), with no server: the moves that
need no query. (The readers' behaviour against a real server is tests/test_stream_readers.py's.)"""

from __future__ import annotations

import asyncio

import pytest

from pgflow._core.signals import PollTicks
from pgflow._core.store import Store
from pgflow._core.streams.reader import ChunkFetcher, ReadState, StreamRead

pytestmark = pytest.mark.anyio


async def _no_store() -> Store:
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
