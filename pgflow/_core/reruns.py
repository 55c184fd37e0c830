"""A workflow's own retry policy: a body that raised runs again, later, from its journal.

The failed run gives its slot back (the workflow is queued again, due after the policy's backoff) and
the claim that takes it up replays the recorded steps; the step whose record is the error runs again,
as after ``resume()``. Only what the body itself raised is retried: not a timeout, a cancellation, a
lost lease, nor arguments that do not decode.
"""

from __future__ import annotations

import logging

import anyio

from .engine import Claimed, Engine, retrying
from .outcomes import Outcome, runs
from .registry import WorkflowSpec
from .run_state import ChunkRefused
from .runtime import Runtime
from .signals import News
from .signals import keys as signal_keys
from .status import Status

log = logging.getLogger("pgflow.execution")


async def retried(runtime: Runtime, store: Engine, workflow: WorkflowSpec, claimed: Claimed, outcome: Outcome,
                  failure: BaseException | None, freed: tuple[str, ...]) -> bool:
    """True when the failed ``outcome`` was given back to run again under the workflow's policy
    (or the claim was lost meanwhile); False when it is to be recorded as the workflow's end."""
    policy = workflow.retry
    error = outcome.error
    if (policy is None or outcome.status != Status.FAILED or error is None or not isinstance(failure, Exception)
            or isinstance(failure, ChunkRefused)):
        return False
    policy_attempt = claimed.retries + 1  # this run of the body under its policy, the failed ones counted
    if not policy.should_retry(failure, policy_attempt):
        return False
    delay = policy.delay(policy_attempt)
    with anyio.CancelScope(shield=True):
        try:
            rerun = await retrying(lambda: store.reruns.retry_later(claimed.id, claimed.lease_token, delay, error),
                                   f"queueing {claimed.id} to run again")
        except Exception as exc:  # noqa: BLE001 - the lease runs out; the next claim fails it or runs it
            log.warning("could not queue %s to run again: %s", claimed.id, exc)
            return True
    if rerun is None:
        log.warning("workflow %r attempt %d lost its lease before it could be retried", claimed.id, claimed.run)
        return True
    runs.info("workflow %s %s failed (run %d of %d: %s: %s); %s", workflow.name, claimed.id, policy_attempt,
              policy.max_attempts, error.get("type"), error.get("message"),
              f"runs again in {delay:.2f}s" if rerun.status == Status.QUEUED else "cancelled meanwhile")
    ended = [signal_keys.ended(claimed.id)] if rerun.status == Status.CANCELLED else []
    told = {signal_keys.queue(rerun.queue), *freed, *ended}
    runtime.signals.announce(News(sorted(told)))
    return True
