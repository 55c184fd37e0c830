"""``app.start_by_name``: a process that does not import a workflow's code starts it by name; the
worker process that runs it checks the arguments against the function's hints, and a call that does
not fit fails the workflow once, with a clear recorded error (no crash loop)."""

from __future__ import annotations

import pytest

import pgflow

from .helpers import query, query_sync
from .processes import Processes, failure_of, result_of

TARGET = "tests.apps.prims:app"

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", ["prims.report", "prims.report_sync"])
def test_start_by_name_from_a_process_without_the_code(
    app: pgflow.App, dsn: str, schema: str, worker_env: dict[str, str], procs: Processes, name: str,
) -> None:
    assert name not in app.workflows  # the test's App knows nothing of the workflow
    worker = procs.worker("worker", TARGET, worker_env, concurrency=4)
    good = app.start_by_name(name, "q3", 12, id=f"{name}-good", kwargs={"tags": ["a", "b"]})
    assert result_of(good, procs) == "q3:12:a,b"
    # The same id again starts nothing and hands back the same workflow.
    assert app.start_by_name(name, "other", 1, id=f"{name}-good") == good
    assert result_of(good, procs) == "q3:12:a,b"

    bad = {
        "type": (("q3", "twelve"), None, "argument 'pages'"),
        "missing": (("q3",), None, "missing a required argument: 'pages'"),
        "extra": (("q3", 1, None, "surplus"), None, "too many positional arguments"),
        "keyword": (("q3", 1), {"colour": "red"}, "unexpected keyword argument 'colour'"),
    }
    handles = {what: app.start_by_name(name, *args, id=f"{name}-{what}", kwargs=kwargs)
               for what, (args, kwargs, _) in bad.items()}
    for what, (_, _, message) in bad.items():
        failed = failure_of(handles[what], procs)
        assert failed.error_type == "pgflow.errors.SerializationError", failed
        assert "started by name with arguments that do not fit" in failed.message
        assert message in failed.message, failed.message
    # Each bad call failed on its first claim, and was not tried again.
    rows = query_sync(dsn, f'SELECT id, status, attempt FROM "{schema}".workflows WHERE id LIKE %s', (f"{name}-%",))
    assert {r[0]: (r[1], r[2]) for r in rows if not r[0].endswith("-good")} == {
        f"{name}-{what}": ("failed", 1) for what in bad}
    assert worker.alive()


@pytest.mark.anyio
async def test_start_by_name_async_and_options(app: pgflow.App, dsn: str, schema: str) -> None:
    """The async twin; queue, priority, delay, max_attempts and timeout reach the row; a name this
    process has registered lends its own options as defaults."""

    @app.workflow(name="byname.known", queue="known", max_attempts=4, timeout=60.0, priority=3)
    async def known(x: int) -> int:
        return x * 2

    handle = await app.start_by_name_async("byname.unknown", 1, queue="elsewhere", priority=7, delay=30.0,
                                           max_attempts=2, timeout=5.0)
    [row] = await query(dsn, f'SELECT name, queue, priority, max_attempts, timeout, due_at > now() + interval'
                              f" '20 seconds' FROM \"{schema}\".workflows WHERE id = %s", handle.id)
    assert row == ("byname.unknown", "elsewhere", 7, 2, 5.0, True)
    local = await app.start_by_name_async("byname.known", 21)
    [row] = await query(dsn, f'SELECT queue, priority, max_attempts, timeout FROM "{schema}".workflows'
                              " WHERE id = %s", local.id)
    assert row == ("known", 3, 4, 60.0)
    async with app.worker(queues=["known"]):
        assert await local.result_async(timeout=30) == 42


@pytest.mark.anyio
async def test_start_by_name_from_a_workflow_starts_one_child(app: pgflow.App, dsn: str, schema: str) -> None:
    """Inside a workflow, the child's id comes from the parent's journal, so a replayed parent finds
    its child instead of starting another one (sync and async parents alike)."""

    @app.workflow(name="byname.child")
    async def child(x: int) -> int:
        return x + 1

    @app.workflow(name="byname.parent")
    async def parent() -> list[int]:
        a = await app.start_by_name_async("byname.child", 1)
        return [await a.result_async(), len(a.id)]

    @app.workflow(name="byname.parent_sync")
    def parent_sync() -> int:
        return int(app.start_by_name("byname.child", 10).result())

    one, two = await parent.start_async(), await parent_sync.start_async()
    async with app.worker(concurrency=4):
        assert (await one.result_async(timeout=30))[0] == 2
        assert await two.result_async(timeout=30) == 11
    children = await query(dsn, f'SELECT id FROM "{schema}".workflows WHERE name = %s ORDER BY id', "byname.child")
    assert sorted(children) == sorted([(f"{one.id}.0",), (f"{two.id}.0",)])


def test_start_by_name_refuses_bad_input_before_writing(app: pgflow.App, dsn: str, schema: str) -> None:
    with pytest.raises(pgflow.SerializationError, match="cannot be stored"):
        app.start_by_name("prims.report", object())
    with pytest.raises(ValueError, match="workflow name"):
        app.start_by_name("")
    with pytest.raises(ValueError, match="queue name"):
        app.start_by_name("prims.report", queue="")
    with pytest.raises(TypeError, match="kwargs"):
        app.start_by_name("prims.report", kwargs=[1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_attempts"):
        app.start_by_name("prims.report", max_attempts=0)
    assert app.list_workflows() == []


def test_start_by_name_id_of_another_workflow_conflicts(app: pgflow.App) -> None:
    app.start_by_name("byname.a", id="taken")
    with pytest.raises(pgflow.WorkflowConflict, match="already belongs to a workflow 'byname.a'"):
        app.start_by_name("byname.b", id="taken")
