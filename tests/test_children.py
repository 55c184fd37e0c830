"""Child workflows: started from a workflow body (ids ``<parent>.<position>``), gathered with
``asyncio.gather`` over ``result_async``, a child's failure as its parent sees it, and cancellation,
which goes down the tree: cancelling a parent cancels the children its body started, and theirs."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import pytest

import pgflow

from .helpers import query, run_to_end, wait_for

pytestmark = pytest.mark.anyio


async def test_fan_out_and_gather(app: pgflow.App, dsn: str, schema: str) -> None:
    @app.workflow(name="kids.square")
    async def square(x: int) -> int:
        return x * x

    @app.workflow(name="kids.fan_out")
    async def fan_out(n: int) -> int:
        handles = [await square.start_async(i) for i in range(n)]
        return sum(await asyncio.gather(*(h.result_async() for h in handles)))

    @app.workflow(name="kids.fan_out_sync")
    def fan_out_sync(n: int) -> int:
        handles = square.start_many([(i,) for i in range(n)])
        return sum(h.result() for h in handles)

    one, two = await fan_out.start_async(4), await fan_out_sync.start_async(3)
    async with app.worker(concurrency=8):
        assert await one.result_async(timeout=30) == 0 + 1 + 4 + 9
        assert await two.result_async(timeout=30) == 0 + 1 + 4
    rows = await query(dsn, f'SELECT id, parent_id FROM "{schema}".workflows WHERE name = %s', "kids.square")
    assert sorted(r[0] for r in rows if r[1] == one.id) == [f"{one.id}.{i}" for i in range(4)]
    assert len([r for r in rows if r[1] == two.id]) == 3


async def test_a_replayed_parent_finds_the_children_start_many_started(app: pgflow.App, dsn: str,
                                                                       schema: str) -> None:
    runs: list[int] = []

    @app.workflow(name="kids.double")
    async def double(x: int) -> int:
        return 2 * x

    @app.workflow(name="kids.flaky_parent")
    async def flaky_parent() -> int:
        runs.append(1)
        handles = await double.start_many_async([(1,), (2,), (3,)])
        if len(runs) == 1:
            raise RuntimeError("the first run fails after starting its children")
        return sum(await asyncio.gather(*(h.result_async() for h in handles)))

    parent = await flaky_parent.start_async()
    with pytest.raises(pgflow.WorkflowFailed):
        await run_to_end(app, parent)
    await parent.resume_async()  # the body runs again from the top: start_many is replayed
    assert await run_to_end(app, parent) == 2 + 4 + 6
    rows = await query(dsn, f'SELECT id FROM "{schema}".workflows WHERE parent_id = %s', parent.id)
    assert sorted(r[0] for r in rows) == [f"{parent.id}.0.{n}" for n in range(3)]  # started once


async def test_a_childs_failure_as_its_parent_sees_it(app: pgflow.App) -> None:
    @app.workflow(name="kids.broken")
    async def broken(x: int) -> int:
        raise ValueError(f"no good: {x}")

    @app.workflow(name="kids.careful")
    async def careful() -> list[Any]:
        child = await broken.start_async(7)
        try:
            await child.result_async()
        except pgflow.WorkflowFailed as exc:
            return [exc.workflow_id == child.id, exc.error_type, exc.message]
        return []

    @app.workflow(name="kids.careless")
    async def careless() -> int:
        return await (await broken.start_async(8)).result_async()

    caught, uncaught = await careful.start_async(), await careless.start_async()
    async with app.worker(concurrency=4):
        assert await caught.result_async(timeout=30) == [True, "ValueError", "no good: 7"]
        with pytest.raises(pgflow.WorkflowFailed) as failed:
            await uncaught.result_async(timeout=30)
    assert failed.value.error_type == "pgflow.errors.WorkflowFailed"
    assert f"workflow '{uncaught.id}.0' failed with ValueError: no good: 8" in failed.value.message


async def test_cancelling_a_parent_cancels_its_children_and_theirs(dsn: str, schema: str) -> None:
    """A queued child (sleeping, slot given back), a running one (blocked in a step) and a grandchild
    are cancelled with the parent; a child that already succeeded keeps its result."""
    async with pgflow.App(dsn, schema=schema, poll_interval=0.5, suspend_after=0.5) as app:
        never = anyio.Event()

        @app.step(name="kids.block")
        async def block() -> None:
            await never.wait()

        @app.workflow(name="kids.quick")
        async def quick() -> str:
            return "done"

        @app.workflow(name="kids.sleepy")
        async def sleepy() -> None:
            await pgflow.sleep_async(3600)

        @app.workflow(name="kids.busy")
        async def busy() -> None:
            await sleepy.start_async()  # a grandchild
            await block()

        @app.workflow(name="kids.parent")
        async def parent() -> None:
            done = await quick.start_async()
            await done.result_async()
            await sleepy.start_async()
            await (await busy.start_async()).result_async()

        handle = await parent.start_async()
        kids = [f"{handle.id}.0", f"{handle.id}.1", f"{handle.id}.2", f"{handle.id}.2.0"]
        async with app.worker(concurrency=8, lease=3.0):
            await wait_for(lambda: query(
                dsn, f'SELECT 1 FROM "{schema}".workflows WHERE name = %s AND status = \'queued\''
                     " AND due_at > now() + interval '1 minute' HAVING count(*) = 2", "kids.sleepy"))
            await wait_for(lambda: query(dsn, f'SELECT 1 FROM "{schema}".workflows WHERE id = %s'
                                              " AND status = 'running'", kids[2]))
            await handle.cancel_async()
            for id in (handle.id, *kids[1:]):
                with pytest.raises(pgflow.WorkflowCancelled):
                    await app.handle(id).result_async(timeout=30)
        assert await app.handle(kids[0]).result_async(timeout=1) == "done"
        rows = await query(dsn, f'SELECT id, status FROM "{schema}".workflows ORDER BY id')
        assert dict(rows) == {handle.id: "cancelled", kids[0]: "succeeded", kids[1]: "cancelled",
                              kids[2]: "cancelled", kids[3]: "cancelled"}


async def test_cancelling_a_child_leaves_its_parent_alone(app: pgflow.App, dsn: str, schema: str) -> None:
    @app.workflow(name="kids.waiter")
    async def waiter() -> str:
        return await pgflow.recv_async("never", timeout=3600) or "none"

    @app.workflow(name="kids.outer")
    async def outer() -> str:
        child = await waiter.start_async()
        try:
            await child.result_async()
        except pgflow.WorkflowCancelled:
            return "child cancelled"
        return "child finished"

    handle = await outer.start_async()
    async with app.worker(concurrency=4):
        child = app.handle(f"{handle.id}.0")
        await wait_for(lambda: query(dsn, f'SELECT 1 FROM "{schema}".workflows WHERE id = %s'
                                          " AND waiting_for = 'never'", child.id))
        await child.cancel_async()
        assert await handle.result_async(timeout=30) == "child cancelled"
    assert await run_to_end(app, handle) == "child cancelled"


async def test_records_name_the_parent_and_what_a_queued_workflow_waits_for(dsn: str, schema: str) -> None:
    async with pgflow.App(dsn, schema=schema, poll_interval=0.5, suspend_after=0.5) as app:
        @app.workflow(name="kids.napper")
        async def napper() -> None:
            await pgflow.sleep_async(3600)

        @app.workflow(name="kids.asker")
        async def asker() -> None:
            await napper.start_async()
            await pgflow.recv_async("answer", timeout=3600)

        handle = await asker.start_async()
        async with app.worker(concurrency=2):
            await wait_for(lambda: query(dsn, f'SELECT 1 FROM "{schema}".workflows WHERE status = \'queued\''
                                              " AND due_at > now() + interval '1 minute' HAVING count(*) = 2"))
        parent, child = (await handle.info_async()).record, (await app.handle(f"{handle.id}.0").info_async()).record
        assert (parent.parent_id, parent.waiting_for, child.parent_id, child.waiting_for) == (
            None, "answer", handle.id, None)
        assert parent.due_at is not None and child.due_at is not None
        await handle.cancel_async()
        assert (await handle.info_async()).record.due_at is None
