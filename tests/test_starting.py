"""Starting workflows: idempotent ids, conflicts, queues, priorities, delays, handles and cancellation."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import anyio
import pytest

import pgflow
from pgflow._core.registry import DEFAULT_MAX_ATTEMPTS

from .helpers import ONE_SERVER, TIMEOUT, Point, query

pytestmark = pytest.mark.anyio


async def row_of(dsn: str, schema: str, workflow_id: str, columns: str) -> tuple[Any, ...]:
    rows = await query(dsn, f"SELECT {columns} FROM {schema}.workflows WHERE id = %s", workflow_id)
    assert len(rows) == 1, rows
    return rows[0]


async def in_thread(fn: Any) -> Any:
    """Run a blocking (sync API) call from an async test."""
    return await anyio.to_thread.run_sync(fn)


def labelling(app: pgflow.App, name: str, ran: list[str], kind: str = "async",
              **options: Any) -> pgflow.Workflow[Any, str]:
    """A workflow that appends its one argument, a label, to ``ran`` and returns it, as an ``async def``
    or a ``def``: which ran, and in which order."""
    if kind == "async":
        async def label_async(label: str) -> str:
            ran.append(label)
            return label
        return app.workflow(name=name, **options)(label_async)

    def label_sync(label: str) -> str:
        ran.append(label)
        return label
    return app.workflow(name=name, **options)(label_sync)


# -- idempotent ids under concurrency ------------------------------------------------------------------


async def test_concurrent_starts_with_one_id_make_one_workflow(app: pgflow.App, dsn: str, schema: str) -> None:
    runs: list[int] = []
    lock = threading.Lock()

    @app.workflow(name="starting.once")
    def once(x: int) -> int:
        with lock:
            runs.append(x)
        return x * 2

    await app.migrate_async()  # so that the starts race on the row, not on creating the schema
    starter = once.with_options(id="the-one")
    handles: list[pgflow.WorkflowHandle[int]] = []
    barrier = threading.Barrier(8)

    async def start_async() -> None:
        handles.append(await starter.start_async(21))

    def start_sync() -> None:
        barrier.wait(timeout=TIMEOUT)
        handles.append(starter.start(21))

    async with anyio.create_task_group() as group:
        for _ in range(8):
            group.start_soon(in_thread, start_sync)
        for _ in range(16):
            group.start_soon(start_async)

    assert len(handles) == 24
    assert {h.id for h in handles} == {"the-one"}
    assert await query(dsn, f"SELECT id, name, status FROM {schema}.workflows") == [
        ("the-one", "starting.once", "queued")
    ]

    async with app.worker(concurrency=4):
        assert await handles[0].result_async(timeout=TIMEOUT) == 42
        assert await in_thread(lambda: handles[-1].result(timeout=TIMEOUT)) == 42
    assert runs == [21]
    assert await row_of(dsn, schema, "the-one", "attempt, status") == (1, "succeeded")


# -- an id that already finished ------------------------------------------------------------------------


async def test_starting_a_finished_id_returns_its_handle_and_runs_nothing(
    app: pgflow.App, dsn: str, schema: str,
) -> None:
    runs: list[int] = []

    @app.workflow(name="starting.done")
    async def done(x: int) -> int:
        runs.append(x)
        return x + 100

    async with app.worker(concurrency=2):
        first = await done.with_options(id="done-1").start_async(1)
        assert await first.result_async(timeout=TIMEOUT) == 101

        # Different arguments, same id: the existing workflow is returned, nothing is enqueued.
        again_async = await done.with_options(id="done-1").start_async(2)
        again_sync = await in_thread(lambda: done.with_options(id="done-1").start(3))
        for again in (again_async, again_sync):
            assert again.id == "done-1"
            assert again == first
            assert await again.status_async() == "succeeded"
            assert await again.result_async(timeout=TIMEOUT) == 101
        # Not re-queued: a worker has nothing to claim, however long it runs.
        assert await row_of(dsn, schema, "done-1", "status, attempt") == ("succeeded", 1)

        # A workflow started after the repeats is run, so the worker did look at the queue since.
        sentinel = await done.start_async(9)
        assert await sentinel.result_async(timeout=TIMEOUT) == 109
    assert runs == [1, 9]
    assert await row_of(dsn, schema, "done-1", "status, attempt") == ("succeeded", 1)


async def test_starting_a_queued_id_again_keeps_the_first_arguments(app: pgflow.App) -> None:
    @app.workflow(name="starting.first_wins")
    async def first_wins(x: int) -> int:
        return x

    handles = [await first_wins.with_options(id="fw").start_async(x) for x in (1, 2)]
    handles.append(await in_thread(lambda: first_wins.with_options(id="fw").start(3)))
    async with app.worker(concurrency=2):
        assert [await h.result_async(timeout=TIMEOUT) for h in handles] == [1, 1, 1]


# -- conflicts ------------------------------------------------------------------------------------------


async def test_an_id_taken_by_another_workflow_conflicts(app: pgflow.App, dsn: str, schema: str) -> None:
    @app.workflow(name="starting.owner")
    async def owner() -> str:
        return "owner"

    @app.workflow(name="starting.intruder")
    def intruder() -> str:
        return "intruder"

    await owner.with_options(id="shared").start_async()
    with pytest.raises(pgflow.WorkflowConflict) as conflict:
        await intruder.with_options(id="shared").start_async()
    assert isinstance(conflict.value, ValueError)
    assert "starting.owner" in str(conflict.value) and "starting.intruder" in str(conflict.value)
    with pytest.raises(pgflow.WorkflowConflict):
        await in_thread(lambda: intruder.with_options(id="shared").start())
    assert await query(dsn, f"SELECT id, name FROM {schema}.workflows") == [("shared", "starting.owner")]

    async with app.worker(concurrency=2):
        assert await app.handle("shared").result_async(timeout=TIMEOUT) == "owner"


# -- with_options: queue, priority, delay ---------------------------------------------------------------


async def test_a_worker_runs_only_its_queues(app: pgflow.App, dsn: str, schema: str) -> None:
    ran: list[str] = []
    queued = labelling(app, "starting.queued", ran, "sync", queue="a")

    on_b = await queued.with_options(queue="b").start_async("b")  # enqueued first: claimed first if allowed
    on_a = await in_thread(lambda: queued.start("a"))  # the registered queue
    assert await row_of(dsn, schema, on_a.id, "queue") == ("a",)
    assert await row_of(dsn, schema, on_b.id, "queue") == ("b",)

    async with app.worker(concurrency=1, queues=["a"]):
        assert await on_a.result_async(timeout=TIMEOUT) == "a"
        assert await on_b.status_async() == "queued"
    assert ran == ["a"]

    async with app.worker(concurrency=1, queues=["x", "b"]):
        assert await on_b.result_async(timeout=TIMEOUT) == "b"
    assert ran == ["a", "b"]


async def test_higher_priority_runs_first(app: pgflow.App) -> None:
    order: list[str] = []
    ranked = labelling(app, "starting.ranked", order)
    ranked_seven = labelling(app, "starting.ranked_seven", order, "sync", priority=7)

    # All enqueued before any worker runs, lowest priority first so that due order would be wrong.
    handles = [
        await ranked.start_async("p0"),
        await ranked.with_options(priority=-5).start_async("p-5"),
        await in_thread(lambda: ranked.with_options(priority=5).start("p5")),
        await ranked_seven.start_async("p7"),  # the registered priority
        await ranked.with_options(priority=10).start_async("p10"),
        await in_thread(lambda: ranked_seven.with_options(priority=3).start("p3")),
    ]
    async with app.worker(concurrency=1):
        for handle in handles:
            await handle.result_async(timeout=TIMEOUT)
    assert order == ["p10", "p7", "p5", "p3", "p0", "p-5"]


async def test_delayed_workflow_waits_for_its_due_time(app: pgflow.App, dsn: str, schema: str) -> None:
    delay = 2.0
    runs: list[str] = []
    later = labelling(app, "starting.later", runs)

    async with app.worker(concurrency=4):
        async_handle = await later.with_options(delay=delay).start_async("async")
        sync_handle = await in_thread(lambda: later.with_options(delay=delay).start("sync"))
        # A running worker, woken by the enqueue, must leave them alone until they fall due.
        assert await async_handle.status_async() == "queued"
        assert await in_thread(sync_handle.status) == "queued"
        for handle in (async_handle, sync_handle):
            [(due_in,)] = await query(
                dsn, f"SELECT extract(epoch FROM due_at - created_at) FROM {schema}.workflows WHERE id = %s",
                handle.id)
            assert float(due_in) >= delay
        assert await async_handle.result_async(timeout=TIMEOUT) == "async"
        assert await in_thread(lambda: sync_handle.result(timeout=TIMEOUT)) == "sync"
    assert sorted(runs) == ["async", "sync"]
    for handle in (async_handle, sync_handle):
        # Claimed (started_at is set by the claim, in the database's clock) no earlier than due.
        started_after_due, = await row_of(dsn, schema, handle.id, "started_at >= due_at")
        assert started_after_due is True


async def test_undelayed_start_is_due_at_once(app: pgflow.App, dsn: str, schema: str) -> None:
    @app.workflow(name="starting.now")
    async def now() -> None:
        return None

    handle = await now.with_options(delay=0).start_async()
    assert await row_of(dsn, schema, handle.id, "due_at = created_at") == (True,)


async def test_bad_options_are_refused(app: pgflow.App) -> None:
    @app.workflow(name="starting.opts")
    async def opts() -> None:
        return None

    with pytest.raises(ValueError):
        opts.with_options(delay=-1)
    with pytest.raises(ValueError):
        opts.with_options(id="")


def test_a_step_name_taken_twice_is_refused_as_a_workflow_name_is(app: pgflow.App) -> None:
    @app.step(name="starting.twice")
    def first() -> int:
        return 1

    def second() -> int:
        return 2

    @app.workflow(name="starting.twice")
    def flow() -> None: ...

    for what, register in (("step", app.step), ("workflow", app.workflow)):
        # Another function under the name, and the same function again: either would take the first
        # one's place in the journal's eyes.
        for fn in (second, first.fn if what == "step" else flow.fn):
            with pytest.raises(pgflow.ConfigurationError,
                               match=f"a {what} named 'starting.twice' is already registered; pass name= to tell"):
                register(name="starting.twice")(fn)  # type: ignore[operator]
    assert app.steps["starting.twice"] is first and app.registry.steps["starting.twice"].fn is first.fn
    assert app.workflows["starting.twice"] is flow
    assert app.step(name="starting.second")(second)() == 2  # its own name: registered


async def test_one_rule_per_value_and_one_exception_per_kind_of_bad_value(app: pgflow.App) -> None:
    """The same bad value gets the same error wherever it comes in: a TypeError for a wrong type, a
    ValueError for a wrong value, and at registration a ConfigurationError as well; nothing is
    registered or written."""

    @app.workflow(name="starting.ruled")
    async def ruled() -> None: ...

    def at_start(**options: Any) -> None:
        ruled.with_options(**options)

    def by_name(**options: Any) -> None:
        app.start_by_name("starting.ruled", **options)

    def registering(**options: Any) -> None:
        app.workflow(name="starting.refused", **options)(lambda: None)

    def registering_step(**options: Any) -> None:
        app.step(name="starting.refused", **options)(lambda: None)

    def limiting(**options: Any) -> None:
        app.queue(**{"name": "starting.q", **options})

    cases: list[tuple[dict[str, Any], type[Exception], str, list[Any]]] = [
        ({"priority": "5"}, TypeError, "priority is an int", [at_start, by_name, registering]),
        ({"priority": 2**31}, ValueError, "priority must be between", [at_start, by_name, registering]),
        ({"queue": ""}, ValueError, "a queue name is a non-empty string", [at_start, by_name, registering]),
        ({"name": ""}, ValueError, "a queue name is a non-empty string", [limiting]),
        ({"delay": True}, TypeError, "delay is a number of seconds", [at_start, by_name]),
        ({"delay": -1}, ValueError, "delay must be between 0 and", [at_start, by_name]),
        ({"timeout": 0}, ValueError, "timeout is a positive number of seconds", [by_name, registering,
                                                                                  registering_step]),
        ({"timeout": "1"}, TypeError, "timeout is a positive number of seconds", [by_name, registering,
                                                                                   registering_step]),
        ({"max_attempts": 0}, ValueError, "max_attempts must be between 1 and", [by_name, registering,
                                                                                  registering_step]),
        ({"max_attempts": 1.5}, TypeError, "max_attempts is an int", [by_name, registering, registering_step]),
        ({"per": 0}, ValueError, "per is a positive number of seconds", [limiting]),
        ({"concurrency": 0}, ValueError, "concurrency must be at least 1", [limiting]),
    ]
    for options, error, words, entries in cases:
        for entry in entries:
            with pytest.raises(error, match=words) as raised:
                entry(**options)
            setup = entry in (registering, registering_step, limiting)
            assert isinstance(raised.value, pgflow.ConfigurationError) == setup, (entry, options, raised.value)
    with pytest.raises(pgflow.ConfigurationError, match="a step name must not contain NUL"):
        app.step(name="starting.\x00")(lambda: None)
    # Text and positions: a ValueError whatever the wrong value's type (the policy in checks.py).
    with pytest.raises(ValueError, match="a workflow name is a non-empty string"):
        app.start_by_name(5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="from_step is a position"):
        app.handle("some-id").fork("1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout must be between 0 and"):
        app.handle("some-id").get_event("e", timeout=float("nan"))
    assert "starting.refused" not in app.workflows and "starting.refused" not in app.steps
    assert app.queues == {}
    assert await app.list_workflows_async() == []


# -- handles from another App, unknown ids ---------------------------------------------------------------


def build_pair(app: pgflow.App, ran: Counter[str]) -> tuple[pgflow.Workflow[Any, Point], pgflow.Workflow[Any, Any]]:
    @app.workflow(name="starting.make_point")
    async def make_point(x: int) -> Point:
        ran["make_point"] += 1
        return Point(x, -x)

    @app.workflow(name="starting.broken")
    def broken() -> None:
        ran["broken"] += 1
        raise KeyError("no such thing")

    return make_point, broken


async def one_succeeded_one_failed(app: pgflow.App, ran: Counter[str],
                                   x: int) -> tuple[pgflow.WorkflowHandle[Point], pgflow.WorkflowHandle[Any]]:
    """``build_pair``'s two workflows, run to their ends by a worker: ``make_point(x)`` succeeded,
    ``broken()`` failed."""
    make_point, broken = build_pair(app, ran)
    async with app.worker(concurrency=2):
        ok = await make_point.start_async(x)
        bad = await broken.start_async()
        assert await ok.result_async(timeout=TIMEOUT) == Point(x, -x)
        with pytest.raises(pgflow.WorkflowFailed):
            await bad.result_async(timeout=TIMEOUT)
    return ok, bad


async def test_handle_from_another_app_reads_status_and_result(app: pgflow.App, dsn: str, schema: str) -> None:
    ran: Counter[str] = Counter()
    ok, bad = await one_succeeded_one_failed(app, ran, 4)

    async with pgflow.App(dsn, schema=schema, poll_interval=0.5) as other:
        build_pair(other, Counter())
        theirs = other.handle(ok.id)
        assert theirs.id == ok.id
        assert await theirs.status_async() == "succeeded"
        result = await theirs.result_async(timeout=TIMEOUT)
        assert isinstance(result, Point) and result == Point(4, -4)
        assert await in_thread(theirs.status) == "succeeded"
        assert await in_thread(lambda: theirs.result(timeout=TIMEOUT)) == Point(4, -4)

        failed = other.handle(bad.id)
        assert await failed.status_async() == "failed"
        for read in (lambda: failed.result_async(timeout=TIMEOUT),
                     lambda: in_thread(lambda: failed.result(timeout=TIMEOUT))):
            with pytest.raises(pgflow.WorkflowFailed) as error:
                await read()
            assert error.value.workflow_id == bad.id
            assert error.value.error_type == "KeyError"
            assert "no such thing" in error.value.message

    # An App that does not know the workflow still reads the result, as plain builtins.
    async with pgflow.App(dsn, schema=schema, poll_interval=0.5) as stranger:
        assert await stranger.handle(ok.id).result_async(timeout=TIMEOUT) == {"x": 4, "y": -4}
    assert ran == {"make_point": 1, "broken": 1}


async def test_another_app_waits_for_a_result(app: pgflow.App, dsn: str, schema: str) -> None:
    """A second App's handle, waiting before the workflow ran, gets its result when a worker runs it."""
    ran: Counter[str] = Counter()
    make_point, _ = build_pair(app, ran)
    handle = await make_point.start_async(6)

    async with pgflow.App(dsn, schema=schema, poll_interval=0.5) as other:
        build_pair(other, Counter())
        theirs = other.handle(handle.id)
        assert await theirs.status_async() == "queued"
        async with anyio.create_task_group() as group:
            results: list[Point] = []

            async def wait() -> None:
                results.append(await theirs.result_async(timeout=TIMEOUT))

            group.start_soon(wait)
            async with app.worker(concurrency=2):
                assert await handle.result_async(timeout=TIMEOUT) == Point(6, -6)
        assert results == [Point(6, -6)]
    assert ran["make_point"] == 1


async def test_unknown_id_raises_unknown_workflow(app: pgflow.App) -> None:
    missing = app.handle("no-such-workflow")
    with pytest.raises(pgflow.UnknownWorkflow) as unknown:
        await missing.status_async()
    assert isinstance(unknown.value, LookupError)
    assert "no-such-workflow" in str(unknown.value)
    with pytest.raises(pgflow.UnknownWorkflow):
        await in_thread(missing.status)
    with pytest.raises(pgflow.UnknownWorkflow):
        await missing.result_async(timeout=TIMEOUT)
    with pytest.raises(pgflow.UnknownWorkflow):
        await in_thread(lambda: missing.result(timeout=TIMEOUT))
    with pytest.raises(pgflow.UnknownWorkflow):
        await missing.cancel_async()


# -- cancelling a queued workflow ------------------------------------------------------------------------


async def test_cancelled_queued_workflow_never_runs(app: pgflow.App, dsn: str, schema: str) -> None:
    ran: list[str] = []
    cancellable = labelling(app, "starting.cancellable", ran)
    cancellable_sync = labelling(app, "starting.cancellable_sync", ran, "sync", priority=1)

    by_async = await cancellable.start_async("async")
    by_sync = await in_thread(lambda: cancellable_sync.start("sync"))
    await by_async.cancel_async()
    await in_thread(by_sync.cancel)

    assert await by_async.status_async() == "cancelled"
    assert await in_thread(by_sync.status) == "cancelled"
    with pytest.raises(pgflow.WorkflowCancelled) as cancelled:
        await by_async.result_async(timeout=TIMEOUT)
    assert cancelled.value.workflow_id == by_async.id
    with pytest.raises(pgflow.WorkflowCancelled):
        await in_thread(lambda: by_sync.result(timeout=TIMEOUT))

    # Both were enqueued before the sentinel (one with a higher priority): a worker that ignored the
    # cancellation would run them first.
    async with app.worker(concurrency=1):
        sentinel = await cancellable.start_async("sentinel")
        assert await sentinel.result_async(timeout=TIMEOUT) == "sentinel"
        assert await by_async.status_async() == "cancelled"
    assert ran == ["sentinel"]
    for handle in (by_async, by_sync):
        assert await row_of(dsn, schema, handle.id, "status, attempt, started_at") == ("cancelled", 0, None)
    with pytest.raises(pgflow.WorkflowCancelled):
        await by_sync.result_async(timeout=TIMEOUT)


async def test_cancelling_a_finished_workflow_changes_nothing(app: pgflow.App) -> None:
    ok, bad = await one_succeeded_one_failed(app, Counter(), 2)
    async with app.worker(concurrency=2):  # a worker that would run again what a cancel put back
        await ok.cancel_async()
        await in_thread(bad.cancel)
        assert await ok.status_async() == "succeeded"
        assert await in_thread(bad.status) == "failed"
        assert await ok.result_async(timeout=TIMEOUT) == Point(2, -2)
        with pytest.raises(pgflow.WorkflowFailed):
            await bad.result_async(timeout=TIMEOUT)


async def test_every_workflow_has_a_run_cap_unless_it_asks_for_none(app: pgflow.App, dsn: str, schema: str) -> None:
    """A workflow whose runs keep being cut short (a step that kills its worker) is given up after
    DEFAULT_MAX_ATTEMPTS of them (tests/test_fleet.py shows the failure itself); ``None`` keeps the
    old unlimited behaviour, and a start by name of a workflow this process does not know gets the
    default too."""

    @app.workflow(name="capped.default")
    async def default() -> None: ...

    @app.workflow(name="capped.none", max_attempts=None)
    async def unlimited() -> None: ...

    handles = [await default.start_async(), await unlimited.start_async(),
               await app.start_by_name_async("capped.elsewhere")]
    caps = {id: cap for id, cap in await query(
        dsn, f'SELECT id, max_attempts FROM "{schema}".workflows WHERE id = ANY(%s)', [h.id for h in handles])}
    assert [caps[h.id] for h in handles] == [DEFAULT_MAX_ATTEMPTS, None, DEFAULT_MAX_ATTEMPTS]
    assert DEFAULT_MAX_ATTEMPTS == 20


@ONE_SERVER  # ids are checked in Python before any statement: the same on any server
async def test_ids_of_pgflows_own_forms_are_refused_before_anything_is_written(app: pgflow.App, dsn: str,
                                                                                schema: str) -> None:
    """A caller who could take a scheduled tick's id (``name@<time>``) or a child's (``<parent>.<n>``)
    first, with a far delay say, would stop that tick or child from ever running: such ids are refused."""

    @app.workflow(name="reserved.flow")
    async def flow() -> None: ...

    parent = await flow.start_async()
    tick = "reserved.flow@2026-12-01T10:00:00+00:00"
    for bad in (tick, f"{parent.id}.3", f"{parent.id}.1.0"):
        with pytest.raises(ValueError, match="is reserved"):
            await flow.with_options(id=bad).start_async()
        with pytest.raises(ValueError, match="is reserved"):
            flow.with_options(id=bad, delay=3600).start()
        with pytest.raises(ValueError, match="is reserved"):
            await flow.start_many_async([()], ids=[bad])
        with pytest.raises(ValueError, match="is reserved"):
            await app.start_by_name_async("reserved.flow", id=bad)
    [(count,)] = await query(dsn, f'SELECT count(*) FROM "{schema}".workflows')
    assert count == 1
    # Ids that only look alike are the caller's to choose.
    for fine in ("order.42", "alice@example.com", "report@2026-12-01T10:00:00", f"{parent.id}.x"):
        assert (await flow.with_options(id=fine).start_async()).id == fine
