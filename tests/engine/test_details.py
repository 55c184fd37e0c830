"""The details port (``note_step_error``, ``tries_begun``, ``details``) and the management port's
``resume``: what is kept for the people who look at a workflow, and queueing an ended one again."""

from __future__ import annotations

import pytest

from pgflow._core.engine import NO_PINGS, Claimed, Engine, Fence, StepStart
from pgflow._core.engine.details import KEEP_ATTEMPT_ERRORS

from .kit import Kind, unique

pytestmark = pytest.mark.anyio


def failure(n: int) -> dict[str, str]:
    return {"type": "E", "message": f"try {n}"}


async def record(engine: Engine, claimed: Claimed, position: int, failed: bool = False) -> None:
    fence = await engine.journal.record_step(claimed.id, claimed.attempt, claimed.lease_token, position, f"s{position}",
                                             None if failed else b"ok", failure(0) if failed else None, 1)
    assert fence.owner


class TestDetails:
    """``note_step_error`` keeps the error of a step try that is retried, for the claim holding the
    workflow (fenced: a lost token keeps nothing), the latest ``KEEP_ATTEMPT_ERRORS`` per step.
    ``details`` reads one workflow whole from one snapshot (None: no such workflow): its row (the
    attempt as the run counted against its budget), its first step records and how many there are,
    the kept errors, the steps begun and not recorded (their tries), and its streams (chunks, closed)."""

    async def written(self, engine: Engine, kind: Kind) -> Claimed:
        """A running workflow with two steps recorded, a third begun (two tries, the first failed) and
        two streams (one closed)."""
        claimed = await kind.run(engine, "reader", priority=3, max_attempts=5)
        await record(engine, claimed, 0)
        await record(engine, claimed, 1)
        await engine.journal.start_steps([StepStart(claimed.id, claimed.attempt, claimed.lease_token, 2, 2)])
        assert await engine.details.note_step_error(claimed.id, claimed.lease_token, 2, claimed.run, 1,
                                                    failure(1)) == Fence(True, False)
        ids = await engine.chunks.stream_ids([claimed.id, claimed.id], ["open", "shut"])
        owners = [(claimed.id, claimed.lease_token)]
        await engine.chunks.write_chunks(owners, [1, 1, 1], [ids[(claimed.id, "open")], ids[(claimed.id, "shut")],
                                                             ids[(claimed.id, "shut")]],
                                         [0, 0, 1], [b"a", b"b", None], NO_PINGS)
        return claimed

    async def test_a_workflow_read_whole(self, engine: Engine) -> None:
        kind = Kind()
        claimed = await self.written(engine, kind)
        read = await engine.details.details(claimed.id, 10)
        assert read is not None
        row = read.workflow
        assert (row.id, row.name, row.queue, row.status, row.attempt, row.priority, row.lease_owner,
                row.max_attempts, row.cancel_requested) == \
            (claimed.id, kind.name, kind.queue, "running", 1, 3, "reader", 5, False)
        assert [s.position for s in read.steps] == [0, 1] and read.steps_total == 2
        assert [(e.position, e.run, e.step_attempt, e.error) for e in read.attempt_errors] == [(2, 1, 1, failure(1))]
        assert [(b.position, b.tries) for b in read.begun] == [(2, 2)]
        assert [(s.key, s.chunks, s.closed) for s in read.streams] == [("open", 1, False), ("shut", 1, True)]
        assert await engine.details.details(unique("none"), 10) is None

    async def test_a_read_of_the_first_steps_counts_them_all(self, engine: Engine) -> None:
        claimed = await self.written(engine, Kind())
        read = await engine.details.details(claimed.id, 1)
        assert read is not None
        assert [s.position for s in read.steps] == [0] and read.steps_total == 2
        assert [(b.position, b.tries) for b in read.begun] == [(2, 2)]

    async def test_a_read_of_the_first_steps_keeps_the_errors_of_the_steps_begun(self, engine: Engine) -> None:
        claimed = await self.written(engine, Kind())
        read = await engine.details.details(claimed.id, 1)
        assert read is not None
        assert [(e.position, e.step_attempt) for e in read.attempt_errors] == [(2, 1)]

    async def test_errors_kept_are_fenced_and_bounded(self, engine: Engine) -> None:
        kind = Kind()
        lost = await kind.run(engine)
        await engine.claims.release(lost.id, lost.lease_token)
        claimed = await kind.claim_one(engine)
        assert (await engine.details.note_step_error(lost.id, lost.lease_token, 0, 1, 1, failure(1))).owner is False
        for n in range(1, KEEP_ATTEMPT_ERRORS + 3):
            await engine.details.note_step_error(claimed.id, claimed.lease_token, 0, claimed.run, n, failure(n))
        read = await engine.details.details(claimed.id, 10)
        assert read is not None
        assert [e.step_attempt for e in read.attempt_errors] == list(range(3, KEEP_ATTEMPT_ERRORS + 3))


class TestResume:
    """``resume`` queues a failed or cancelled workflow again, due now, from its first step record that
    holds an error (it and every later record go, the others stay, and every try noted); its budgets
    (runs, and the retries of its retry policy) start afresh and a cancellation asked for is forgotten.
    It answers the status the workflow had and its queue; a workflow in any other status is left as it
    is; None: no such workflow."""

    async def test_a_failed_workflow_runs_again_from_its_failed_step(self, engine: Engine) -> None:
        kind = Kind()
        claimed = await kind.run(engine, max_attempts=1)
        await record(engine, claimed, 0)
        await record(engine, claimed, 1, failed=True)
        await record(engine, claimed, 2)
        await engine.ends.finish_many([claimed.id], [claimed.lease_token], ["failed"], [None], [failure(0)], NO_PINGS)
        assert await engine.management.resume(claimed.id) == ("failed", kind.queue)
        row = await engine.workflows.workflow(claimed.id)
        assert row is not None and (row.status, row.error, row.output) == ("queued", None, None)
        assert sorted((await engine.journal.journal(claimed.id))[0]) == [0]
        again = await kind.claim_one(engine)
        assert (again.id, again.run, again.give_up) == (claimed.id, 1, False)

    async def test_the_retry_policy_starts_afresh(self, engine: Engine) -> None:
        kind = Kind()
        claimed = await kind.run(engine)
        for _ in range(2):
            assert await engine.reruns.retry_later(claimed.id, claimed.lease_token, 0.0, failure(0)) is not None
            claimed = await kind.claim_one(engine)
        assert claimed.retries == 2
        await engine.ends.finish_many([claimed.id], [claimed.lease_token], ["failed"], [None], [failure(0)], NO_PINGS)
        assert await engine.management.resume(claimed.id) == ("failed", kind.queue)
        again = await kind.claim_one(engine)
        assert (again.id, again.retries) == (claimed.id, 0)

    async def test_a_cancelled_workflow_forgets_the_cancellation(self, engine: Engine) -> None:
        kind = Kind()
        claimed = await kind.run(engine)
        await engine.workflows.request_cancel(claimed.id)
        await engine.ends.finish_many([claimed.id], [claimed.lease_token], ["cancelled"], [None], [None], NO_PINGS)
        assert await engine.management.resume(claimed.id) == ("cancelled", kind.queue)
        again = await kind.claim_one(engine)
        assert await engine.workflows.cancels_requested([again.id]) == []

    async def test_only_failed_and_cancelled_workflows_resume(self, engine: Engine) -> None:
        kind = Kind()
        queued = await kind.start(engine, delay=600.0)
        running = await kind.run(engine)
        done = await kind.run(engine)
        await engine.ends.finish_many([done.id], [done.lease_token], ["succeeded"], [b"out"], [None], NO_PINGS)
        for id, status in ((queued, "queued"), (running.id, "running"), (done.id, "succeeded")):
            assert await engine.management.resume(id) == (status, kind.queue)
            row = await engine.workflows.workflow(id)
            assert row is not None and row.status == status
        assert await engine.management.resume(unique("none")) is None
