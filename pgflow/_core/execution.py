"""One run of a workflow as its body sees it: step calls, replay, retries, and the fenced writes that
the durable primitives (``waits.py``) make; ``executor.py`` runs the body to its end.

A workflow's steps (and sleeps, receives, events, child starts) are numbered in call order. A position
the journal already holds returns its recorded output (or raises its recorded exception) without
running; a new position runs the step, with retries, and records the final outcome once, fenced by the
execution's attempt. Sync workflows run in a thread and call back into the worker's loop for every
journal operation, so there is one implementation of a step call, not two. (How code finds the
execution it runs in: ``current.py``.)

A run's state is kept apart, each part by one owner: what earlier runs recorded and the positions
taken (``RunJournal``, run_journal.py), its streams (``RunStreams``, run_streams.py, the stream
writer's owner of its chunks), and why it must stop (``RunState``, run_state.py, which orders the
reasons and is the one way a run is cancelled). This module calls their methods."""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar, TypeVar

import anyio
import anyio.lowlevel
import psycopg
from anyio.from_thread import run as run_in_loop

from ..errors import ExecutionInterrupted, NonDeterministicWorkflow, SerializationError, StoreUnavailable, Suspended
from . import codec, telemetry
from .attempt_errors import keep_attempt_error
from .engine import Engine, Fenced, StepRecord, StepStart, WorkflowRow, retrying, unreachable
from .outcomes import describe, replay
from .registry import StepSpec
from .run_journal import RunJournal
from .run_state import RunState
from .run_streams import RunStreams
from .runtime import Runtime
from .status import ENDED
from .step_body import StepRun, inside_step, run_step_body
from .step_starts import StepStarts

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
    lease_token: int  # never handed out twice: it fences every write of this run
    journal: RunJournal
    token: anyio.lowlevel.EventLoopToken
    state: RunState  # why it must stop, if it must (the only place that says so)
    streams: RunStreams
    starts: StepStarts | None = None  # the worker's batcher of step-start notes
    # Step calls made in an async workflow and not yet started; one still unstarted when the body
    # returns was called without ``await``.
    unstarted: list[tuple[str, Coroutine[Any, Any, Any]]] = field(default_factory=list)
    run: int = 1  # the attempt counted against the workflow's budget (``pgflow.attempt()``)
    value_limit: int | None = None  # bytes of a value the body publishes (an event)
    marks_lock: anyio.Lock | None = None  # (``write_marks``)
    alone: bool = False  # a suspect of a crash, run alone by its worker (see worker.py)

    @property
    def suspend_after(self) -> float:
        """Seconds a wait may hold the worker slot; a longer one gives it back."""
        config = self.runtime.config
        return config.suspend_after if config is not None else 5.0

    def seconds_left(self, remaining_when_loaded: float) -> float:
        return remaining_when_loaded - (self.runtime.hub.clock.monotonic() - self.journal.loaded_at)

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
        self.state.check()
        position = self.journal.take()
        record = self.recorded(position, step.name)
        if record is not None:
            if record.stream_ends:
                self.streams.caught_up(record.stream_ends)
            return replay(record, step)
        # Tries are counted over every run: those that earlier runs began here (cut short by a crash or
        # a stop) come first. The step's retries are spent by the tries of this run only, so a try that
        # another workflow's crash cut short costs this one no retry.
        before = self.journal.tries_before.get(position, 0)
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
                    self.state.check()
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
        self.state.check()  # (a lost lease or a cancellation the note learnt of: the step does not run)
        with telemetry.step(step.name, self.workflow_id, position, step_attempt):
            return await run_step_body(step, StepRun(step_attempt), self.workflow_id, args, kwargs)

    async def _note_start(self, name: str, position: int, tries: int) -> None:
        """Note an attempt of a step (``tries``: this run's count of them there). Shielded, and bounded:
        a worker stopping as the step starts must not cancel the note that counts it, nor wait long for
        it. A lost lease or a cancellation it learns of is left in the run's state, for the attempt to
        act on."""

        start = StepStart(self.workflow_id, self.attempt, self.lease_token, position, tries)

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
        ends = dict(self.streams.ends)

        async def record() -> Fenced[None]:
            fence = await self.store.journal.record_step(
                self.workflow_id, self.attempt, self.lease_token, position, name, output, error, attempts, ends)
            return fence.with_value(None)

        try:
            await self.fenced(record, f"record step {name!r}")
        finally:
            if ends:
                self.streams.caught_up(ends)

    async def fenced(self, operation: Callable[[], Awaitable[Fenced[T]]], what: str) -> T:
        """``_fenced``, once the patch markers taken before it are written."""
        if self.journal.marks:
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
            for position, name in sorted(self.journal.marks.items()):
                async def record(position: int = position, name: str = name) -> Fenced[None]:
                    fence = await self.store.journal.record_step(self.workflow_id, self.attempt, self.lease_token,
                                                         position, name, None, None, 1)
                    return fence.with_value(None)

                await self._fenced(record, f"journal {name!r}")
                self.journal.marked(position)

    async def before_child_start(self, ids: list[str], name: str) -> bool:
        """Called as the body starts child workflows (``ids``, of the workflow ``name``); True when
        they are to be written (a replay check writes nothing)."""
        if self.journal.marks:
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
        writes are fenced and idempotent, so a retry cannot double one). What stops it is the reason
        in force afterwards (run_state.py orders them)."""
        try:
            answer = await retrying(operation, what)
        except psycopg.Error as exc:
            if not unreachable(exc):
                raise
            raise self.state.interrupt(StoreUnavailable(f"cannot {what}: {exc}")) from exc
        if not answer.owner:
            self.state.lose_lease()
        elif answer.cancel:
            self.state.cancel()
        self.state.check()
        return answer.value

    def entry(self, name: str, what: str) -> tuple[int, StepRecord | None]:
        """The next journal position for a durable operation of the workflow body (a sleep, a
        message received, an event set), and what the journal recorded there."""
        self.state.check()
        if inside_step.get() is not None:
            raise RuntimeError(f"pgflow.{what} is for the workflow body, not for the inside of a step: a step "
                               "may run more than once, and its waits would not be journaled")
        position = self.journal.take()
        return position, self.recorded(position, name)

    def recorded(self, position: int, name: str) -> StepRecord | None:
        """The journal's record at ``position``, checked to be of ``name``."""
        record = self.journal.records.get(position)
        if record is not None and record.name != name:
            raise NonDeterministicWorkflow(
                f"workflow {self.workflow_id!r} called {name!r} at position {position}, "
                f"but its journal recorded {record.name!r} there. A workflow must make the same "
                "step calls in the same order on every run; move anything nondeterministic "
                "(time, randomness, I/O) into a step."
            )
        return record

    def call_step_from_thread(self, step: StepSpec, args: Any, kwargs: Any) -> Any:
        """The same journaled call, made from a sync workflow's thread."""
        return run_in_loop(self.call_step, step, args, kwargs, token=self.token)


def _unstarted(call: Coroutine[Any, Any, Any]) -> bool:
    return inspect.getcoroutinestate(call) == inspect.CORO_CREATED
