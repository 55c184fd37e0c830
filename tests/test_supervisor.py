"""``pgflow worker --processes N``, run as real processes: a child killed with SIGKILL is restarted while
the others serve on; the supervisor exits 0 on SIGTERM or SIGINT whatever its children are doing
(running, starting, waiting to be restarted); a child that keeps crashing is restarted after a wait that
doubles and starts over once a child has lived long enough. The waits are set through the environment
($PGFLOW_RESTART_*), so the tests take seconds."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path

import pytest

import pgflow

from .helpers import ONE_SERVER
from .processes import LEASE, Proc, Processes, wait_until
from .test_worker_health import probe, probe_port

APP = "tests.apps.supervised:app"
WAIT = 60.0
STOP_WAIT = 20.0  # seconds a supervisor of idle children gets to stop
STARTED = re.compile(r"^(\S+ \S+) INFO pgflow.supervisor: started worker process (\d+) \(pid (\d+)\)", re.M)
RESTARTING = re.compile(r"^(\S+ \S+) WARNING pgflow.supervisor: worker process (\d+) \(pid (\d+)\) exited with"
                        r" (\d+) after [\d.]+s; restarting in ([\d.]+)s \(exit (\d+) in a row\)", re.M)


def parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def started(supervisor: Proc) -> list[tuple[datetime, int, int]]:
    """(when, slot, pid) of every child the supervisor started, in order."""
    return [(_time(when), int(slot), int(pid)) for when, slot, pid in STARTED.findall(supervisor.output())]


def restarts(supervisor: Proc) -> list[tuple[datetime, int, int, int, float, int]]:
    """(when, slot, pid, exit code, wait, exits in a row) of every exit the supervisor dealt with."""
    return [(_time(when), int(slot), int(pid), int(code), float(wait), int(row))
            for when, slot, pid, code, wait, row in RESTARTING.findall(supervisor.output())]


def _time(text: str) -> datetime:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f")


def live_children(app: pgflow.App, supervisor: Proc) -> set[int]:
    """The pids of the supervisor's children registered as live workers."""
    return {w.pid for w in app.workers_info() if not w.dead and parent_of(w.pid) == supervisor.pid}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return parent_of(pid) is not None


class Supervised:
    """Starts supervisors for one test, and afterwards kills any left with their children (which live
    in sessions of their own, so killing a supervisor alone would orphan them): the supervisor is
    frozen first, so that it starts no new one meanwhile."""

    def __init__(self, procs: Processes, env: dict[str, str]) -> None:
        self.procs, self.env = procs, env
        self.supervisors: list[Proc] = []

    def start(self, processes: int, *, delay: float, most: float, reset: float, extra: Sequence[str] = (),
              **env: str) -> Proc:
        environ = {**self.env, "PGFLOW_RESTART_DELAY": str(delay), "PGFLOW_RESTART_DELAY_MAX": str(most),
                   "PGFLOW_RESTART_RESET": str(reset), **env}
        supervisor = self.procs.worker(f"supervisor-{len(self.supervisors)}", APP, environ, concurrency=2,
                                       lease=LEASE, grace=5.0, extra=["--processes", str(processes), *extra])
        self.supervisors.append(supervisor)
        return supervisor

    def kill_all(self) -> None:
        for supervisor in self.supervisors:
            if supervisor.alive():
                supervisor.signal(signal.SIGSTOP)
            for _, _, pid in started(supervisor):
                if parent_of(pid) == supervisor.pid:
                    os.kill(pid, signal.SIGKILL)
            supervisor.stop()


@pytest.fixture
def supervised(procs: Processes, worker_env: dict[str, str]) -> Iterator[Supervised]:
    made = Supervised(procs, worker_env)
    try:
        yield made
    finally:
        made.kill_all()


@ONE_SERVER  # the supervisor's restarts and signals are its process's matter: the same on any server
def test_a_killed_child_is_restarted_while_the_others_serve_on(
        supervised: Supervised, procs: Processes, dsn: str, schema: str) -> None:
    supervisor = supervised.start(3, delay=5.0, most=5.0, reset=30.0)
    with pgflow.App(dsn, schema=schema) as app:
        first = wait_until(lambda: len(pids := live_children(app, supervisor)) == 3 and pids,
                           "3 worker processes to register", procs, supervisor)
        victim, *survivors = sorted(first)
        os.kill(victim, signal.SIGKILL)
        [(_, _, pid, code, wait, row)] = wait_until(lambda: restarts(supervisor), "the supervisor to see the exit",
                                                    procs, supervisor)
        assert (pid, code, wait, row) == (victim, 137, 5.0, 1)
        # While the killed one waits to be restarted, the other two serve.
        handles = [app.start_by_name("supervised.pid") for _ in range(6)]
        assert {h.result(timeout=WAIT) for h in handles} <= set(survivors)
        assert len(started(supervisor)) == 3, supervisor.describe()  # (no restart yet: the wait is 5 s)
        assert all(alive(p) for p in survivors)
        replacement = wait_until(lambda: len(pids := live_children(app, supervisor) - first) == 1 and pids,
                                 "the supervisor to restart the killed worker", procs, supervisor)
        assert live_children(app, supervisor) == set(survivors) | replacement  # the others were left alone
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait_exit(STOP_WAIT) == 0, supervisor.describe()
    assert not any(alive(p) for p in {*survivors, *replacement})


@ONE_SERVER  # the supervisor's restarts and signals are its process's matter: the same on any server
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_a_child_waits_to_be_restarted_stops_with_0(
        supervised: Supervised, procs: Processes, dsn: str, schema: str, signum: int) -> None:
    """A child killed by SIGKILL and waiting for its restart made the supervisor exit 137 (its
    code was counted as one of the stopped children's)."""
    supervisor = supervised.start(2, delay=60.0, most=60.0, reset=30.0)
    with pgflow.App(dsn, schema=schema) as app:
        victim, other = sorted(wait_until(lambda: len(pids := live_children(app, supervisor)) == 2 and pids,
                                          "2 worker processes to register", procs, supervisor))
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: restarts(supervisor), "the supervisor to see the exit", procs, supervisor)
    supervisor.signal(signum)
    assert supervisor.wait_exit(STOP_WAIT) == 0, supervisor.describe()
    assert len(started(supervisor)) == 2 and not alive(other)  # not restarted; the other drained
    assert "stopped" in supervisor.output()


@ONE_SERVER  # the supervisor's restarts and signals are its process's matter: the same on any server
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_a_child_starts_stops_with_0(supervised: Supervised, procs: Processes, signum: int) -> None:
    """A child still importing the app has no handler yet: the SIGTERM passed on kills it, which
    counts as a clean stop (it held nothing)."""
    supervisor = supervised.start(1, delay=1.0, most=1.0, reset=30.0, PGFLOW_TEST_IMPORT_DELAY="30")
    [(_, _, child)] = wait_until(lambda: started(supervisor), "the supervisor to start its child", procs, supervisor)
    time.sleep(0.5)  # (the child is importing the app for 30 s)
    supervisor.signal(signum)
    assert supervisor.wait_exit(STOP_WAIT) == 0, supervisor.describe()
    assert not alive(child) and not restarts(supervisor)


@ONE_SERVER  # the supervisor's restarts and signals are its process's matter: the same on any server
def test_a_child_that_keeps_crashing_waits_longer_each_time_and_starts_over_after_a_long_life(
        supervised: Supervised, procs: Processes, dsn: str, schema: str, tmp_path: Path) -> None:
    crash = tmp_path / "crash"
    crash.touch()  # every child dies as it imports the app
    supervisor = supervised.start(1, delay=0.3, most=1.2, reset=3.0, PGFLOW_TEST_CRASH=str(crash))
    exits = wait_until(lambda: len(found := restarts(supervisor)) >= 4 and found, "four crashes", procs, supervisor)
    assert [(code, wait, row) for _, _, _, code, wait, row in exits[:4]] == [(1, 0.3, 1), (1, 0.6, 2), (1, 1.2, 3),
                                                                            (1, 1.2, 4)]
    # Each restart came after its wait (the log's clock has milliseconds).
    starts = wait_until(lambda: len(found := started(supervisor)) >= 5 and found, "the fifth start", procs,
                        supervisor)
    for (exited, _, _, _, wait, _), (restarted, _, _) in zip(exits[:4], starts[1:5], strict=True):
        assert (restarted - exited).total_seconds() >= wait - 0.01, supervisor.describe()

    crash.unlink()  # the next child lives; past 3 s, its next exit waits the first wait again
    with pgflow.App(dsn, schema=schema) as app:
        [living] = wait_until(lambda: live_children(app, supervisor), "a child to start and register", procs,
                              supervisor)
    [(born, _, _)] = [entry for entry in started(supervisor) if entry[2] == living]
    time.sleep(max(0.0, 3.5 - (datetime.now() - born).total_seconds()))
    crashes = len(restarts(supervisor))
    os.kill(living, signal.SIGKILL)
    wait_until(lambda: len(restarts(supervisor)) > crashes, "the supervisor to see the exit", procs, supervisor)
    _, _, pid, code, wait, row = restarts(supervisor)[-1]
    assert (pid, code, wait, row) == (living, 137, 0.3, 1), supervisor.describe()
    wait_until(lambda: len(started(supervisor)) == crashes + 2, "the restart", procs, supervisor)
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait_exit(STOP_WAIT) == 0, supervisor.describe()



@ONE_SERVER  # the supervisor's restarts and signals are its process's matter: the same on any server
def test_one_supervised_child_serves_the_probe(supervised: Supervised, procs: Processes) -> None:
    """``--health-port`` with ``--processes 1``: the one child serves it (more could not share the port)."""
    supervisor = supervised.start(1, delay=1.0, most=1.0, reset=30.0,
                                  extra=("--health-port", "0", "--health-host", "127.0.0.1"))
    port = probe_port(supervisor, procs)
    wait_until(lambda: probe(port)[0] == 200, "the child's probe to say ok", procs, supervisor)
    [(_, _, child)] = started(supervisor)
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait_exit(STOP_WAIT) == 0, supervisor.describe()
    assert not alive(child)
