"""The journal of one run of a workflow: step calls, replay, retries, stream writes, and the fenced
writes that the durable primitives (``waits.py``) make; ``executor.py`` runs the body to its end.

A workflow's steps (and sleeps, receives, events, child starts) are numbered in call order. A position
the journal already holds returns its recorded output (or raises its recorded exception) without
running; a new position runs the step, with retries, and records the final outcome once, fenced by the
execution's attempt. Sync workflows run in a thread and call back into the worker's loop for every
journal operation, so there is one implementation of a step call, not two. (How code finds the
execution it runs in: ``current.py``.)"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar, TypeVar

import anyio
import anyio.lowlevel
import psycopg
from anyio.from_thread import run as run_in_loop

from ..errors import (
    CancelRequested,
    ExecutionInterrupted,
    LeaseLost,
    NonDeterministicWorkflow,
    SerializationError,
    StepTimeout,
    StoreUnavailable,
    Suspended,
)
from . import codec, telemetry
from .attempt_errors import keep_attempt_error
from .cancels import CancelWatch
from .engine import Engine, Fenced, StepRecord, StepStart, WorkflowRow, retrying, unreachable
from .outcomes import describe, replay
from .registry import StepSpec
from .runtime import Runtime
from .starts import StepStarts
from .status import ENDED
from .step_body import StepRun, inside_step, run_step_body
from .streams.writer import Stream, StreamWriter

log = logging.getLogger("pgflow.execution")
NOTE_WITHIN = 2.0  # seconds a step attempt's note may take: it only counts the attempt
SUSPECT_LOOKS_AGAIN = 0.5  # seconds until a suspect waiting for a child is run again to look
T = TypeVar("T")

@dataclass(eq=False)
class Execution:
    """One run of one workflow by one worker, identified by its claim's token (the words: status.py)."""

    replay_only: ClassVar[bool] = False  # a ``check-replay`` of the journal, which writes nothing
    runtime: Runtime
    store: Engine
    workflow_id: str
    attempt: int  # the claim's number (a claim lost in a server crash leaves it to be handed out again)
    claim_token: int  # never handed out twice: it fences every write of this run
    journal: dict[int, StepRecord]
    token: anyio.lowlevel.EventLoopToken
    writer: StreamWriter | None = None
    starts: StepStarts | None = None  # the worker's batcher of step-start notes
    # Per stream key: the next free position in the table, and how far this run's deterministic
    # replay of the workflow body has got (see write_chunk).
    stream_ends: dict[str, int] = field(default_factory=dict)
    stream_cursor: dict[str, int] = field(default_factory=dict)
    closed_streams: set[str] = field(default_factory=set)
    named_streams: dict[str, Stream] = field(default_factory=dict)  # what the writer knows of each stream
    next_position: int = 0
    interrupt: ExecutionInterrupted | None = field(default=None)
    # Step calls made in an async workflow and not yet started; one still unstarted when the body
    # returns was called without ``await``.
    unstarted: list[tuple[str, Coroutine[Any, Any, Any]]] = field(default_factory=list)
    run: int = 1  # the attempt counted against the workflow's budget (``pgflow.attempt()``)
    # When the journal was read: its seconds until a wake-up are counted from then.
    loaded_at: float = field(default_factory=time.monotonic)
    value_limit: int | None = None  # bytes of a value the body publishes (an event)
    # The highest journal position an earlier run reached, by a record or by a child it started
    # (-1: none): ``patched`` answers False below it, where an older body went on without asking.
    horizon: int = -1
    # Patch markers taken by ``patched`` and not yet written, by position: each is written before
    # anything the body journals after it (see ``write_marks``).
    marks: dict[int, str] = field(default_factory=dict)
    marks_lock: anyio.Lock | None = None
    failure: BaseException | None = None  # what the body raised, for the workflow's retry policy
    # The worker fence (worker id, epoch) the claim was made under, while it holds: it fences this
    # run's chunk batches (migration 0026); None: the workflow's row does.
    fence: tuple[str, int] | None = None
    cancels: CancelWatch | None = None  # told of the workflow once its chunks are fenced by its worker
    chunks_in_flight: int = 0  # the writer's count of this run's chunks in batches being written
    fence_cut: str | None = None  # a batch of its chunks under this worker's fence was cut off
    poisoned: bool = False  # a chunk of its was not written (the writer's mark: none after it may be)
    settled: asyncio.Future[None] | None = None  # the writer's, once the run's end waits for them
    alone: bool = False  # a suspect of a crash, run alone by its worker (see worker.py)
    # Per journal position not recorded, the step attempts that earlier runs began there: this run's
    # tries go on from them (``pgflow.step_attempt()`` counts every try of the step).
    tries_before: dict[int, int] = field(default_factory=dict)

    @property
    def suspend_after(self) -> float:
        """Seconds a wait may hold the worker slot; a longer one gives it back."""
        config = self.runtime.config
        return config.suspend_after if config is not None else 5.0

    def seconds_left(self, remaining_when_loaded: float) -> float:
        return remaining_when_loaded - (self.runtime.hub.clock.monotonic() - self.loaded_at)

    def take_position(self) -> int:
        position = self.next_position
        self.next_position += 1
        return position

    def check_interrupt(self) -> None:
        if self.interrupt is not None:
            raise self.interrupt

    def step_call(self, step: StepSpec, args: Any, kwargs: Any) -> Coroutine[Any, Any, Any]:
        """The awaitable of a step call in an async workflow. It takes its journal position when it
        starts, so a call that is never awaited takes none, and is reported when the body returns."""
        call = self.call_step(step, args, kwargs)
        if len(self.unstarted) >= 64:
            self.unstarted = [(name, c) for name, c in self.unstarted if _unstarted(c)]
        self.unstarted.append((step.name, call))
        return call

    def check_awaited(self, report: bool = True) -> None:
        """Raise when a step call of the body was never awaited (it took no position, ran nothing)."""
        forgotten = [name for name, call in self.unstarted if _unstarted(call)]
        for _, call in self.unstarted:
            if _unstarted(call):
                call.close()  # no "never awaited" warning on top of the error
        self.unstarted = []
        if forgotten and report:
            raise TypeError(
                f"workflow {self.workflow_id!r} called step {forgotten[0]!r} without await"
                f"{f' (and {len(forgotten) - 1} more)' if len(forgotten) > 1 else ''}: in an async "
                "workflow every step call is awaited, e.g. `await my_step(x)`"
            )

    async def call_step(self, step: StepSpec, args: Any, kwargs: Any) -> Any:
        """The journaled call of a step: replayed when recorded, otherwise run, retried and recorded."""
        self.check_interrupt()
        position = self.take_position()
        record = self.recorded(position, step.name)
        if record is not None:
            for key, end in (record.stream_ends or {}).items():
                self.stream_cursor[key] = max(self.stream_cursor.get(key, 0), end)
            return replay(record, step)
        # Tries are counted over every run: those that earlier runs began here (cut short by a crash or
        # a stop) come first. The step's retries are spent by the tries of this run only, so a try that
        # another workflow's crash cut short costs this one no retry.
        before = self.tries_before.get(position, 0)
        step_attempt = before + 1
        while True:
            try:
                output = await self._attempt(step, position, step_attempt, args, kwargs, before)
            except Exception as exc:
                if step.retry.should_retry(exc, step_attempt - before):
                    delay = step.retry.delay(step_attempt - before)
                    log.info("step %s of %s failed (%s), step attempt %d of workflow attempt %d; retrying in"
                             " %.2fs", step.name, self.workflow_id, exc, step_attempt, self.run, delay)
                    await keep_attempt_error(self, step.name, position, step_attempt, exc)
                    step_attempt += 1
                    await self.runtime.hub.clock.sleep(delay, owner=self.workflow_id)
                    self.check_interrupt()
                    continue
                await self._record(position, step.name, None, describe(exc), step_attempt)
                raise
            try:
                data, output = codec.checked(output, step.return_type, f"the output of step {step.name!r}",
                                             step.limit)
            except SerializationError as exc:
                await self._record(position, step.name, None, describe(exc), step_attempt)
                raise
            await self._record(position, step.name, data, None, step_attempt)
            # The workflow gets the value as decoded from the record, exactly what a replay returns.
            return output

    async def _attempt(self, step: StepSpec, position: int, step_attempt: int, args: Any, kwargs: Any,
                       before: int = 0) -> Any:
        """One attempt of a step, noted before it starts, so that each is counted once, one cut short by
        a crash included: a note sent beside the body could be lost with a step that kills its process
        at once (os._exit, a fatal signal), and a journal counted 19 tries of a step that ran 20 times.
        The notes of a worker's concurrent steps go out together (``StepStarts``). ``before``: the tries
        that earlier runs began here; the note holds this run's."""
        await self._note_start(step.name, position, step_attempt - before)
        self.check_interrupt()  # (a lost lease or a cancellation the note learnt of: the step does not run)
        with telemetry.step(step.name, self.workflow_id, position, step_attempt):
            return await run_step_body(step, StepRun(step_attempt), self.workflow_id, args, kwargs)

    async def _note_start(self, name: str, position: int, tries: int) -> None:
        """Note an attempt of a step (``tries``: this run's count of them there). Shielded, and bounded:
        a worker stopping as the step starts must not cancel the note that counts it, nor wait long for
        it. A lost lease or a cancellation it learns of is left in ``interrupt``, for the attempt to act
        on."""

        start = StepStart(self.workflow_id, self.attempt, self.claim_token, position, tries)

        async def note() -> Fenced[None]:
            if self.starts is not None:  # the worker's batch of notes
                return (await self.starts.note(start)).with_value(None)
            [fence] = await self.store.journal.start_steps([start])
            return fence.with_value(None)

        with contextlib.suppress(ExecutionInterrupted), anyio.move_on_after(NOTE_WITHIN, shield=True):
            await self.fenced(note, f"start step {name!r}")

    async def _record(
        self, position: int, name: str, output: bytes | None, error: dict[str, Any] | None, attempts: int,
    ) -> None:
        ends = dict(self.stream_ends)

        async def record() -> Fenced[None]:
            fence = await self.store.journal.record_step(
                self.workflow_id, self.attempt, self.claim_token, position, name, output, error, attempts, ends)
            return fence.with_value(None)

        try:
            await self.fenced(record, f"record step {name!r}")
        finally:
            for key, end in ends.items():
                self.stream_cursor[key] = max(self.stream_cursor.get(key, 0), end)

    async def fenced(self, operation: Callable[[], Awaitable[Fenced[T]]], what: str) -> T:
        """``_fenced``, once the patch markers taken before it are written."""
        if self.marks:
            await self.write_marks()
        return await self._fenced(operation, what)

    async def write_marks(self) -> None:
        """Write the patch markers ``patched`` took without a round trip (it is a plain call, also
        in an async body). A marker only has to be in the journal before anything recorded after
        it: until then a replay finds nothing at or past its position, and ``patched`` answers True
        again, as it did. So every journal write and child start of the body calls this first; one
        lock keeps a write that races it (steps gathered together) behind the markers' commit."""
        if self.marks_lock is None:
            self.marks_lock = anyio.Lock()
        async with self.marks_lock:
            for position, name in sorted(self.marks.items()):
                async def record(position: int = position, name: str = name) -> Fenced[None]:
                    fence = await self.store.journal.record_step(self.workflow_id, self.attempt, self.claim_token,
                                                         position, name, None, None, 1)
                    return fence.with_value(None)

                await self._fenced(record, f"journal {name!r}")
                del self.marks[position]

    async def before_child_start(self, ids: list[str], name: str) -> bool:
        """Called as the body starts child workflows (``ids``, of the workflow ``name``); True when
        they are to be written (a replay check writes nothing)."""
        if self.marks:
            await self.write_marks()
        return True

    async def child_outcome(self, id: str) -> WorkflowRow | None:
        """Called as the body awaits a child's result: a row to answer with instead of waiting (a
        replay check reads it once), or None to wait as any caller does.

        A suspect of a crash runs alone, so it must not hold its worker while it waits for another
        workflow: the child, a suspect too when it ran beside it, could only run on a worker that
        runs nothing else. So a suspect's wait for a child that has not ended gives the slot back and
        looks again a moment later (``Suspended``), as a long sleep does."""
        if not self.alone:
            return None
        row = await self.store.workflows.workflow(id)
        if row is not None and row.status in ENDED:
            return row
        until = datetime.now(UTC) + timedelta(seconds=SUSPECT_LOOKS_AGAIN)
        raise Suspended(until, f"waiting alone for child {id!r} (a suspect of a crash gives its worker back)")

    async def _fenced(self, operation: Callable[[], Awaitable[Fenced[T]]], what: str) -> T:
        """Run a write made on behalf of this execution, fenced by its claim and tried again while
        the server is away; its value, once its fence is looked at. A lost lease or a
        cancellation interrupts the execution, and so does a server that stays away: not the
        workflow's failure, the run stops and the workflow is resumed once the database is back (the
        writes are fenced and idempotent, so a retry cannot double one)."""
        try:
            answer = await retrying(operation, what)
        except psycopg.Error as exc:
            if not unreachable(exc):
                raise
            self.interrupt = StoreUnavailable(f"cannot {what}: {exc}")
            raise self.interrupt from exc
        if not answer.owner:
            self.interrupt = LeaseLost(f"workflow {self.workflow_id!r} attempt {self.run} lost its lease")
        elif answer.cancel:
            self.interrupt = CancelRequested(f"workflow {self.workflow_id!r} was cancelled")
        self.check_interrupt()
        return answer.value

    def entry(self, name: str, what: str) -> tuple[int, StepRecord | None]:
        """The next journal position for a durable operation of the workflow body (a sleep, a
        message received, an event set), and what the journal recorded there."""
        self.check_interrupt()
        if inside_step.get() is not None:
            raise RuntimeError(f"pgflow.{what} is for the workflow body, not for the inside of a step: a step "
                               "may run more than once, and its waits would not be journaled")
        position = self.take_position()
        return position, self.recorded(position, name)

    def recorded(self, position: int, name: str) -> StepRecord | None:
        """The journal's record at ``position``, checked to be of ``name``."""
        record = self.journal.get(position)
        if record is not None and record.name != name:
            raise NonDeterministicWorkflow(
                f"workflow {self.workflow_id!r} called {name!r} at position {position}, "
                f"but its journal recorded {record.name!r} there. A workflow must make the same "
                "step calls in the same order on every run; move anything nondeterministic "
                "(time, randomness, I/O) into a step."
            )
        return record

    def put_chunk(self, key: str, value: bytes | None) -> asyncio.Future[None] | None:
        """Hand a chunk (``None`` closes the stream) to the worker's writer at the stream's next
        position: the future is done once it is committed, and fails with the reason it was not
        (the execution was interrupted meanwhile). None when there is nothing to write.

        From a step, a chunk is appended after whatever the stream holds: a retried step's chunks
        follow those of its earlier attempts (``stream_offset`` tells it how many there were). From the
        workflow body, the n-th write to a key lands at the same position on every run, so a workflow
        replayed after a crash skips the writes that were already committed instead of repeating them.
        (Not a coroutine: a writer awaits the future itself, one frame less to resume per chunk.)"""
        run = inside_step.get()
        if run is not None and run.abandoned:
            raise StepTimeout(f"stream {key!r}: the step attempt writing it ran past its timeout and was abandoned")
        if self.interrupt is not None:
            raise self.interrupt
        closed = self.closed_streams
        if closed and key in closed:
            raise ValueError(f"stream {key!r} of workflow {self.workflow_id!r} is closed")
        if value is None:
            closed.add(key)
        end = self.stream_ends.get(key, 0)
        if run is None:
            cursor = self.stream_cursor.get(key, 0)
            self.stream_cursor[key] = cursor + 1
            if cursor < end:
                return None
        self.stream_ends[key] = end + 1
        writer = self.writer
        if writer is None:
            raise RuntimeError("streams are written by workflows run by a worker")
        if self.fence is not None and self.cancels is not None:
            self.cancels.watch(self.workflow_id)  # its chunks do not read its row (see cancels.py)
        return writer.put(self, key, end, value)

    async def write_chunk(self, key: str, value: bytes | None) -> None:
        """``put_chunk``, awaited."""
        written = self.put_chunk(key, value)
        if written is not None:
            await written

    def stream_offset(self, key: str) -> int:
        """Inside a step: chunks this step call has committed to ``key`` so far, earlier attempts
        included. In the workflow body: how many chunks the stream holds."""
        end = self.stream_ends.get(key, 0)
        return end - self.stream_cursor.get(key, 0) if inside_step.get() else end

    def call_step_from_thread(self, step: StepSpec, args: Any, kwargs: Any) -> Any:
        """The same journaled call, made from a sync workflow's thread."""
        return run_in_loop(self.call_step, step, args, kwargs, token=self.token)


def _unstarted(call: Coroutine[Any, Any, Any]) -> bool:
    return inspect.getcoroutinestate(call) == inspect.CORO_CREATED
