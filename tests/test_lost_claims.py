"""A claim does not wait for the disk, so a server crash can lose it: the row is back as it was before
the claim, and the next claim hands out the same attempt number again while the lost claim's
execution may still run. Each claim's token fences that execution out."""

from __future__ import annotations

import asyncio
import logging

import anyio
import pytest

import pgflow

from .helpers import query

pytestmark = pytest.mark.anyio


async def test_the_execution_of_a_lost_claim_cannot_write(app: pgflow.App, second_app: pgflow.App, dsn: str,
                                                         schema: str, caplog: pytest.LogCaptureFixture) -> None:
    first_may_go, second_may_go, second_started = asyncio.Event(), asyncio.Event(), asyncio.Event()
    calls: list[str] = []

    async def which() -> str:
        me = "first" if not calls else "second"
        calls.append(me)
        if me == "first":
            await first_may_go.wait()
        else:
            second_started.set()
            await second_may_go.wait()
        return me

    async def body() -> str:
        return await step()

    step = app.step(name="lost.which")(which)
    second_app.step(name="lost.which")(which)
    started = app.workflow(name="lost.body")(body)
    second_app.workflow(name="lost.body")(body)
    handle = await started.start_async()
    caplog.set_level(logging.WARNING, logger="pgflow.execution")
    async with app.worker():
        while calls != ["first"]:
            await asyncio.sleep(0.02)
        [(attempt,)] = await query(dsn, f'SELECT attempt FROM "{schema}".workflows WHERE id = %s', handle.id)
        # What a crash that lost the claim leaves behind: the row as it was before it.
        await query(dsn, f'UPDATE "{schema}".workflows SET status = \'queued\', attempt = attempt - 1,'
                         " lease_owner = NULL, lease_expires_at = NULL, lease_token = NULL WHERE id = %s", handle.id)
        async with second_app.worker():
            await second_started.wait()  # claimed again, with the same attempt number
            [(again,)] = await query(dsn, f'SELECT attempt FROM "{schema}".workflows WHERE id = %s', handle.id)
            assert again == attempt
            first_may_go.set()  # the lost claim's execution finishes its step and tries to record it
            with anyio.fail_after(30):  # without its token, it records its step as if it still held the lease
                while not any("lost its lease" in r.getMessage() for r in caplog.records):
                    await asyncio.sleep(0.02)
            second_may_go.set()
            assert await handle.result_async(timeout=30) == "second"
    rows = await query(dsn, f'SELECT output FROM "{schema}".steps WHERE workflow_id = %s', handle.id)
    assert len(rows) == 1 and b"second" in rows[0][0]  # the journal holds the live claim's step only


async def test_a_claim_by_a_worker_of_the_version_before_fences_out_the_token_holder(app: pgflow.App, dsn: str,
                                                                                    schema: str) -> None:
    """Workers of the version before migration 0014 claim without a token; the row must not keep the
    token of the execution their claim took the workflow from."""
    await app.migrate_async()
    s = f'"{schema}"'
    await query(dsn, f"INSERT INTO {s}.workflows (id, name, queue, inputs, status, attempt, lease_token)"
                     " VALUES ('w', 'n', 'default', '\\x90', 'running', 1, 42)")
    # The older version's claim of an expired lease: the attempt goes up, the token is not touched.
    await query(dsn, f"UPDATE {s}.workflows SET attempt = attempt + 1 WHERE id = 'w'")
    assert await query(dsn, f"SELECT attempt, lease_token FROM {s}.workflows WHERE id = 'w'") == [(2, None)]
    # This version's claim writes its own token, which stays.
    await query(dsn, f"UPDATE {s}.workflows SET attempt = attempt + 1, lease_token = 7 WHERE id = 'w'")
    assert await query(dsn, f"SELECT attempt, lease_token FROM {s}.workflows WHERE id = 'w'") == [(3, 7)]
