"""Running one claimed workflow: the step journal, replay, retries, and recording the outcome.

A workflow's steps are numbered in call order. A position the journal already holds returns its
recorded output (or raises its recorded exception) without running; a new position runs the step, with
retries, and records the final outcome once, fenced by the execution's attempt. Sync workflows run in a
thread and call back into the worker's loop for every journal operation, so there is one implementation
of a step call, not two.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import psycopg
from anyio.from_thread import run as run_in_loop

from .. import codec, telemetry
from ..errors import (
    CancelRequested,
    ExecutionInterrupted,
    LeaseLost,
    MaxAttemptsExceeded,
    NonDeterministicWorkflow,
    SerializationError,
    StoreUnavailable,
    WorkflowTimeout,
)
from .outcomes import describe, pickled, replay
from .registry import StepSpec, WorkflowSpec
from .runtime import Runtime
from .starts import StepStarts
from .store import Claimed, StepRecord, Store, retrying, unreachable
from .streams.writer import ChunkRefused, StreamWriter

log = logging.getLogger("pgflow.execution")
runs = logging.getLogger("pgflow.workflows")  # one line per workflow start and end

# The execution a piece of code runs on behalf of. Steps consult it to decide whether a call is
# journaled (inside a workflow) or plain (anywhere else, or inside another step), and child workflows
# started from a workflow derive their ids from it.
current_execution: ContextVar[Execution | None] = ContextVar("pgflow_execution", default=None)
inside_step: ContextVar[bool] = ContextVar("pgflow_inside_step", default=False)


def journaling() -> Execution | None:
    """The execution whose journal a step call made here belongs to, if any."""
    execution = current_execution.get()
    if execution is None or inside_step.get():
        return None
    return execution


@dataclass(eq=False)
class Execution:
    """One run of one workflow by one worker, identified by its attempt (the fencing token)."""

    runtime: Runtime
    store: Store
    workflow_id: str
    attempt: int
    journal: dict[int, StepRecord]
    token: anyio.lowlevel.EventLoopToken
    writer: StreamWriter | None = None
    starts: StepStarts | None = None  # the worker's batcher of step-start notes
    # Per stream key: the next free position in the table, and how far this run's deterministic
    # replay of the workflow body has got (see write_chunk).
    stream_ends: dict[str, int] = field(default_factory=dict)
    stream_cursor: dict[str, int] = field(default_factory=dict)
    closed_streams: set[str] = field(default_factory=set)
    next_position: int = 0
    interrupt: ExecutionInterrupted | None = field(default=None)
    # Step calls made in an async workflow and not yet started; one still unstarted when the body
    # returns was called without ``await``.
    unstarted: list[tuple[str, Coroutine[Any, Any, Any]]] = field(default_factory=list)

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
        record = self.journal.get(position)
        if record is not None:
            if record.name != step.name:
                raise NonDeterministicWorkflow(
                    f"workflow {self.workflow_id!r} called step {step.name!r} at position {position}, "
                    f"but its journal recorded {record.name!r} there. A workflow must make the same "
                    "step calls in the same order on every run; move anything nondeterministic "
                    "(time, randomness, I/O) into a step."
                )
            for key, end in (record.stream_ends or {}).items():
                self.stream_cursor[key] = max(self.stream_cursor.get(key, 0), end)
            return replay(record, step)
        attempt = 1
        while True:
            await self._fenced(partial(self._note_start, position, attempt), f"start step {step.name!r}")
            try:
                with telemetry.step(step.name, self.workflow_id, position, attempt):
                    output = await self._run_body(step, args, kwargs)
            except Exception as exc:
                if step.retry.should_retry(exc, attempt):
                    delay = step.retry.delay(attempt)
                    log.info("step %s of %s failed (%s), attempt %d; retrying in %.2fs",
                             step.name, self.workflow_id, exc, attempt, delay)
                    attempt += 1
                    await anyio.sleep(delay)
                    self.check_interrupt()
                    continue
                await self._record(position, step.name, None, describe(exc), pickled(exc), attempt)
                raise
            try:
                data, output = codec.checked(output, step.return_type, f"the output of step {step.name!r}")
            except SerializationError as exc:
                await self._record(position, step.name, None, describe(exc), pickled(exc), attempt)
                raise
            await self._record(position, step.name, data, None, None, attempt)
            # The workflow gets the value as decoded from the record, exactly what a replay returns.
            return output

    async def _run_body(self, step: StepSpec, args: Any, kwargs: Any) -> Any:
        token = inside_step.set(True)
        try:
            if step.is_async:
                return await step.fn(*args, **kwargs)
            context = contextvars.copy_context()
            # A thread cannot be interrupted: on cancellation it is abandoned, and fencing refuses
            # anything it tries to write after its workflow was given back.
            return await anyio.to_thread.run_sync(lambda: context.run(step.fn, *args, **kwargs),
                                                  abandon_on_cancel=True)
        finally:
            inside_step.reset(token)

    async def _note_start(self, position: int, tries: int) -> tuple[bool, bool]:
        if self.starts is not None:
            return await self.starts.note(self.workflow_id, self.attempt, position, tries)
        [answer] = await self.store.start_steps([(self.workflow_id, self.attempt, position, tries)])
        return answer

    async def _record(
        self, position: int, name: str, output: bytes | None, error: dict[str, Any] | None,
        exception: bytes | None, attempts: int,
    ) -> None:
        ends = dict(self.stream_ends)
        await self._fenced(lambda: self.store.record_step(
            self.workflow_id, self.attempt, position, name, output, error, exception, attempts, ends,
        ), f"record step {name!r}")
        for key, end in self.stream_ends.items():
            self.stream_cursor[key] = max(self.stream_cursor.get(key, 0), end)

    async def _fenced(self, write: Callable[[], Awaitable[tuple[bool, bool]]], what: str) -> None:
        """A journal write fenced by this execution's attempt, which says whether the execution still
        owns the workflow and whether it was cancelled; either news stops the run here."""
        try:
            owner, cancel = await retrying(write, what)
        except psycopg.Error as exc:
            if not unreachable(exc):
                raise
            # Not the workflow's failure: stop this run; the workflow is resumed once the
            # database is back (the writes are fenced and idempotent, so a retry cannot double one).
            self.interrupt = StoreUnavailable(f"cannot {what}: {exc}")
            raise self.interrupt from exc
        if not owner:
            self.interrupt = LeaseLost(f"workflow {self.workflow_id!r} attempt {self.attempt} lost its lease")
        elif cancel:
            self.interrupt = CancelRequested(f"workflow {self.workflow_id!r} was cancelled")
        self.check_interrupt()

    async def write_chunk(self, key: str, value: bytes | None) -> None:
        """Write a chunk (``None`` closes the stream) at the stream's next position.

        From a step, a chunk is appended after whatever the stream holds: a retried step's chunks
        follow those of its earlier attempts (``stream_offset`` tells it how many there were). From the
        workflow body, the n-th write to a key lands at the same position on every run, so a workflow
        replayed after a crash skips the writes that were already committed instead of repeating them.
        """
        self.check_interrupt()
        if key in self.closed_streams:
            raise ValueError(f"stream {key!r} of workflow {self.workflow_id!r} is closed")
        if value is None:
            self.closed_streams.add(key)
        end = self.stream_ends.get(key, 0)
        if not inside_step.get():
            cursor = self.stream_cursor.get(key, 0)
            self.stream_cursor[key] = cursor + 1
            if cursor < end:
                return
        self.stream_ends[key] = end + 1
        if self.writer is None:
            raise RuntimeError("streams are written by workflows run by a worker")
        await self.writer.write(self, key, end, value)
        self.check_interrupt()

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


async def execute(runtime: Runtime, store: Store, workflow: WorkflowSpec, claimed: Claimed,
                  limiter: anyio.CapacityLimiter, writer: StreamWriter | None = None,
                  freed: tuple[str, ...] = (), cancellers: dict[str, Callable[[], None]] | None = None,
                  starts: StepStarts | None = None) -> None:
    """Run a claimed workflow to its end and record that end, unless the run is interrupted.

    Anything that stops the run from outside (the worker shutting down, a lost connection) gives the
    workflow back to the queue at once, so another worker resumes it from its journal without waiting
    for the lease to expire. ``freed`` are pings for workers waiting on a limited queue's free slot.
    While it runs, ``cancellers[id]`` cancels it where it stands (its worker learnt that somebody
    cancelled it), and it is recorded as cancelled.
    """
    try:
        # A first attempt has nothing recorded yet: only a workflow run before has a journal to read.
        first = claimed.attempt == 1
        execution = Execution(
            runtime=runtime, store=store, workflow_id=claimed.id, attempt=claimed.attempt,
            journal={} if first else await store.journal(claimed.id),
            token=anyio.lowlevel.current_token(), writer=writer, starts=starts,
            stream_ends={} if first else await store.stream_ends(claimed.id),
        )
        with telemetry.running(workflow.name, claimed.queue, claimed.id, claimed.attempt, claimed.traceparent,
                               claimed.waited) as span:
            began = time.monotonic()
            runs.info("workflow %s %s started (attempt %d)", workflow.name, claimed.id, claimed.attempt)
            outcome = _refused(claimed)
            if outcome is None:
                with anyio.CancelScope() as scope:
                    if cancellers is not None:
                        cancellers[claimed.id] = lambda: _cancel(execution, scope)
                    try:
                        outcome = await _run_in_time(workflow, claimed, execution, limiter)
                    finally:
                        if cancellers is not None:
                            cancellers.pop(claimed.id, None)
                if scope.cancelled_caught:
                    outcome = "cancelled", None, None
            if outcome is not None and await _finish(runtime, store, execution, *outcome, freed=freed):
                telemetry.ended(span, workflow.name, claimed.queue, outcome[0], outcome[2])
                _log_end(workflow.name, claimed, outcome, time.monotonic() - began)
    except BaseException:
        with anyio.CancelScope(shield=True):
            try:
                if await retrying(lambda: store.release(claimed.id, claimed.attempt),
                                  f"giving {claimed.id} back to the queue"):
                    runtime.ping([f"q:{claimed.queue}"])  # its own queue (with_options may have moved it)
            except Exception as exc:  # noqa: BLE001 - the lease runs out and another worker takes over
                log.warning("could not give %s back to the queue: %s", claimed.id, exc)
        raise


Outcome = tuple[str, bytes | None, dict[str, Any] | None]


def _cancel(execution: Execution, scope: anyio.CancelScope) -> None:
    """Stop a running workflow now, not at its next step: anything it tries to write after this is
    refused, and its end is recorded as cancelled."""
    execution.interrupt = CancelRequested(f"workflow {execution.workflow_id!r} was cancelled")
    scope.cancel()


def _refused(claimed: Claimed) -> Outcome | None:
    """The failure to record instead of running, for a poison workflow or one past its deadline."""
    if claimed.max_attempts is not None and claimed.attempt > claimed.max_attempts:
        return "failed", None, describe(MaxAttemptsExceeded(
            f"workflow {claimed.id!r} was claimed {claimed.max_attempts} times without finishing"))
    if claimed.seconds_left is not None and claimed.seconds_left <= 0:
        return "failed", None, describe(WorkflowTimeout(f"workflow {claimed.id!r} ran out of time"))
    return None


async def _run_in_time(workflow: WorkflowSpec, claimed: Claimed, execution: Execution,
                       limiter: anyio.CapacityLimiter) -> Outcome | None:
    """Run the workflow, cut short when its timeout passes (a sync one's thread is abandoned and
    refused any further write)."""
    if claimed.seconds_left is None:
        return await _run(workflow, claimed, execution, limiter)
    with anyio.move_on_after(claimed.seconds_left) as scope:
        return await _run(workflow, claimed, execution, limiter)
    assert scope.cancelled_caught
    message = f"workflow {claimed.id!r} did not finish within its timeout of {workflow.timeout}s"
    execution.interrupt = CancelRequested(message)
    return "failed", None, describe(WorkflowTimeout(message))


async def _run(workflow: WorkflowSpec, claimed: Claimed, execution: Execution,
               limiter: anyio.CapacityLimiter) -> Outcome | None:
    """The workflow function's outcome as (status, output, error); None when the lease was lost."""
    reset = current_execution.set(execution)
    try:
        args, kwargs = workflow.codec.decode_arguments(claimed.inputs)
        if workflow.is_async:
            try:
                result = await workflow.fn(*args, **kwargs)
            except BaseException:
                execution.check_awaited(report=False)
                raise
            execution.check_awaited()
        else:
            context = contextvars.copy_context()
            result = await anyio.to_thread.run_sync(
                lambda: context.run(workflow.fn, *args, **kwargs), limiter=limiter,
                abandon_on_cancel=True,
            )
        return "succeeded", workflow.codec.encode_result(result), None
    except CancelRequested:
        return "cancelled", None, None
    except ChunkRefused as exc:
        telemetry.failed(exc)
        return "failed", None, describe(exc)
    except LeaseLost as exc:
        log.warning("%s; leaving it to its new owner", exc)
        return None
    except Exception as exc:  # noqa: BLE001 - any exception is the workflow's recorded failure
        telemetry.failed(exc)
        return "failed", None, describe(exc)
    finally:
        current_execution.reset(reset)


async def _finish(runtime: Runtime, store: Store, execution: Execution, status: str,
                  output: bytes | None, error: dict[str, Any] | None, freed: tuple[str, ...] = ()) -> bool:
    """Record the end (True when it was this execution's to record); ``freed`` are pings for
    workers waiting on a limited queue's free slot."""
    keys = {f"wf:{execution.workflow_id}", *freed}
    pings = runtime.pings_to_carry(keys)
    # Tried again while the server is away or drops the statement: an end not recorded would leave the
    # workflow to its lease. (A first try that committed unseen makes the second find the workflow
    # ended, which reads as a lost lease: nothing is recorded twice.)
    if await retrying(lambda: store.finish(execution.workflow_id, execution.attempt, status, output, error, pings),
                      f"recording the end of {execution.workflow_id}"):
        runtime.announced(keys, pings)
        return True
    log.warning("workflow %r attempt %d lost its lease before it could record %s",
                execution.workflow_id, execution.attempt, status)
    return False


def _log_end(name: str, claimed: Claimed, outcome: Outcome, seconds: float) -> None:
    """One line per workflow end at INFO; a failure at WARNING, with its traceback."""
    status, _, error = outcome
    if status == "failed" and error is not None:
        runs.warning("workflow %s %s failed in %.3fs (attempt %d): %s: %s\n%s", name, claimed.id, seconds,
                     claimed.attempt, error.get("type"), error.get("message"), error.get("traceback", ""))
    else:
        runs.info("workflow %s %s %s in %.3fs (attempt %d)", name, claimed.id, status, seconds, claimed.attempt)
