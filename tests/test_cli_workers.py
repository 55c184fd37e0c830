"""``pgflow workers`` marks a worker whose heartbeat is older than its lease as DEAD: here a real worker
process killed with SIGKILL, beside a live one. And a stopped worker leaves quietly when idle, and
through the exit hooks either way."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec

import pgflow

from .helpers import ONE_SERVER
from .processes import LEASE, Processes, wait_until

WAIT = 60.0


def workers(env: dict[str, str]) -> list[dict[str, Any]]:
    result = subprocess.run([sys.executable, "-m", "pgflow", "workers", "--json"], env=env, capture_output=True,
                            text=True, timeout=WAIT)
    assert result.returncode == 0, result.stderr
    listed: list[dict[str, Any]] = msgspec.json.decode(result.stdout)
    return listed


def test_a_killed_worker_is_marked_dead_and_a_live_one_is_not(procs: Processes, worker_env: dict[str, str]) -> None:
    doomed = procs.worker("doomed", "tests.apps.probed:app", worker_env, lease=LEASE)
    alive = procs.worker("alive", "tests.apps.probed:app", worker_env, lease=3 * LEASE)
    both = wait_until(lambda: len(found := workers(worker_env)) == 2 and found, "both workers to register",
                      procs, doomed, alive)
    assert {w["pid"]: (w["dead"], w["lease_s"]) for w in both} == {doomed.pid: (False, LEASE),
                                                                  alive.pid: (False, 3 * LEASE)}
    doomed.signal(signal.SIGKILL)
    doomed.wait_exit()
    def with_a_dead_one() -> list[dict[str, Any]] | None:
        found = workers(worker_env)
        return found if any(w["dead"] for w in found) else None

    listed = wait_until(with_a_dead_one, "the killed worker to be marked dead", procs, alive)
    by_pid = {w["pid"]: w for w in listed}
    assert by_pid[doomed.pid]["dead"] and by_pid[doomed.pid]["heartbeat_age_s"] > LEASE
    assert not by_pid[alive.pid]["dead"]  # its heartbeat comes every lease / 3

    text = subprocess.run([sys.executable, "-m", "pgflow", "workers"], env=worker_env, capture_output=True,
                          text=True, timeout=WAIT).stdout
    header, *rows = text.splitlines()
    assert header.split()[:2] == ["ID", "STATE"]
    states = {row.split()[3]: row.split()[1] for row in rows if row.split()[1] in ("live", "DEAD")}
    assert states == {str(doomed.pid): "DEAD", str(alive.pid): "live"}
    assert "(DEAD: its heartbeat is older than its lease" in text


# -- stopping: quiet when idle, through the exit hooks ------------------------------------------------------

EXITING = "tests.apps.exiting:app"


def test_an_idle_worker_stops_quietly_and_leaves_through_the_exit_hooks(
        procs: Processes, dsn: str, schema: str, worker_env: dict[str, str], tmp_path: Path) -> None:
    """An idle worker's pool thread (a sync workflow ran on it) was counted as a step thread still
    running: a warning, and an exit by ``os._exit`` that skipped the atexit hooks (the embedded
    server's stop among them)."""
    marker = tmp_path / "atexit"
    worker = procs.worker("w", EXITING, {**worker_env, "PGFLOW_TEST_ATEXIT": str(marker)}, lease=LEASE)
    with pgflow.App(dsn, schema=schema) as caller:
        wait_until(lambda: "started: server" in worker.output(), "the worker to start", procs, worker)
        assert caller.start_by_name("exiting.quick", 1).result(timeout=WAIT) == 2
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit() == 0, worker.describe()
    assert "step threads" not in worker.output() and "WARNING" not in worker.output(), worker.describe()
    assert "stopped" in worker.output()
    assert marker.read_text() == f"{worker.pid}\n"


@ONE_SERVER  # the process's threads and exit hooks: the same on any server
def test_a_worker_stopped_past_a_stuck_step_thread_names_it_and_still_runs_the_exit_hooks(
        procs: Processes, dsn: str, schema: str, worker_env: dict[str, str], tmp_path: Path) -> None:
    marker, started = tmp_path / "atexit", tmp_path / "started"
    worker = procs.worker("w", EXITING, {**worker_env, "PGFLOW_TEST_ATEXIT": str(marker)}, lease=LEASE, grace=0.5)
    with pgflow.App(dsn, schema=schema) as caller:
        caller.start_by_name("exiting.held", str(tmp_path / "never"), str(started))
        wait_until(started.exists, "the sync step to start", procs, worker)
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit() == 3, worker.describe()  # given back after the grace period
    assert "exiting with 1 step threads still running (AnyIO worker thread)" in worker.output(), worker.describe()
    assert marker.read_text() == f"{worker.pid}\n"


def test_threads_on_their_way_out_are_not_counted_as_stuck() -> None:
    """In a process of its own: threads that other tests left in this one would count."""
    subprocess.run([sys.executable, "-c", _THREADS_CHECK], check=True, timeout=60)


_THREADS_CHECK = """
import threading, time
from pgflow.cli import LEAVING, _threads_still_running
leaving = threading.Thread(target=time.sleep, args=(0.2,), name="leaving")
release = threading.Event()
stuck = threading.Thread(target=release.wait, name="stuck")
leaving.start()
began = time.monotonic()
assert _threads_still_running(LEAVING) == []
assert time.monotonic() - began < LEAVING  # returned once the thread had left
stuck.start()
try:
    assert _threads_still_running(0.2) == [stuck]
finally:
    release.set()
    stuck.join()
"""
