"""``pgflow status`` fails, one line per problem and the same in ``--json``, when work waits for ever or
too long: work on a queue that no live worker serves, a queue whose oldest due workflow has waited past
``--max-wait``, a registered worker that is dead while work waits on its queues. Against real servers,
with a real worker process where one must die; and the dashboard's health section says the same."""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Any

import anyio
import msgspec
import pytest

import pgflow
from pgflow.dashboard.overview import _health
from pgflow.records import Health, WorkerInfo

from .processes import LEASE, Processes, wait_until

WAIT = 60.0

pytestmark = pytest.mark.anyio


def status(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pgflow", "status", *args], env=env, capture_output=True,
                          text=True, timeout=WAIT)


async def status_async(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return await anyio.to_thread.run_sync(lambda: status(env, *args))


def reported(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    decoded: dict[str, Any] = msgspec.json.decode(result.stdout)
    return decoded


async def registered(app: pgflow.App) -> None:
    with anyio.fail_after(WAIT):
        while not [w for w in await app.workers_info_async() if not w.dead]:
            await anyio.sleep(0.05)


async def test_work_on_a_queue_no_live_worker_serves_is_unhealthy(app: pgflow.App, worker_env: dict[str, str]) -> None:
    @app.workflow(name="truth.echo")
    async def echo(n: int) -> int:
        return n

    async with app.worker(queues=["default"]):
        await registered(app)
        assert await (await echo.start_async(1)).result_async(timeout=WAIT) == 1
        # Delayed: it waits for its time, not for a worker (yet).
        await echo.with_options(queue="forgotten", delay=3600).start_async(2)
        healthy = await status_async(worker_env)
        assert healthy.returncode == 0 and healthy.stdout.startswith("healthy: 1 live workers"), healthy.stdout

        waiting = await echo.with_options(queue="forgotten").start_async(3)
        text = await status_async(worker_env)
        line = "1 workflows waiting on queue 'forgotten': no live worker serves that queue"
        header = "UNHEALTHY: 1 live workers, NOTIFY queue 0.0% full"
        assert text.returncode == 1 and text.stdout.splitlines() == [header, f"  {line}"], text.stdout
        as_json = await status_async(worker_env, "--json")
        report = reported(as_json)
        assert as_json.returncode == 1 and not report["ok"]
        assert report["unserved_queues"] == {"forgotten": 1} and report["problems"] == [line]
        assert report["unserved"] == {}  # its name is served: only its queue is not
        assert await waiting.status_async() == "queued"


async def test_a_queue_whose_oldest_due_workflow_waited_too_long_is_unhealthy(
        app: pgflow.App, worker_env: dict[str, str]) -> None:
    gate = anyio.Event()

    @app.workflow(name="truth.hold")
    async def hold() -> str:
        await gate.wait()
        return "held"

    @app.workflow(name="truth.after")
    async def after() -> str:
        return "after"

    async with app.worker(concurrency=1):
        await registered(app)
        held = await hold.start_async()
        with anyio.fail_after(WAIT):
            while await held.status_async() != "running":
                await anyio.sleep(0.05)
        behind = await after.start_async()  # no free slot: it waits, due
        await anyio.sleep(1.5)
        patient = await status_async(worker_env)  # the default allows 5 minutes
        assert patient.returncode == 0, patient.stdout
        strict = await status_async(worker_env, "--max-wait", "1s")
        assert strict.returncode == 1, strict.stdout
        [problem] = strict.stdout.splitlines()[1:]
        assert problem.startswith("  the oldest due workflow on queue 'default' has waited ")
        assert problem.endswith(" s (more than the 1 s allowed)")
        report = reported(await status_async(worker_env, "--max-wait", "1", "--json"))
        assert report["max_wait_s"] == 1.0 and report["overdue"]["default"] >= 1.5 and not report["ok"]

        gate.set()
        assert await behind.result_async(timeout=WAIT) == "after" and await held.result_async(timeout=WAIT) == "held"
        assert (await status_async(worker_env, "--max-wait", "1")).returncode == 0
    bad = await status_async(worker_env, "--max-wait", "soon")
    assert bad.returncode == 2 and "not a duration: 'soon'" in bad.stderr


async def test_a_dead_worker_is_a_problem_while_work_waits_on_its_queues(
        app: pgflow.App, worker_env: dict[str, str], procs: Processes) -> None:
    lost = procs.worker("lost", "tests.apps.exiting:app", worker_env, queues="lost", lease=LEASE)
    async with app.worker(queues=["default"]):

        def both() -> bool:
            return len(app.workers_info()) == 2

        await anyio.to_thread.run_sync(lambda: wait_until(both, "both workers to register", procs, lost))
        lost.signal(signal.SIGKILL)
        lost.wait_exit()
        with anyio.fail_after(WAIT):
            while not any(w.dead for w in await app.workers_info_async()):
                await anyio.sleep(0.1)
        # Dead, but nothing waits on its queue: nothing to tell.
        quiet = await status_async(worker_env)
        assert quiet.returncode == 0, quiet.stdout

        await app.start_by_name_async("exiting.quick", 1, queue="lost")
        text = await status_async(worker_env)
        assert text.returncode == 1
        [dead] = [line for line in text.stdout.splitlines() if "is dead" in line]
        assert dead.startswith(f"  worker '{[w.id for w in app.workers_info() if w.dead][0]}' is dead (heartbeat ")
        assert dead.endswith(f" s old, lease {LEASE:g} s) while work waits on its queues 'lost'")
        assert "  1 workflows waiting on queue 'lost': no live worker serves that queue" in text.stdout
        report = reported(await status_async(worker_env, "--json"))
        assert [(w["pid"], w["dead"], w["queues"]) for w in report["dead_workers"]] == [(lost.pid, True, ["lost"])]
        assert report["live_workers"] == 1


def test_the_dashboard_shows_the_same_problems() -> None:
    dead = WorkerInfo("host:1:ab", "host", 1, ["bulk"], "1", 42.0, 0, ["x"], 10.0, True)
    health = Health(1, 0.0, {}, [], [], [], unserved_queues={"q<1>": 3}, overdue={"default": 400.0},
                    dead_workers=[dead], max_wait_s=300.0)
    assert health.problems == [
        "3 workflows waiting on queue 'q<1>': no live worker serves that queue",
        "the oldest due workflow on queue 'default' has waited 400 s (more than the 300 s allowed)",
        "worker 'host:1:ab' is dead (heartbeat 42 s old, lease 10 s) while work waits on its queues 'bulk'",
    ] and not health.ok
    section = _health(health, None, {"connected": False, "reconnects": 0, "pings_rejected": 0})
    assert "UNHEALTHY" in section
    assert "3 workflows waiting on queue <code>q&lt;1&gt;</code>: no live worker serves that queue" in section
    assert "the oldest due workflow on queue <code>default</code> has waited 6 min 40 s" in section
    assert "worker <code>host:1:ab</code> is dead (heartbeat 42.0 s old) while work waits on its queues" in section
    assert Health(1, 0.0, {}, [], [], []).ok
