"""Why a run stops (pgflow/_core/run_state.py), without a server: of two reasons told in either order
the stronger stands, and of equal rank the first; the module's written table is the order the code
keeps; a cancel records its reason and cancels the run's scope; the stream writer skips every chunk of
a run whose chunk was refused, whatever comes after. The order is spelled out here, not read from the
module, so a change to it fails these tests until they are changed with it."""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import anyio
import anyio.lowlevel
import psycopg
import pytest

from pgflow._core import run_state
from pgflow._core.engine import Fenced
from pgflow._core.execution import Execution
from pgflow._core.run_journal import RunJournal
from pgflow._core.run_state import ChunkRefused, RunOver, RunState, StreamWriteFailed, TimedOut
from pgflow._core.run_streams import RunStreams
from pgflow._core.streams.writer import Stream, StreamWriter, _Pending
from pgflow.errors import CancelRequested, ExecutionInterrupted, LeaseLost, StoreUnavailable, Suspended

from .test_stream_batches import RunOwner

pytestmark = pytest.mark.anyio

# Strongest first; the kinds of one rank together.
ORDER: list[tuple[type[ExecutionInterrupted], ...]] = [
    (LeaseLost,),
    (CancelRequested,),
    (StoreUnavailable, StreamWriteFailed, ChunkRefused),
    (TimedOut,),
    (Suspended,),
    (RunOver,),
]
RANK = {kind: rank for rank, kinds in enumerate(ORDER) for kind in kinds}


def _reason(kind: type[ExecutionInterrupted], tag: str) -> ExecutionInterrupted:
    return Suspended(datetime(2030, 1, 1, tzinfo=UTC), tag) if kind is Suspended else kind(tag)


@pytest.mark.parametrize(("first", "second"), list(itertools.permutations(RANK, 2)),
                         ids=lambda kind: kind.__name__)
def test_of_two_reasons_the_stronger_stands_and_of_equal_rank_the_first(
        first: type[ExecutionInterrupted], second: type[ExecutionInterrupted]) -> None:
    state = RunState("w", 1)
    told_first, told_second = _reason(first, "first"), _reason(second, "second")
    assert state.interrupt(told_first) is told_first
    in_force = state.interrupt(told_second)
    expected = told_second if RANK[second] < RANK[first] else told_first
    assert in_force is expected and state.reason is expected
    with pytest.raises(type(expected)) as raised:
        state.check()
    assert raised.value is expected


def test_the_written_table_is_the_order_kept() -> None:
    """The module's docstring table, rank by rank, names the kinds the code ranks there (a row goes
    on over the lines below it that start with blanks)."""
    written: dict[int, list[str]] = {}
    rank: int | None = None
    for line in (run_state.__doc__ or "").splitlines():
        row = re.match(r"(\d)\s", line)
        if row:
            rank = int(row.group(1)) - 1
        elif not line.startswith(" "):
            rank = None
        if rank is not None:
            written.setdefault(rank, []).extend(re.findall(r"``(\w+)``", line[:51]))
    assert written == {rank: [kind.__name__ for kind in kinds] for rank, kinds in enumerate(ORDER)}
    assert run_state.PRECEDENCE == tuple(ORDER)


def test_a_reason_of_no_rank_is_refused() -> None:
    class Unranked(ExecutionInterrupted):
        pass

    state = RunState("w", 1)
    with pytest.raises(TypeError, match="no rank"):
        state.interrupt(Unranked("?"))
    assert state.reason is None
    state.check()  # (nothing in force: no raise)


def test_a_subclass_takes_its_base_s_rank() -> None:
    class Refused(ChunkRefused):
        pass

    state = RunState("w", 1)
    refused = Refused("first")
    state.interrupt(refused)
    assert state.interrupt(StoreUnavailable("later, of equal rank")) is refused


async def test_a_cancel_records_its_reason_and_cancels_the_run_s_scope() -> None:
    scope = anyio.CancelScope()
    state = RunState("w", 3, scope)
    running = anyio.Event()

    async def body() -> None:
        with scope:
            running.set()
            await anyio.sleep_forever()

    async with anyio.create_task_group() as group:
        group.start_soon(body)
        await running.wait()
        state.cancel()
    assert scope.cancelled_caught and state.cancelled
    assert isinstance(state.reason, CancelRequested) and str(state.reason) == "workflow 'w' was cancelled"


async def test_a_cancel_after_a_lost_lease_stops_the_run_but_is_not_its_reason() -> None:
    scope = anyio.CancelScope()
    state = RunState("w", 3, scope)
    lost = state.lose_lease()
    assert isinstance(lost, LeaseLost) and str(lost) == "workflow 'w' attempt 3 lost its lease"
    state.cancel()
    assert scope.cancel_called and state.reason is lost and not state.cancelled


def test_a_cancel_is_not_hidden_by_an_outage_or_the_run_s_end() -> None:
    state = RunState("w", 1)
    state.cancel()  # (no scope: a replay check's state)
    for later in (StoreUnavailable("away"), StreamWriteFailed("cut"), TimedOut("late"), RunOver("over")):
        state.interrupt(later)
        assert state.cancelled


async def test_the_chunks_after_a_refused_one_are_skipped_whatever_comes_after() -> None:
    """A batch the server refused is split; the later half must not write a chunk of a run whose
    earlier chunk was refused (a gap), even once a cancel or a timeout was told to the run after it."""
    loop = asyncio.get_running_loop()
    owner = RunOwner(1)
    refused = _Pending(owner, "k", 0, b"bad", Stream("s"), loop.create_future())
    later = _Pending(owner, "k", 1, b"next", Stream("s"), loop.create_future())
    StreamWriter._refused([refused], ValueError("no NUL here"))
    assert isinstance(refused.done.exception(), ChunkRefused)
    owner.state.interrupt(TimedOut("the deadline passed after the refusal"))
    assert isinstance(owner.state.reason, ChunkRefused)  # a weaker reason does not replace it
    owner.state.cancel()
    assert owner.state.cancelled  # a stronger one does, and the chunk is still not sent
    assert StreamWriter._must_stop(later)
    assert isinstance(later.done.exception(), CancelRequested)


async def test_an_outage_interrupts_every_run_of_the_batch() -> None:
    loop = asyncio.get_running_loop()
    owners = [RunOwner(1), RunOwner(2)]
    owners[1].state.cancel()  # told first, and stronger: it stays
    batch = [_Pending(owner, "k", 0, b"v", Stream(f"s{n}"), loop.create_future()) for n, owner in enumerate(owners)]
    StreamWriter._refused(batch, psycopg.OperationalError("connection refused"))
    assert isinstance(owners[0].state.reason, StreamWriteFailed)
    assert isinstance(owners[1].state.reason, CancelRequested)
    assert [type(p.done.exception()) for p in batch] == [StreamWriteFailed, CancelRequested]


def _execution(scope: anyio.CancelScope) -> Execution:
    """An execution with nothing behind it but its state: only its fenced writes' answers are looked at."""
    state = RunState("w", 2, scope)
    return Execution(runtime=None, store=None, workflow_id="w", attempt=1, lease_token=1,  # type: ignore[arg-type]
                     journal=RunJournal({}), token=anyio.lowlevel.current_token(), state=state,
                     streams=RunStreams(state, None, "w", 1), run=2)


def _answer(owner: bool, cancel: bool) -> Callable[[], Awaitable[Fenced[int]]]:
    async def write() -> Fenced[int]:
        return Fenced(owner, cancel, 7)
    return write


async def test_a_fenced_write_that_finds_the_cancel_cancels_the_run_where_it_stands() -> None:
    """The same path as the heartbeat's cancel: the body's scope is cancelled, not only the write's
    caller told, so a body that goes on (or a sibling branch of it) stops at its next await."""
    scope = anyio.CancelScope()
    execution = _execution(scope)
    assert await execution.fenced(_answer(True, False), "write") == 7
    went_on = False
    with anyio.fail_after(10), scope:
        with pytest.raises(CancelRequested):
            await execution.fenced(_answer(True, True), "write")
        went_on = True
        await anyio.sleep(3600)  # (a body that swallowed the CancelRequested: its scope stops it)
    assert went_on and scope.cancelled_caught and execution.state.cancelled


async def test_a_fenced_write_that_finds_the_lease_lost_keeps_it_over_the_cancel() -> None:
    scope = anyio.CancelScope()
    execution = _execution(scope)
    with pytest.raises(LeaseLost, match="workflow 'w' attempt 2 lost its lease"):
        await execution.fenced(_answer(False, False), "write")
    with pytest.raises(LeaseLost):
        await execution.fenced(_answer(True, True), "write")  # (a cancel seen after the lease was lost)
    assert scope.cancel_called and not execution.state.cancelled
