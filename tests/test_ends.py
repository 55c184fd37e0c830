"""Workflow ends are recorded in batches: many ends per statement, each workflow's caller told at
its batch's commit, and one end the server refuses does not take the others of its batch down."""

from __future__ import annotations

import asyncio

import pytest

import pgflow

from .helpers import query

pytestmark = pytest.mark.anyio


async def test_ends_of_concurrent_workflows_share_statements(app: pgflow.App) -> None:
    gate = asyncio.Event()

    @app.workflow(name="ends.gated")
    async def gated(n: int) -> int:
        await gate.wait()
        return n * 2

    handles = await gated.start_many_async([(n,) for n in range(40)])
    async with app.worker(concurrency=40):
        while sum([await h.status_async() == "running" for h in handles]) < 40:
            await asyncio.sleep(0.05)
        gate.set()  # every body returns at once: their ends queue up together
        results = await asyncio.gather(*(h.result_async(timeout=60) for h in handles))
        stats = app.stats()
    assert results == [n * 2 for n in range(40)]
    assert stats.ends == 40
    assert stats.end_batches < 40  # batched, not one statement per end


async def test_an_end_the_server_refuses_fails_alone(app: pgflow.App, dsn: str, schema: str) -> None:
    gate = asyncio.Event()

    @app.workflow(name="ends.refused")
    async def body(n: int) -> int:
        await gate.wait()
        return n

    await app.migrate_async()
    # The server refuses to record workflow "bad" as succeeded (a constraint of the operator's, say).
    await query(dsn, f'CREATE FUNCTION "{schema}".refuse() RETURNS trigger LANGUAGE plpgsql AS $$'
                     " BEGIN IF NEW.id = 'bad' AND NEW.status = 'succeeded' THEN"
                     " RAISE EXCEPTION 'refused'; END IF; RETURN NEW; END $$")
    await query(dsn, f'CREATE TRIGGER refuse BEFORE UPDATE ON "{schema}".workflows'
                     f' FOR EACH ROW EXECUTE FUNCTION "{schema}".refuse()')
    good = [await body.with_options(id=f"good-{n}").start_async(n) for n in range(7)]
    bad = await body.with_options(id="bad").start_async(99)
    async with app.worker(concurrency=8):
        while sum([await h.status_async() == "running" for h in [*good, bad]]) < 8:
            await asyncio.sleep(0.05)
        gate.set()
        assert await asyncio.gather(*(h.result_async(timeout=60) for h in good)) == list(range(7))
        assert await bad.status_async() != "succeeded"
    # Recorded by their first run: the refused end did not send its batch's other ends back to the queue.
    assert [(await h.info_async()).record.attempt for h in good] == [1] * 7
