"""The reruns port: ``retry_later``."""

from __future__ import annotations

import pytest

from pgflow._core.engine import Claimed, Engine, Rerun, StepStart
from pgflow._core.status import Status

from .kit import LEASE, Kind

pytestmark = pytest.mark.anyio

ERROR = {"type": "RuntimeError", "message": "body failed"}


async def record(engine: Engine, claimed: Claimed, position: int, failed: bool = False) -> None:
    fence = await engine.journal.record_step(claimed.id, claimed.attempt, claimed.lease_token, position, f"s{position}",
                                             None if failed else b"ok", ERROR if failed else None, 1)
    assert fence.owner


class TestReruns:
    """``retry_later`` gives a workflow whose body failed back to its queue, due ``delay`` seconds from
    now (or at its deadline if sooner), for the claim that holds it: the failure is kept as its error
    until it ends, ``retries`` counts it, and its next claim counts no new run (a failed body is not a
    run cut short). Its journal loses the first record that holds an error and every one after it, and
    every try noted, so that step runs again while those before it replay. A cancellation asked for
    meanwhile ends it cancelled instead. A token that no longer holds it retries nothing (None)."""

    async def test_a_failed_body_runs_again_after_its_delay(self, engine: Engine) -> None:
        kind = Kind()
        claimed = await kind.run(engine)
        assert await engine.reruns.retry_later(claimed.id, claimed.lease_token, 600.0, ERROR) == \
            Rerun(kind.queue, Status.QUEUED, 1)
        row = await engine.workflows.workflow(claimed.id)
        assert row is not None and (row.status, row.error) == ("queued", ERROR)
        got, due = await engine.claims.claim("o", [kind.queue], [kind.name], 10, LEASE)
        assert got == [] and due is not None and 590.0 < due <= 600.0

    async def test_a_rerun_counts_retries_not_runs(self, engine: Engine) -> None:
        kind = Kind()
        claimed = await kind.run(engine, max_attempts=1)
        for retries in (1, 2):
            assert (await engine.reruns.retry_later(claimed.id, claimed.lease_token, 0.0, ERROR)) == \
                Rerun(kind.queue, Status.QUEUED, retries)
            claimed = await kind.claim_one(engine)
            assert (claimed.retries, claimed.run, claimed.uncounted, claimed.give_up) == (retries, 1, True, False)

    async def test_the_journal_loses_the_failed_step_and_all_after_it(self, engine: Engine) -> None:
        kind = Kind()
        claimed = await kind.run(engine)
        await record(engine, claimed, 0)
        await record(engine, claimed, 1)
        await record(engine, claimed, 2, failed=True)
        await record(engine, claimed, 3)
        await engine.journal.start_steps([StepStart(claimed.id, claimed.attempt, claimed.lease_token, 4, 2)])
        await engine.reruns.retry_later(claimed.id, claimed.lease_token, 0.0, ERROR)
        journal, horizon = await engine.journal.journal(claimed.id)
        assert (sorted(journal), horizon) == ([0, 1], 1)
        assert await engine.details.tries_begun(claimed.id) == {}

    async def test_a_journal_without_a_failed_step_is_kept(self, engine: Engine) -> None:
        claimed = await Kind().run(engine)
        await record(engine, claimed, 0)
        await engine.reruns.retry_later(claimed.id, claimed.lease_token, 0.0, ERROR)
        assert sorted((await engine.journal.journal(claimed.id))[0]) == [0]

    async def test_a_rerun_is_due_at_the_deadline_if_sooner(self, engine: Engine) -> None:
        kind = Kind()
        claimed = await kind.run(engine, timeout=60.0)
        await engine.reruns.retry_later(claimed.id, claimed.lease_token, 3600.0, ERROR)
        _, due = await engine.claims.claim("o", [kind.queue], [kind.name], 10, LEASE)
        assert due is not None and due <= 60.0

    async def test_a_cancellation_asked_meanwhile_ends_it_cancelled(self, engine: Engine) -> None:
        kind = Kind()
        claimed = await kind.run(engine)
        await engine.workflows.request_cancel(claimed.id)
        assert await engine.reruns.retry_later(claimed.id, claimed.lease_token, 0.0, ERROR) == \
            Rerun(kind.queue, Status.CANCELLED, 1)
        assert await kind.claim(engine) == []

    async def test_a_lost_token_retries_nothing(self, engine: Engine) -> None:
        kind = Kind()
        lost = await kind.run(engine)
        await record(engine, lost, 0, failed=True)
        await engine.claims.release(lost.id, lost.lease_token)
        assert await engine.reruns.retry_later(lost.id, lost.lease_token, 0.0, ERROR) is None
        again = await kind.claim_one(engine)
        assert again.retries == 0 and 0 in (await engine.journal.journal(lost.id))[0]
