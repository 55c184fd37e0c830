"""chain, group and chord: Celery's canvas built on child workflows, in process and across a SIGKILL
of the worker that runs them mid-way (every member's side effect once)."""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest

import pgflow

from .processes import Processes, result_of, wait_until

TARGET = "tests.apps.canvases:app"


@pytest.fixture
def effects(dsn: str, schema: str, app: pgflow.App) -> Any:
    app.migrate()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE TABLE "{schema}".effects (tag text NOT NULL, pid int NOT NULL)')

    def counted() -> Counter[str]:
        with psycopg.connect(dsn, autocommit=True) as conn:
            return Counter(r[0] for r in conn.execute(f'SELECT tag FROM "{schema}".effects').fetchall())
    return counted


def asleep_after_effect(app: pgflow.App, ids: list[str]) -> bool:
    """Each of ``ids`` has recorded its effect step and gave its slot back in its sleep."""
    for id in ids:
        try:
            handle = app.handle(id)
            if handle.status() != "queued" or [s.name for s in handle.steps()] != ["canvases.effect", "pgflow.sleep"]:
                return False
        except pgflow.UnknownWorkflow:
            return False
    return True


def test_chain_survives_a_sigkill_mid_way_running_each_member_once(
        app: pgflow.App, worker_env: dict[str, str], procs: Processes, effects: Any) -> None:
    from tests.apps import canvases

    a = procs.worker("a", TARGET, worker_env, concurrency=4)
    flow = pgflow.chain(canvases.add.s(1, 2, 3.0), canvases.add.s(10, 3.0), canvases.add.s(100, 0.0))
    assert flow.client is canvases.app._client
    handle = app.start_by_name("pgflow.canvas", flow.plan, [])
    second = f"{handle.id}.1"  # the chain's second child, from its journal position
    wait_until(lambda: asleep_after_effect(app, [second]), "the chain's second member asleep", procs, a)
    a.signal(signal.SIGKILL)
    a.wait_exit()
    assert effects() == Counter({"add:1+2": 1, "add:3+10": 1})
    procs.worker("b", TARGET, worker_env, concurrency=4)
    assert result_of(handle, procs) == 113
    assert effects() == Counter({"add:1+2": 1, "add:3+10": 1, "add:13+100": 1})
    members = [app.handle(f"{handle.id}.{n}") for n in range(3)]
    assert [m.result(timeout=5) for m in members] == [3, 13, 113]
    assert all(s.attempts == 1 for m in members for s in m.steps())


def test_chord_survives_a_sigkill_mid_way_running_each_member_and_the_callback_once(
        app: pgflow.App, worker_env: dict[str, str], procs: Processes, effects: Any) -> None:
    from tests.apps import canvases

    a = procs.worker("a", TARGET, worker_env, concurrency=8)
    flow = pgflow.chord(pgflow.group(canvases.add.s(i, i, 3.0) for i in range(4)), canvases.total.s(0.0))
    handle = app.start_by_name("pgflow.canvas", flow.plan, [])
    header = [f"{handle.id}.{n}" for n in range(4)]
    wait_until(lambda: asleep_after_effect(app, header), "the chord's group asleep", procs, a)
    a.signal(signal.SIGKILL)
    a.wait_exit()
    assert effects() == Counter({f"add:{i}+{i}": 1 for i in range(4)})
    procs.worker("b", TARGET, worker_env, concurrency=8)
    assert result_of(handle, procs) == 12
    assert effects() == Counter({**{f"add:{i}+{i}": 1 for i in range(4)}, "total:[0, 2, 4, 6]": 1})


@pytest.mark.anyio
async def test_canvas_in_process_results_order_failures_and_refusals(app: pgflow.App, tmp_path: Path) -> None:
    @app.workflow(name="c.add")
    async def add(x: int, y: int) -> int:
        return x + y

    @app.workflow(name="c.mul")
    def mul(x: int, y: int) -> int:
        return x * y

    @app.workflow(name="c.boom")
    async def boom(x: int) -> int:
        raise ValueError(f"boom {x}")

    @app.workflow(name="c.listed")
    async def listed(xs: list[int]) -> list[int]:
        return sorted(xs, reverse=True)

    @app.workflow(name="c.parent")
    async def parent(n: int) -> int:
        h = await pgflow.chain(add.s(n, 1), mul.s(2)).start_async()  # a canvas as a child of a body
        return int(await h.result_async()) + 0

    other = pgflow.App(app.dsn, schema="elsewhere_unused")
    try:
        @other.workflow(name="c.foreign")
        async def foreign(x: int) -> int:
            return x

        with pytest.raises(ValueError, match="different Apps"):
            pgflow.chain(add.s(1, 2), foreign.s())
    finally:
        await other.close_async()
    with pytest.raises(ValueError, match="at least one member"):
        pgflow.chain()
    with pytest.raises(TypeError, match="signatures"):
        pgflow.group([add])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="header is a group"):
        pgflow.chord(pgflow.chain(add.s(1, 2)), listed.s())
    with pytest.raises(pgflow.SerializationError):
        add.s(object(), 1)
    with pytest.raises(ValueError):
        pgflow.group(add.s(1, 2)).with_options(id="")

    async with app.worker(concurrency=16):
        assert await (await pgflow.chain(add.s(1, 2), mul.s(10), add.s(5)).start_async()).result_async(30) == 35
        assert await (await pgflow.group(mul.s(i, i) for i in range(6)).start_async()).result_async(30) == \
            [0, 1, 4, 9, 16, 25]
        chord = pgflow.chord([add.s(1), mul.s(3), pgflow.chain(add.s(1), mul.s(100))], listed.s())
        assert await (await chord.start_async(4)).result_async(30) == [500, 12, 5]  # 4 prepended to each
        nested = pgflow.chain(pgflow.group(add.s(1, 1), add.s(2, 2)), listed.s())
        assert await (await nested.start_async()).result_async(30) == [4, 2]
        fixed = await pgflow.group(add.s(1, 1)).with_options(id="my-group").start_async()
        assert fixed.id == "my-group" and await fixed.result_async(30) == [2]
        assert await (await parent.start_async(4)).result_async(30) == 10

        failing = await pgflow.chord([add.s(1, 1), boom.s(7)], listed.s()).start_async()
        with pytest.raises(pgflow.WorkflowFailed, match="boom 7") as info:
            await failing.result_async(30)
        assert info.value.error_type == "pgflow.errors.WorkflowFailed"
        assert [s.name for s in await failing.steps_async()] == []  # (children are not steps)
        assert {r.name for r in await app.list_workflows_async(name="c.listed")} == {"c.listed"}
        called = [r for r in await app.list_workflows_async(name="c.listed") if r.parent_id == failing.id]
        assert called == []  # the callback never ran

    sync = pgflow.group(add.s(2, 3), mul.s(2, 3))
    async with app.worker(concurrency=8):
        handle = await anyio_to_thread(sync.start)
        assert await handle.result_async(30) == [5, 6]


async def anyio_to_thread(fn: Any) -> Any:
    import anyio.to_thread

    return await anyio.to_thread.run_sync(fn)


@pytest.mark.anyio
async def test_a_hostile_canvas_plan_fails_its_canvas_and_starts_nothing(app: pgflow.App) -> None:
    """The plan is a row's data: one that is not a plan, or names what cannot be started, fails the
    canvas with the reason; nothing it names is run."""
    @app.workflow(name="c.ok")
    async def ok(x: int) -> int:
        return x

    deep: Any = {"type": "call"}
    for _ in range(2000):
        deep = {"type": "chain", "links": [deep]}
    plans = [({"type": "nope"}, "SerializationError"), ("not a plan", "SerializationError"),
             ({"type": "call", "name": "c.\x00bad", "args": [], "kwargs": {}, "queue": "default", "priority": 0,
               "max_attempts": 1, "timeout": None}, "ValueError"),
             ({"type": "call", "name": "c.ok", "args": [1], "kwargs": {}, "queue": "", "priority": 0,
               "max_attempts": 1, "timeout": None}, "ValueError")]
    with pytest.raises(pgflow.SerializationError, match="nested too deeply"):
        await app.start_by_name_async("pgflow.canvas", deep, [])  # refused before anything is written
    async with app.worker(concurrency=4):
        for plan, error in plans:
            handle = await app.start_by_name_async("pgflow.canvas", plan, [])
            with pytest.raises(pgflow.WorkflowFailed) as info:
                await handle.result_async(timeout=30)
            assert info.value.error_type.endswith(error), (plan, info.value)
    assert {r.name for r in await app.list_workflows_async()} == {"pgflow.canvas"}


@pytest.mark.anyio
async def test_canvas_arguments_are_checked_at_start_naming_the_workflow_and_argument(app: pgflow.App) -> None:
    """A member's arguments are checked against its workflow's hints when the canvas starts, as
    ``start`` checks a workflow's: the error names the member's workflow and argument (not
    ``start_by_name``, which the user never called), and nothing is written."""
    @app.workflow(name="c.add")
    async def add(x: int, y: int) -> int:
        return x + y

    @app.workflow(name="c.listed")
    async def listed(xs: list[int], *, reverse: bool = False) -> list[int]:
        return sorted(xs, reverse=reverse)

    @app.workflow(name="c.parent")
    async def parent() -> int:
        await pgflow.chain(add.s(1, 2), add.s("two")).start_async()
        return 0

    refused = [
        (pgflow.group(add.s(1, "2")), (), "workflow 'c.add': argument 'y'"),  # every argument known
        (pgflow.group(add.s(1)), ("x",), "workflow 'c.add': argument 'x'"),  # one given to start
        (pgflow.chain(add.s(1, 2), add.s("two")), (), "argument 'y' of workflow 'c.add'"),  # after a result
        (pgflow.chain(add.s(1, 2), add.s(3, 4)), (), "workflow 'c.add'"),  # one too many after the result
        (pgflow.chord([add.s(1, 2)], listed.s(reverse="yes")), (), "argument 'reverse' of workflow 'c.listed'"),
        (pgflow.group(add.s(1), pgflow.chain(add.s(2), listed.s(reverse=1.5))), (1,),
         "argument 'reverse' of workflow 'c.listed'"),  # nested
    ]
    for canvas, given, named in refused:
        with pytest.raises(pgflow.SerializationError, match=named) as info:
            await canvas.start_async(*given)
        assert "start_by_name" not in str(info.value)
        with pytest.raises(pgflow.SerializationError, match=named):
            await anyio_to_thread(lambda c=canvas, g=given: c.start(*g))
    assert await app.list_workflows_async() == []  # nothing written

    started = await parent.start_async()
    async with app.worker(concurrency=4):
        with pytest.raises(pgflow.WorkflowFailed, match="argument 'y' of workflow 'c.add'"):
            await started.result_async(timeout=30)  # from a body too: its own start fails, naming the member
        assert [r.name for r in await app.list_workflows_async()] == ["c.parent"]
        fine = await pgflow.chord([add.s(2), add.s(3)], listed.s(reverse=True)).start_async(4)  # 4 to each
        assert await fine.result_async(timeout=30) == [7, 6]


@pytest.mark.anyio
async def test_the_canvas_workflow_is_registered_only_when_used(app: pgflow.App, second_app: pgflow.App) -> None:
    """An App that builds no canvas has no ``pgflow.canvas``: not in its registry, not among the names
    its workers serve. Building one registers it; so does a worker serving the canvas's queue, which runs
    the canvases another process starts (``second_app`` here, whose pings reach ``app`` through the
    server as another process's would), as a Celery worker runs the chains a caller sends."""
    @app.workflow(name="c.plus", queue="bulk")
    async def plus(x: int, y: int) -> int:
        return x + y

    @second_app.workflow(name="c.plus", queue="bulk")
    async def plus_there(x: int, y: int) -> int:
        return x + y

    assert "pgflow.canvas" not in app.registry.workflows and "pgflow.canvas" not in second_app.registry.workflows
    assert app.workflows.keys() == {"c.plus"}
    async with app.worker(concurrency=2, queues=["bulk"]) as worker:
        [listed] = [w for w in await app.workers_info_async() if w.id == worker.id]
        assert listed.names == ["c.plus"] and listed.queues == ["bulk"]
    assert "pgflow.canvas" not in app.registry.workflows

    flow = pgflow.chain(plus_there.s(1, 2), plus_there.s(10))  # the first use, in the caller
    assert "pgflow.canvas" in second_app.registry.workflows and "pgflow.canvas" not in app.registry.workflows
    assert second_app.workflows.keys() == {"c.plus"}  # (not among the user's own)
    handle = await flow.start_async()

    async with app.worker(concurrency=4, queues=["default", "bulk"]) as worker:  # app has built no canvas
        [listed] = [w for w in await app.workers_info_async() if w.id == worker.id]
        assert listed.names == ["c.plus", "pgflow.canvas"]
        assert await handle.result_async(timeout=30) == 13
    assert "pgflow.canvas" in app.registry.workflows
    assert app.workflows.keys() == {"c.plus"}


@pytest.mark.anyio
async def test_check_replay_checks_canvases_of_an_app_that_built_none(app: pgflow.App, second_app: pgflow.App) -> None:
    """A canvas's journal is pgflow's code's as much as the App's: check-replay replays it whether or not
    the App it checks has built a canvas, and leaves that App without ``pgflow.canvas``."""
    from pgflow.checkreplay import check_replay_async

    @second_app.workflow(name="c.one")
    async def one() -> int:
        return 1

    handle = await pgflow.group(one.s(), one.s()).start_async()  # queued: no worker runs it
    report = await check_replay_async(app, ["queued"])
    assert report.passed == [handle.id] and report.skipped == [] and report.ok
    assert "pgflow.canvas" not in app.registry.workflows
