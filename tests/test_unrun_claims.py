"""A claim that is still running when its worker begins to stop: the workflows it took are not run
then, and go back to the queue as they were, so the next worker's run is their first attempt, not
their second (the CI failure of 2026-12-02: a stop's give-back, claimed again by the claim in flight,
made a run that a stop cut short count as two)."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

import pgflow

from .helpers import query

pytestmark = pytest.mark.anyio


async def test_a_claim_that_a_stop_overtakes_is_given_back_uncounted(app: pgflow.App, dsn: str,
                                                                    schema: str) -> None:
    ran: list[int] = []

    @app.workflow(name="unrun.body", timeout=600)
    async def body() -> int:
        ran.append(pgflow.attempt())
        return pgflow.attempt()

    handle = await body.start_async()
    worker = app.worker(concurrency=1)
    claimed = anyio.Event()
    real_claim = worker._claim

    async def claim_then_stop(*args: Any) -> Any:
        # The claim commits; then the worker is told to stop before the claim's answer is acted on
        # (what stop() does first, synchronously, while the shielded claim is still in flight).
        result = await real_claim(*args)
        if result[0]:
            worker._claiming.cancel()
            claimed.set()
        return result

    worker._claim = claim_then_stop  # type: ignore[method-assign]
    async with worker:
        with anyio.fail_after(30):
            await claimed.wait()
    assert ran == []
    [row] = await query(dsn, f'SELECT status, attempt, attempt_base, lease_owner, started_at, deadline_at'
                             f' FROM "{schema}".workflows WHERE id = %s', handle.id)
    assert row == ("queued", 0, 0, None, None, None)  # as before the claim: never started, no timeout running

    async with app.worker(concurrency=1):
        assert await handle.result_async(timeout=30) == 1
    assert ran == [1]
    [(attempt,)] = await query(dsn, f'SELECT attempt FROM "{schema}".workflows WHERE id = %s', handle.id)
    assert attempt == 1


async def test_an_unclaim_leaves_a_row_that_another_claim_took_since(app: pgflow.App, dsn: str, schema: str) -> None:
    """Giving back is fenced by the claim's token: once the row is another claim's, it is untouched."""
    @app.workflow(name="unrun.taken")
    async def taken() -> int:
        return 1

    handle = await taken.start_async()
    store = await app._client.runtime().store()
    first, _ = await store.claims.claim("one", ["default"], ["unrun.taken"], 1, 30.0)
    await store.claims.unclaim(first)
    second, _ = await store.claims.claim("two", ["default"], ["unrun.taken"], 1, 30.0)
    assert [c.attempt for c in first] == [c.attempt for c in second] == [1]
    assert await store.claims.unclaim(first) == []  # the first claim's token no longer holds it
    [row] = await query(dsn, f'SELECT status, attempt, lease_owner FROM "{schema}".workflows WHERE id = %s',
                        handle.id)
    assert row == ("running", 1, "two")
