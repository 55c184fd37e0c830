"""Running one claimed workflow to its end: the body under its timeout and cancellation, then its
end recorded (or, for a workflow that waits long, its slot given back until it is due again).

The journal each run keeps is ``execution.py``'s; this module decides what becomes of the run.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Callable

import anyio
import anyio.lowlevel

from .. import telemetry
from ..errors import CancelRequested, LeaseLost, Suspended, WorkflowTimeout
from .clock import OWNER
from .execution import Execution, current_execution
from .finisher import Finisher
from .outcomes import Outcome, describe, log_end, refused, runs
from .registry import WorkflowSpec
from .reruns import retried
from .runtime import Runtime
from .signals import End, News
from .signals import keys as signal_keys
from .starts import StepStarts
from .store import Claimed, Store, retrying
from .streams.writer import ChunkRefused, StreamWriter

log = logging.getLogger("pgflow.execution")


async def execute(runtime: Runtime, store: Store, workflow: WorkflowSpec, claimed: Claimed,
                  limiter: anyio.CapacityLimiter, writer: StreamWriter, finisher: Finisher,
                  freed: tuple[str, ...] = (), cancellers: dict[str, Callable[[], None]] | None = None,
                  starts: StepStarts | None = None, token: anyio.lowlevel.EventLoopToken | None = None) -> None:
    """Run a claimed workflow to its end and record that end, unless the run is interrupted.

    Anything that stops the run from outside (the worker shutting down, a lost connection) gives the
    workflow back to the queue at once, so another worker resumes it from its journal without waiting
    for the lease to expire. ``freed`` are pings for workers waiting on a limited queue's free slot.
    While it runs, ``cancellers[id]`` cancels it where it stands (its worker learnt that somebody
    cancelled it), and it is recorded as cancelled.
    """
    try:
        token = token or anyio.lowlevel.current_token()  # (a worker passes its loop's, found once)
        # A first attempt has nothing recorded yet: only a workflow run before has a journal to read.
        first = claimed.attempt == 1
        loaded_at = runtime.hub.clock.monotonic()
        journal, horizon = ({}, -1) if first else await store.journal(claimed.id)
        execution = Execution(
            runtime=runtime, store=store, workflow_id=claimed.id, attempt=claimed.attempt, lease=claimed.lease,
            journal=journal, horizon=horizon,
            token=token, writer=writer, starts=starts,
            stream_ends={} if first else await store.stream_ends(claimed.id), run=claimed.run,
            loaded_at=loaded_at, value_limit=workflow.codec.limit,
        )
        with telemetry.running(workflow.name, claimed.queue, claimed.id, claimed.attempt, claimed.traceparent,
                               claimed.waited) as span:
            began = time.monotonic()
            # At DEBUG: at INFO (the CLI's default) one line per workflow, its end, is enough and is half
            # the cost (two lines a workflow were a sixth of a no-op's worker CPU).
            runs.debug("workflow %s %s started (attempt %d)", workflow.name, claimed.id, claimed.run)
            outcome = refused(claimed)
            if outcome is None:
                with anyio.CancelScope() as scope:
                    def canceller() -> None:
                        _cancel(execution, scope)

                    if cancellers is not None:
                        cancellers[claimed.id] = canceller
                    try:
                        # (Without a timeout the body runs right here: one frame less to resume
                        # each time it wakes, which a streaming body does once per chunk.)
                        outcome = await (_run(workflow, claimed, execution, limiter) if claimed.seconds_left is None
                                         else _run_in_time(workflow, claimed, execution, limiter, claimed.seconds_left))
                    finally:
                        if cancellers is not None and cancellers.get(claimed.id) is canceller:
                            del cancellers[claimed.id]  # not another execution's of the same id
                if scope.cancelled_caught:
                    outcome = "cancelled", None, None
            if outcome is not None and await retried(runtime, store, workflow, claimed, outcome, execution.failure,
                                                     freed):
                telemetry.ended(span, "retried", outcome[2])
                outcome = None
            if outcome is not None:
                telemetry.ended(span, outcome[0], outcome[2])
                await _finish(finisher, execution, claimed, workflow, outcome, began, freed)
    except Suspended as pause:
        execution.interrupt = pause  # a sync body's thread, should it go on, writes nothing more
        await _suspend(runtime, store, workflow, claimed, pause, freed)
    except BaseException:
        with anyio.CancelScope(shield=True):
            try:
                if await retrying(lambda: store.release(claimed.id, claimed.lease),
                                  f"giving {claimed.id} back to the queue"):
                    # Its own queue (with_options may have moved it).
                    runtime.signals.announce(News([signal_keys.queue(claimed.queue)]))
            except Exception as exc:  # noqa: BLE001 - the lease runs out and another worker takes over
                log.warning("could not give %s back to the queue: %s", claimed.id, exc)
        raise


async def _suspend(runtime: Runtime, store: Store, workflow: WorkflowSpec, claimed: Claimed, pause: Suspended,
                   freed: tuple[str, ...]) -> None:
    """Give the slot of a workflow that waits long back: queued again, due when its wait ends."""
    with anyio.CancelScope(shield=True):
        try:
            found = await retrying(lambda: store.suspend(claimed.id, claimed.lease, pause.until, pause.topic),
                                   f"suspending {claimed.id}")
        except Exception as exc:  # noqa: BLE001 - the lease runs out; a new run comes back to the wait
            log.warning("could not give %s back to the queue while it waits: %s", claimed.id, exc)
            return
    if found is None:
        log.warning("workflow %r attempt %d lost its lease before it could wait", claimed.id, claimed.run)
        return
    queue, status = found
    runs.info("workflow %s %s %s", workflow.name, claimed.id,
              f"{pause} (slot given back)" if status == "queued" else "cancelled while it waited")
    # Workers look at the queue again, so they know when it falls due (and a limited queue's slot is free).
    told = {signal_keys.queue(queue), *freed, *([signal_keys.ended(claimed.id)] if status == "cancelled" else [])}
    runtime.signals.announce(News(sorted(told)))


def _cancel(execution: Execution, scope: anyio.CancelScope) -> None:
    """Stop a running workflow now, not at its next step: anything it tries to write after this is
    refused, and its end is recorded as cancelled."""
    execution.interrupt = CancelRequested(f"workflow {execution.workflow_id!r} was cancelled")
    scope.cancel()


async def _run_in_time(workflow: WorkflowSpec, claimed: Claimed, execution: Execution,
                       limiter: anyio.CapacityLimiter, seconds_left: float) -> Outcome | None:
    """Run the workflow, cut short when its timeout passes (a sync one's thread is abandoned and
    refused any further write)."""
    with execution.runtime.hub.clock.move_on_after(seconds_left) as scope:
        return await _run(workflow, claimed, execution, limiter)
    assert scope.cancelled_caught
    message = f"workflow {claimed.id!r} did not finish within its timeout of {workflow.timeout}s"
    execution.interrupt = CancelRequested(message)
    return "failed", None, describe(WorkflowTimeout(message))


async def _run(workflow: WorkflowSpec, claimed: Claimed, execution: Execution,
               limiter: anyio.CapacityLimiter) -> Outcome | None:
    """The workflow function's outcome as (status, output, error); None when the lease was lost."""
    reset = current_execution.set(execution)
    OWNER.set(execution.workflow_id)  # (this task's own context: it ends with the run)
    try:
        args, kwargs = workflow.codec.decode_arguments(claimed.inputs)
        if workflow.is_async:
            try:
                result = await workflow.fn(*args, **kwargs)
            except BaseException as exc:
                execution.failure = exc
                execution.check_awaited(report=False)
                raise
            execution.check_awaited()
        else:
            context = contextvars.copy_context()
            try:
                result = await anyio.to_thread.run_sync(
                    lambda: context.run(workflow.fn, *args, **kwargs), limiter=limiter,
                    abandon_on_cancel=True,
                )
            except BaseException as exc:
                execution.failure = exc
                raise
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


async def _finish(finisher: Finisher, execution: Execution, claimed: Claimed, workflow: WorkflowSpec,
                  outcome: Outcome, began: float, freed: tuple[str, ...] = ()) -> None:
    """Hand the end to the worker's next batch of ends, and what follows its commit (the log line,
    the count) with it; ``freed`` are pings for workers waiting on a limited queue's free slot. The
    execution does not wait: the body is done, and a worker stopping now records what its finisher
    holds rather than giving a finished workflow back to be run again. Only a finisher that has
    stopped already makes the end be recorded here, shielded."""
    status, output, error = outcome
    end = End(execution.workflow_id, claimed.born, execution.attempt, workflow.name, status, output, error)

    def then(recorded: bool, failure: BaseException | None) -> None:
        if failure is not None:
            log.warning("could not record the end of workflow %r (%s): its lease runs out and another worker"
                        " runs it again", execution.workflow_id, failure)
        elif recorded:
            telemetry.finished(workflow.name, claimed.queue, status)
            log_end(workflow.name, claimed, outcome, time.monotonic() - began)
        else:
            log.warning("workflow %r attempt %d lost its lease before it could record %s",
                        execution.workflow_id, execution.run, status)

    if not finisher.finish_soon(end, execution.lease, set(freed), then):
        with anyio.CancelScope(shield=True):
            then(*await finisher.finish(end, execution.lease, set(freed)))
