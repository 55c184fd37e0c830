"""Debounced starts (``with_options(debounce=..., debounce_key=...)``): a burst of starts of one key is
one run, with the latest arguments, due once the key is quiet for the window or at ``debounce_max``.

Time is the schema's clock (``clock_now()``, which pgflow.testing moves too): the windows are long
(an hour), and the test moves the clock past them, so no wait here depends on how fast a loaded
machine makes the starts. Every wait is for an event (a result, a line a step wrote), bounded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import pytest

import pgflow
from pgflow._core import pruning

from .apps import debounced as debounced_app
from .helpers import TIMEOUT, query
from .processes import Processes, lines, result_of, wait_until

pytestmark = pytest.mark.anyio

HOUR = 3600.0


async def set_clock(dsn: str, schema: str, offset: float) -> None:
    """Move the schema's clock to ``offset`` seconds ahead of the server's (forward only), as
    pgflow.testing's clock does: the workers' claims read it."""
    body = f"SELECT pg_catalog.now() + ''{offset:.6f} seconds''::pg_catalog.interval"
    await query(dsn, f'CREATE OR REPLACE FUNCTION "{schema}".clock_now() RETURNS timestamptz LANGUAGE sql'
                     f" STABLE PARALLEL SAFE AS '{body}'")


async def counts(dsn: str, schema: str) -> tuple[int, int]:
    """(workflows, debounce keys) in the schema."""
    rows = await query(dsn, f'SELECT (SELECT count(*) FROM "{schema}".workflows),'
                            f' (SELECT count(*) FROM "{schema}".debounces)')
    return int(rows[0][0]), int(rows[0][1])


async def due_after_first(dsn: str, schema: str, workflow_id: str) -> float:
    """Seconds from the burst's first start to the run's due time."""
    rows = await query(dsn, f'SELECT extract(epoch FROM w.due_at - d.first_at)::float8 FROM "{schema}".workflows w'
                            f' JOIN "{schema}".debounces d ON d.workflow_id = w.id WHERE w.id = %s', workflow_id)
    return float(rows[0][0])


def recording(app: pgflow.App, name: str, ran: list[Any], kind: str = "async") -> pgflow.Workflow[Any, Any]:
    """A workflow that appends its argument to ``ran`` and returns it doubled, as ``kind``."""
    if kind == "async":
        async def body_async(x: int) -> int:
            ran.append(x)
            return x * 2
        return app.workflow(name=name)(body_async)

    def body_sync(x: int) -> int:
        ran.append(x)
        return x * 2
    return app.workflow(name=name)(body_sync)


# -- a burst is one run -------------------------------------------------------------------------------------


async def test_ten_starts_of_one_key_run_once_with_the_last_arguments(app: pgflow.App, dsn: str,
                                                                      schema: str) -> None:
    ran: list[int] = []
    wf = recording(app, "debounce.burst", ran)
    starter = wf.with_options(debounce=HOUR, debounce_key="doc-42")
    async with app.worker(concurrency=4):
        handles = [await starter.start_async(i) for i in range(10)]
        assert len({h.id for h in handles}) == 1
        assert await handles[0].status_async() == "queued"  # (the window has an hour to go)
        assert await counts(dsn, schema) == (1, 1)
        await set_clock(dsn, schema, HOUR + 1)
        assert [await h.result_async(timeout=TIMEOUT) for h in handles] == [18] * 10
    assert ran == [9]


async def test_sync_twins_behave_the_same(app: pgflow.App, dsn: str, schema: str) -> None:
    """The sync API from a plain thread (as a sync web framework calls it), and a ``def`` workflow:
    one run, the last arguments, every handle's result."""
    ran: list[int] = []
    wf = recording(app, "debounce.sync", ran, kind="sync")
    starter = wf.with_options(debounce=HOUR).with_options(debounce_key="doc-42")  # options given in parts

    def burst() -> list[pgflow.WorkflowHandle[Any]]:
        handles = [starter.start(i) for i in range(10)]
        assert handles[-1].status() == "queued"
        return handles

    async with app.worker(concurrency=4):
        handles = await anyio.to_thread.run_sync(burst)
        assert len({h.id for h in handles}) == 1
        await set_clock(dsn, schema, HOUR + 1)
        results = await anyio.to_thread.run_sync(lambda: [h.result(timeout=TIMEOUT) for h in handles])
    assert results == [18] * 10
    assert ran == [9]


async def test_concurrent_starts_from_two_processes_collapse(app: pgflow.App, second_app: pgflow.App,
                                                             dsn: str, schema: str) -> None:
    """Starts racing from two Apps (as two processes would) and from threads: one run. Which start
    came last is the order their transactions took the key's lock: its arguments are the run's."""
    ran: list[int] = []
    wf, other = recording(app, "debounce.race", ran), recording(second_app, "debounce.race", [])
    await app.migrate_async()
    ids: list[str] = []

    async def start_async(wf_: pgflow.Workflow[Any, Any], i: int) -> None:
        ids.append((await wf_.with_options(debounce=HOUR, debounce_key="k").start_async(i)).id)

    def start_sync(i: int) -> None:
        ids.append(other.with_options(debounce=HOUR, debounce_key="k").start(i).id)

    async with anyio.create_task_group() as group:
        for i in range(20):
            group.start_soon(start_async, wf if i % 2 else other, i)
        for i in range(20, 30):
            group.start_soon(anyio.to_thread.run_sync, start_sync, i)
    assert len(ids) == 30 and len(set(ids)) == 1
    assert await counts(dsn, schema) == (1, 1)
    async with app.worker(concurrency=4):
        await set_clock(dsn, schema, HOUR + 1)
        result = await app.handle(ids[0]).result_async(timeout=TIMEOUT)
    assert len(ran) == 1 and result == ran[0] * 2


async def test_two_keys_run_separately(app: pgflow.App, dsn: str, schema: str) -> None:
    ran: list[int] = []
    wf = recording(app, "debounce.keys", ran)
    a = [await wf.with_options(debounce=HOUR, debounce_key="a").start_async(i) for i in (1, 2, 3)]
    b = [await wf.with_options(debounce=HOUR, debounce_key="b").start_async(i) for i in (10, 20)]
    assert len({h.id for h in a}) == 1 and len({h.id for h in b}) == 1 and a[0].id != b[0].id
    # One key's start moves no other key's run: "a"'s run keeps the due time it had.
    async with app.worker(concurrency=4):
        await set_clock(dsn, schema, HOUR + 1)
        assert await a[0].result_async(timeout=TIMEOUT) == 6
        assert await b[0].result_async(timeout=TIMEOUT) == 40
    assert sorted(ran) == [3, 20]


async def test_a_start_after_the_run_began_makes_a_new_run(app: pgflow.App, dsn: str, schema: str) -> None:
    began, release = threading.Event(), threading.Event()
    ran: list[int] = []

    @app.workflow(name="debounce.held")
    async def held(x: int) -> int:
        ran.append(x)
        if x == 1:
            began.set()
            await anyio.to_thread.run_sync(release.wait, TIMEOUT)
        return x

    starter = held.with_options(debounce=HOUR, debounce_key="k")
    async with app.worker(concurrency=4):
        first = await starter.start_async(1)
        await set_clock(dsn, schema, HOUR + 1)
        assert await anyio.to_thread.run_sync(began.wait, TIMEOUT)
        assert await first.status_async() == "running"
        second = await starter.start_async(2)  # the run began: this one is the next burst's
        again = await starter.start_async(3)
        assert second.id != first.id and again.id == second.id
        assert await second.status_async() == "queued"
        release.set()
        assert await first.result_async(timeout=TIMEOUT) == 1
        await set_clock(dsn, schema, 2 * HOUR + 2)
        assert await second.result_async(timeout=TIMEOUT) == 3
    assert ran == [1, 3]


async def test_debounce_max_bounds_a_burst_that_never_goes_quiet(app: pgflow.App, dsn: str, schema: str) -> None:
    """Window 10 s, at most 25 s: starts every 8 s would push the run on for ever; it is due 25 s
    after the first, and runs once, with the arguments of the last start before that."""
    ran: list[int] = []
    wf = recording(app, "debounce.max", ran)
    starter = wf.with_options(debounce=10.0, debounce_key="busy", debounce_max=25.0)
    await app.migrate_async()
    await set_clock(dsn, schema, HOUR)  # (a clock far from now, which the test moves by itself)
    handles, dues = [], []
    for n, at in enumerate((0.0, 8.0, 16.0, 24.0)):
        await set_clock(dsn, schema, HOUR + at)
        handles.append(await starter.start_async(n))
        dues.append(await due_after_first(dsn, schema, handles[0].id))
    assert len({h.id for h in handles}) == 1
    # Each start pushed the run on to 10 s after itself (the real time the starts took is in the
    # clock too, so those are approximate), until the bound: 25 s after the first, exactly.
    assert dues[0] == pytest.approx(10.0, abs=5.0) and dues[1] == pytest.approx(18.0, abs=5.0)
    assert dues[2] == dues[3] == 25.0
    async with app.worker(concurrency=4):
        await set_clock(dsn, schema, HOUR + 26.0)
        assert await handles[0].result_async(timeout=TIMEOUT) == 6
    assert ran == [3]


async def test_the_default_max_is_ten_windows(app: pgflow.App, dsn: str, schema: str) -> None:
    wf = recording(app, "debounce.default_max", [])
    await app.migrate_async()
    starter = wf.with_options(debounce=10.0, debounce_key="k")
    handle = await starter.start_async(0)
    for at in range(8, 200, 8):  # a start every 8 s for over 3 minutes
        await set_clock(dsn, schema, float(at))
        assert (await starter.start_async(at)).id == handle.id
    assert await due_after_first(dsn, schema, handle.id) == 100.0


async def test_retention_forgets_the_keys_whose_run_began(app: pgflow.App, dsn: str, schema: str) -> None:
    wf = recording(app, "debounce.forget", [])
    done = await wf.with_options(debounce=1.0, debounce_key="done").start_async(1)
    waiting = await wf.with_options(debounce=HOUR, debounce_key="waiting").start_async(2)
    assert await counts(dsn, schema) == (2, 2)
    async with app.worker(concurrency=4):  # (whose retention service may forget "done" first)
        await set_clock(dsn, schema, 2.0)
        assert await done.result_async(timeout=TIMEOUT) == 2
    runtime = app._client.runtime()
    assert await runtime.db(lambda store: pruning.prune_debounces(store)) in (0, 1)
    rows = await query(dsn, f'SELECT key, workflow_id FROM "{schema}".debounces')
    assert rows == [("waiting", waiting.id)]
    # The key whose run ended begins a new one at its next start.
    assert (await wf.with_options(debounce=HOUR, debounce_key="done").start_async(3)).id != done.id


# -- refusals ------------------------------------------------------------------------------------------------


def refusals(wf: pgflow.Workflow[Any, Any]) -> list[tuple[str, Callable[[], Any]]]:
    """Each bad use of debounce, as a call that must raise ValueError and write nothing."""
    return [
        ("zero window", lambda: wf.with_options(debounce=0, debounce_key="k")),
        ("negative window", lambda: wf.with_options(debounce=-1.0, debounce_key="k")),
        ("a key without a window", lambda: wf.with_options(debounce_key="k").start(1)),
        ("a window without a key", lambda: wf.with_options(debounce=2.0).start(1)),
        ("debounce_max alone", lambda: wf.with_options(debounce_max=20.0).start(1)),
        ("a key that is no string", lambda: wf.with_options(debounce=2.0, debounce_key=42)),  # type: ignore[arg-type]
        ("an empty key", lambda: wf.with_options(debounce=2.0, debounce_key="")),
        ("with id=", lambda: wf.with_options(id="x", debounce=2.0, debounce_key="k")),
        ("with id= given before", lambda: wf.with_options(id="x").with_options(debounce=2.0, debounce_key="k")),
        ("with delay=", lambda: wf.with_options(delay=5.0, debounce=2.0, debounce_key="k")),
        ("with eta=", lambda: wf.with_options(eta=datetime.now().astimezone(), debounce=2.0, debounce_key="k")),
        ("debounce_max below the window", lambda: wf.with_options(debounce=5.0, debounce_key="k", debounce_max=4.0)),
        ("expiring before the window", lambda: wf.with_options(debounce=5.0, debounce_key="k", expires=3.0)),
        ("start_many", lambda: wf.with_options(debounce=2.0, debounce_key="k").start_many([(1,), (2,)])),
    ]


def test_bad_input_is_refused_before_anything_is_written(app: pgflow.App, dsn: str, schema: str) -> None:
    wf = recording(app, "debounce.refused", [])
    app.migrate()
    for what, call in refusals(wf):
        with pytest.raises(ValueError) as raised:
            call()
        assert "debounce" in str(raised.value), what
    with pytest.raises(ValueError, match="start_many cannot debounce: it makes one run per call"):
        wf.with_options(debounce=2.0, debounce_key="k").start_many([(1,)])
    assert anyio.run(counts, dsn, schema) == (0, 0)


async def test_bad_input_is_refused_by_the_async_twins(app: pgflow.App, dsn: str, schema: str) -> None:
    wf = recording(app, "debounce.refused_async", [])
    await app.migrate_async()
    with pytest.raises(ValueError, match="without debounce_key"):
        await wf.with_options(debounce=2.0).start_async(1)
    with pytest.raises(ValueError, match="start_many cannot debounce"):
        await wf.with_options(debounce=2.0, debounce_key="k").start_many_async([(1,)])
    assert await counts(dsn, schema) == (0, 0)


async def test_a_workflow_body_may_not_debounce(app: pgflow.App, dsn: str, schema: str) -> None:
    """A body's starts are replayed; a debounced start's run cannot be found again by a replay."""
    target = recording(app, "debounce.target", [])

    @app.workflow(name="debounce.from_body")
    async def from_body() -> str:
        try:
            await target.with_options(debounce=2.0, debounce_key="k").start_async(1)
        except ValueError as exc:
            return str(exc)
        return "started"

    async with app.worker(concurrency=2):
        said = await (await from_body.start_async()).result_async(timeout=TIMEOUT)
    assert "cannot be made from a workflow's body" in said and "from a step" in said
    assert await counts(dsn, schema) == (1, 0)


# -- a worker killed ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["waiting", "running"])
def test_a_worker_killed_while_the_run_waits_or_runs_leaves_one_run(
    app: pgflow.App, dsn: str, schema: str, worker_env: dict[str, str], procs: Processes, tmp_path: Path,
    when: str,
) -> None:
    """SIGKILL of the worker process while the debounced run waits for its window (the run is a
    queued row, not a timer in the worker) or while it runs (its lease runs out and another worker
    takes it over): the run happens once, with the burst's last arguments, and every handle has its
    result."""
    flows = debounced_app.build(app)
    effects, gate = tmp_path / "effects.txt", tmp_path / "gate"
    starter = flows.debounced.with_options(debounce=HOUR, debounce_key="doc")
    a = procs.worker("worker-A", "tests.apps.debounced:app", worker_env)
    handles = [starter.start(str(effects), str(gate), n) for n in (1, 2)]
    if when == "running":
        anyio.run(set_clock, dsn, schema, HOUR + 1)
        wait_until(lambda: any(line.startswith("start 2") for line in lines(effects)), "the run to begin in A",
                   procs, a)
        a.kill()
    else:
        a.kill()
        handles.append(starter.start(str(effects), str(gate), 3))  # joins the run the dead worker left
        anyio.run(set_clock, dsn, schema, HOUR + 1)
    gate.touch()
    procs.worker("worker-B", "tests.apps.debounced:app", worker_env)
    last = 3 if when == "waiting" else 2
    assert {h.id for h in handles} == {handles[0].id}
    assert [result_of(h, procs) for h in handles] == [last * 10] * len(handles)
    done = [line for line in lines(effects) if line.startswith("done")]
    assert len(done) == 1 and done[0].startswith(f"done {last} "), lines(effects)
    assert anyio.run(counts, dsn, schema)[0] == 1
