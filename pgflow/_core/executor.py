"""Running one claimed workflow to its end: the body under its timeout and cancellation, then its
end recorded (or, for a workflow that waits long, its slot given back until it is due again).

The journal each run keeps is ``execution.py``'s; this module decides what becomes of the run.
"""

from __future__ import annotations

import contextvars
import logging
import time
from dataclasses import dataclass

import anyio
import anyio.lowlevel

from ..errors import CancelRequested, LeaseLost, Suspended, WorkflowTimeout
from . import telemetry
from .cancels import CancelWatch
from .clock import OWNER
from .current import current_execution
from .engine import Claimed, Engine, retrying
from .execution import Execution
from .finisher import Finisher
from .outcomes import CANCELLED, Outcome, log_end, refused, runs
from .registry import WorkflowSpec
from .reruns import retried
from .run_journal import RunJournal
from .run_state import ChunkRefused, RunState, TimedOut
from .run_streams import RunStreams
from .runtime import Runtime
from .signals import End, News
from .signals import keys as signal_keys
from .status import Status
from .step_starts import StepStarts
from .streams.writer import StreamWriter

log = logging.getLogger("pgflow.execution")


@dataclass(frozen=True)
class Slot:
    """What a worker lends every execution it runs, passed as one: the executor's helpers need most
    of it, and a list of nine arguments at every call hid which one each used."""

    runtime: Runtime
    store: Engine
    limiter: anyio.CapacityLimiter
    writer: StreamWriter
    finisher: Finisher
    token: anyio.lowlevel.EventLoopToken
    # The cancel of each running run by workflow id (``RunState.cancel``): how the worker's heartbeat
    # and its cancel watch reach a run they hear was cancelled.
    runs_by_id: dict[str, RunState] | None = None
    starts: StepStarts | None = None
    cancels: CancelWatch | None = None  # hears of cancellations for runs fenced by their worker


async def run_claimed(slot: Slot, workflow: WorkflowSpec, claimed: Claimed, scope: anyio.CancelScope,
                      freed: tuple[str, ...] = ()) -> None:
    """Run a claimed workflow to its end and record that end, unless the run is interrupted.

    Anything that stops the run from outside (the worker shutting down, cancelling ``scope``, or a
    lost connection) gives the workflow back to the queue at once, so another worker resumes it from
    its journal without waiting for the lease to expire. ``freed`` are pings for workers waiting on a
    limited queue's free slot. A cancel cancels it where it stands (``RunState.cancel``, which
    cancels ``scope`` too), and it is recorded as cancelled. (``scope`` holds the body only: a stop
    that comes while a resumed run reads its journal lets the read finish, and the body then stops at
    its first await.)
    """
    execution: Execution | None = None
    try:
        execution = await _open(slot, workflow, claimed, scope)
        with telemetry.running(workflow.name, claimed.queue, claimed.id, claimed.run, claimed.traceparent,
                               claimed.waited) as span:
            began = time.monotonic()
            # At DEBUG: at INFO (the CLI's default) one line per workflow, its end, is enough and is half
            # the cost (two lines a workflow were a sixth of a no-op's worker CPU).
            runs.debug("workflow %s %s started (attempt %d)", workflow.name, claimed.id, claimed.run)
            outcome = refused(claimed)
            if outcome is None:
                outcome = await _run_cancellable(slot, workflow, claimed, execution, scope)
            if outcome is not None:
                await _settle(slot, execution)
            if outcome is not None and await retried(slot.runtime, slot.store, workflow, claimed, outcome,
                                                     execution.state.failure, freed):
                telemetry.ended(span, "retried", outcome.error)
                outcome = None
            if outcome is not None:
                telemetry.ended(span, outcome.status.value, outcome.error)
                await _finish(slot.finisher, execution, claimed, workflow, outcome, began, freed)
    except Suspended as pause:
        assert execution is not None
        execution.state.interrupt(pause)  # a sync body's thread, should it go on, writes nothing more
        await _settle(slot, execution)
        await _suspend(slot.runtime, slot.store, workflow, claimed, pause, freed)
    except _Stopped:
        assert execution is not None
        await _settle(slot, execution)
        await _give_back(slot, claimed, execution.streams.fence_cut)
    except BaseException:
        if execution is not None:
            await _settle(slot, execution)
        await _give_back(slot, claimed, execution.streams.fence_cut if execution is not None else None)
        raise


async def _settle(slot: Slot, execution: Execution) -> None:
    """Before the workflow changes hands: the run writes no chunk more, and those it has in flight
    are committed (or refused) first, shielded (see ``StreamWriter.settle``)."""
    settled = slot.writer.settle(execution.streams)
    if settled is not None:
        with anyio.CancelScope(shield=True):
            await settled


async def _open(slot: Slot, workflow: WorkflowSpec, claimed: Claimed, scope: anyio.CancelScope) -> Execution:
    """The execution of a claimed run, with what earlier runs recorded: its journal and where each of
    its streams ends. A first attempt has nothing recorded yet, so only a run before it is read.
    ``scope`` is what its body runs in, which its cancel cancels."""
    first = claimed.attempt == 1
    journal, horizon = ({}, -1) if first else await slot.store.journal.journal(claimed.id)
    # Tries of steps that earlier runs began and did not record: only a run after a crash, a stop or a
    # lost lease has any (a run that waits or is retried leaves its steps recorded or their notes gone).
    fresh = first or claimed.uncounted and not claimed.suspect
    tries = {} if fresh else await slot.store.details.tries_begun(claimed.id)
    # After the read, not before it: the journal's time left until a wake-up was computed on the server
    # meanwhile, and a clock started before the read would end a replayed sleep early.
    loaded_at = slot.runtime.hub.clock.monotonic()
    ends = None if first else await slot.store.chunks.stream_ends(claimed.id)
    state = RunState(claimed.id, claimed.run, scope)
    return Execution(
        runtime=slot.runtime, store=slot.store, workflow_id=claimed.id, attempt=claimed.attempt,
        lease_token=claimed.lease_token, journal=RunJournal(journal, horizon, tries, loaded_at), token=slot.token,
        state=state, streams=RunStreams(state, slot.writer, claimed.id, claimed.lease_token, ends, claimed.fence,
                                        slot.cancels),
        starts=slot.starts, run=claimed.run, value_limit=workflow.codec.limit, alone=claimed.suspect,
    )


class _Stopped(Exception):
    """The run's scope was cancelled by its worker stopping, not by a cancellation request."""


async def _run_cancellable(slot: Slot, workflow: WorkflowSpec, claimed: Claimed,
                           execution: Execution, scope: anyio.CancelScope) -> Outcome | None:
    """The body's outcome, run in ``scope`` with its cancel registered for as long as it runs: a
    cancellation that its worker hears of stops it where it stands, and the outcome is then
    "cancelled". The worker stopping cancels ``scope`` too (``_Stopped``: the run is given back)."""
    outcome: Outcome | None
    with scope:
        state = execution.state
        runs_by_id = slot.runs_by_id
        if runs_by_id is not None:
            runs_by_id[claimed.id] = state
        try:
            # (Without a timeout the body runs right here: one frame less to resume each time it
            # wakes, which a streaming body does once per chunk.)
            outcome = await (_run(workflow, claimed, execution, slot.limiter) if claimed.seconds_left is None
                             else _run_in_time(workflow, claimed, execution, slot.limiter, claimed.seconds_left))
        finally:
            if runs_by_id is not None and runs_by_id.get(claimed.id) is state:
                del runs_by_id[claimed.id]  # not another execution's of the same id
    if scope.cancelled_caught:
        if execution.state.cancelled:
            return CANCELLED
        raise _Stopped
    return outcome


async def _give_back(slot: Slot, claimed: Claimed, fence_cut: str | None = None) -> None:
    """Return an interrupted run's workflow to the queue at once, shielded (the interruption may be
    a cancellation): another worker then takes it up without waiting for its lease to run out.
    ``fence_cut``: a batch of its chunks under that worker's fence was cut off and may still run."""
    with anyio.CancelScope(shield=True):
        try:
            if await retrying(lambda: slot.store.claims.release(claimed.id, claimed.lease_token, fence_cut),
                              f"giving {claimed.id} back to the queue"):
                # Its own queue (with_options may have moved it).
                slot.runtime.signals.announce(News([signal_keys.queue(claimed.queue)]))
        except Exception as exc:  # noqa: BLE001 - the lease runs out and another worker takes over
            log.warning("could not give %s back to the queue: %s", claimed.id, exc)


async def give_back_unrun(slot: Slot, claimed: list[Claimed]) -> None:
    """Return workflows claimed but never run (the worker began to stop while the claim ran) to the
    queue as they were before the claim: no attempt of theirs is counted for a run that never was."""
    if not claimed:
        return
    with anyio.CancelScope(shield=True):
        try:
            given = await retrying(lambda: slot.store.claims.unclaim(claimed), "giving unrun claims back to the queue")
        except Exception as exc:  # noqa: BLE001 - their leases run out and another worker takes over
            log.warning("could not give %d unrun workflows back to the queue: %s", len(claimed), exc)
            return
    queues = {c.queue for c in claimed if c.id in given}
    if queues:
        slot.runtime.signals.announce(News(sorted(signal_keys.queue(q) for q in queues)))


async def _suspend(runtime: Runtime, store: Engine, workflow: WorkflowSpec, claimed: Claimed, pause: Suspended,
                   freed: tuple[str, ...]) -> None:
    """Give the slot of a workflow that waits long back: queued again, due when its wait ends."""
    with anyio.CancelScope(shield=True):
        try:
            requeued = await retrying(lambda: store.waits.suspend(claimed.id, claimed.lease_token, pause.until,
                                                            pause.topic), f"suspending {claimed.id}")
        except Exception as exc:  # noqa: BLE001 - the lease runs out; a new run comes back to the wait
            log.warning("could not give %s back to the queue while it waits: %s", claimed.id, exc)
            return
    if requeued is None:
        log.warning("workflow %r attempt %d lost its lease before it could wait", claimed.id, claimed.run)
        return
    cancelled = requeued.status == Status.CANCELLED
    runs.info("workflow %s %s %s", workflow.name, claimed.id,
              "cancelled while it waited" if cancelled else f"{pause} (slot given back)")
    # Workers look at the queue again, so they know when it falls due (and a limited queue's slot is free).
    told = {signal_keys.queue(requeued.queue), *freed, *([signal_keys.ended(claimed.id)] if cancelled else [])}
    runtime.signals.announce(News(sorted(told)))


async def _run_in_time(workflow: WorkflowSpec, claimed: Claimed, execution: Execution,
                       limiter: anyio.CapacityLimiter, seconds_left: float) -> Outcome | None:
    """Run the workflow, cut short when its timeout passes (a sync one's thread is abandoned and
    refused any further write)."""
    with execution.runtime.hub.clock.move_on_after(seconds_left) as scope:
        return await _run(workflow, claimed, execution, limiter)
    assert scope.cancelled_caught
    message = f"workflow {claimed.id!r} did not finish within its timeout of {workflow.timeout}s"
    execution.state.interrupt(TimedOut(message))
    return Outcome.failed(WorkflowTimeout(message))


async def _run(workflow: WorkflowSpec, claimed: Claimed, execution: Execution,
               limiter: anyio.CapacityLimiter) -> Outcome | None:
    """The workflow function's outcome; None when the lease was lost."""
    reset = current_execution.set(execution)
    OWNER.set(execution.workflow_id)  # (this task's own context: it ends with the run)
    try:
        args, kwargs = workflow.codec.decode_arguments(claimed.inputs)
        if workflow.is_async:
            try:
                result = await workflow.fn(*args, **kwargs)
            except BaseException as exc:
                execution.state.failed(exc)
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
                execution.state.failed(exc)
                raise
        return Outcome(Status.SUCCEEDED, workflow.codec.encode_result(result))
    except CancelRequested:
        return CANCELLED
    except ChunkRefused as exc:
        telemetry.failed(exc)
        return Outcome.failed(exc)
    except LeaseLost as exc:
        log.warning("%s; leaving it to its new owner", exc)
        return None
    except Exception as exc:  # noqa: BLE001 - any exception is the workflow's recorded failure
        telemetry.failed(exc)
        return Outcome.failed(exc)
    finally:
        current_execution.reset(reset)


async def _finish(finisher: Finisher, execution: Execution, claimed: Claimed, workflow: WorkflowSpec,
                  outcome: Outcome, began: float, freed: tuple[str, ...] = ()) -> None:
    """Hand the end to the worker's next batch of ends, and what follows its commit (the log line,
    the count) with it; ``freed`` are pings for workers waiting on a limited queue's free slot. The
    execution does not wait: the body is done, and a worker stopping now records what its finisher
    holds rather than giving a finished workflow back to be run again. Only a finisher that has
    stopped already makes the end be recorded here, shielded."""
    status = outcome.status.value  # a plain str: carried ends reach callers as rows read back do
    end = End(execution.workflow_id, claimed.born, execution.attempt, workflow.name, status, outcome.output,
              outcome.error)

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

    if not finisher.finish_soon(end, execution.lease_token, set(freed), then):
        with anyio.CancelScope(shield=True):
            then(*await finisher.finish(end, execution.lease_token, set(freed)))
