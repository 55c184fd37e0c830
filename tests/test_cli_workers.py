"""``pgflow workers`` marks a worker whose heartbeat is older than its lease as DEAD: here a real worker
process killed with SIGKILL, beside a live one."""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Any

import msgspec

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
