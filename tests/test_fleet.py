"""A fleet of worker processes: fencing of a paused worker, queue limits that hold across processes,
cancellation, timeouts, poison workflows, child workflows across a crash, the worker registry and the
``--processes`` supervisor.

Every worker is a separate ``python -m pgflow worker tests.apps.fleet:app`` process (see
tests/apps/fleet.py); crashes are real SIGKILLs and pauses real SIGSTOPs. The test process starts
workflows through its own App on the same schema and reads the outcome from the tables.

Synchronisation is on events: a line in a side-effect file, a row in a table, a line in a worker's log,
each awaited with a generous bounded deadline. Nothing here asserts that something happened fast; the
few time figures are lower bounds (the rate limit) or printed measurements.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest

import pgflow

from .apps import fleet
from .helpers import KINDS, ONE_SERVER, query_sync, registered, registered_pids
from .processes import (
    FLEET,
    LEASE,
    WAIT,
    Proc,
    Processes,
    failure_of,
    fleet_worker,
    is_gone,
    lines,
    result_of,
    wait_until,
)

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


# -- processes ------------------------------------------------------------------------------------------


def workflow_row(dsn: str, schema: str, id: str) -> tuple[str, int, str | None]:
    [row] = query_sync(dsn, f'SELECT status, attempt, lease_owner FROM "{schema}".workflows WHERE id = %s', (id,))
    return row[0], row[1], row[2]


def step_attempts(dsn: str, schema: str, id: str) -> list[tuple[int, int]]:
    """(position, attempt of the execution that recorded it) of each step row, in order."""
    return [(p, a) for p, a in query_sync(
        dsn, f'SELECT position, attempt FROM "{schema}".steps WHERE workflow_id = %s ORDER BY position', (id,))]


def owner_pid(lease_owner: str | None) -> int | None:
    """The pid in a lease owner (a worker id: ``host:pid:random``)."""
    return None if lease_owner is None else int(lease_owner.split(":")[-2])


# -- 1. a worker paused past its lease is fenced out ----------------------------------------------------


@pytest.mark.parametrize("where", ["step", "stream", "finish"])
def test_sigstopped_worker_resumed_after_a_takeover_cannot_record_anything(
    app: pgflow.App, dsn: str, schema: str, worker_env: dict[str, str], procs: Processes, tmp_path: Path,
    where: str,
) -> None:
    """Worker A is frozen (SIGSTOP) holding the workflow, B takes it over once A's lease ran out, and
    then A thaws and goes on while B still holds the workflow: A's next write (a step record, a stream
    chunk or the completion, per ``where``) must be refused by its attempt, not by the status."""
    flows = fleet.build(app)
    effects, gates = tmp_path / "effects.txt", tmp_path / "gates"
    gates.mkdir()

    a = fleet_worker(procs, "worker-A", worker_env)
    handle = flows.zombie.start(str(effects), str(gates), where)
    wait_until(lambda: f"start {a.pid}" in lines(effects), "worker A to reach the gate", procs, a)
    assert workflow_row(dsn, schema, handle.id)[:2] == ("running", 1)

    a.signal(signal.SIGSTOP)
    frozen_at = time.monotonic()
    b = fleet_worker(procs, "worker-B", worker_env)
    wait_until(lambda: f"start {b.pid}" in lines(effects), "worker B to take the workflow over", procs, b)
    takeover = time.monotonic() - frozen_at
    status, attempt, owner = workflow_row(dsn, schema, handle.id)
    assert (status, attempt, owner_pid(owner)) == ("running", 2, b.pid)

    # A thaws with its own gate open, so it goes on to its next write while B is still held at its gate.
    (gates / f"open-{a.pid}").touch()
    a.signal(signal.SIGCONT)
    wait_until(lambda: "lost its lease" in a.output(), "worker A to notice it lost the workflow", procs, a)
    status, attempt, owner = workflow_row(dsn, schema, handle.id)
    assert (status, attempt, owner_pid(owner)) == ("running", 2, b.pid), procs.logs()
    # A's refused write left nothing behind: only step 0, recorded by A before it froze.
    assert step_attempts(dsn, schema, handle.id) == [(0, 1)]
    assert query_sync(dsn, f'SELECT count(*) FROM "{schema}".streams WHERE workflow_id = %s', (handle.id,)) == [(0,)]

    (gates / f"open-{b.pid}").touch()
    assert result_of(handle, procs) == b.pid
    assert handle.status() == "succeeded"
    # Step 0 was replayed by B, not run again; everything after the takeover is B's attempt's.
    assert step_attempts(dsn, schema, handle.id) == ([(0, 1), (1, 2)] if where == "step" else [(0, 1)])
    if where == "stream":
        assert list(handle.stream("pids")) == [b.pid]
    assert [line for line in lines(effects) if line.startswith("stamp")] == [f"stamp {a.pid}"]
    # Both went past their gates; only B's writes count.
    assert f"done {a.pid}" in lines(effects) and f"done {b.pid}" in lines(effects)
    # Losing a workflow is not a crash: A still runs, and stops cleanly when asked.
    assert a.alive(), procs.logs()
    a.signal(signal.SIGTERM)
    assert a.wait_exit() == 0, procs.logs()
    print(f"\n[fleet] takeover of a SIGSTOPped worker's workflow ({where}, lease {LEASE}s): {takeover:.2f}s")


# -- 2. a concurrency limit held across processes -------------------------------------------------------


def test_queue_concurrency_limit_holds_across_four_worker_processes(
    app: pgflow.App, dsn: str, schema: str, worker_env: dict[str, str], procs: Processes,
) -> None:
    flows = fleet.build(app)
    app.migrate()
    query_sync(dsn, f'CREATE TABLE "{schema}".probe (tag text PRIMARY KEY, pid int NOT NULL,'
               ' started timestamptz NOT NULL, ended timestamptz, seen int)')
    # One slot per process: without a global limit the four could run four at once, and reaching the
    # limit of two at all takes two processes, so the test can tell a global limit from a local one.
    workers = [fleet_worker(procs, f"worker-{i}", worker_env, queues=fleet.LIMITED, concurrency=1) for i in range(4)]
    wait_until(lambda: registered_pids(dsn, schema) == {w.pid for w in workers}, "4 workers to register",
               procs, *workers)
    assert query_sync(dsn, f'SELECT concurrency, rate_limit FROM "{schema}".queues WHERE name = %s',
                 (fleet.LIMITED,)) == [(fleet.LIMITED_CONCURRENCY, None)]

    handles = [flows.limited.start(f"job-{i}", 0.3) for i in range(20)]
    seen = [result_of(h, procs) for h in handles]

    rows = query_sync(dsn, f'SELECT pid, started, ended, seen FROM "{schema}".probe')
    assert len(rows) == 20
    # The most probes in flight at once, from the recorded intervals (an end before a start at a tie).
    events = sorted([(r[1], 1) for r in rows] + [(r[2], -1) for r in rows], key=lambda e: (e[0], e[1]))
    in_flight = peak = 0
    for _, delta in events:
        in_flight += delta
        peak = max(peak, in_flight)
    assert peak <= fleet.LIMITED_CONCURRENCY, rows
    assert max(seen) <= fleet.LIMITED_CONCURRENCY
    # The limit is global: more than one process ran these, and together they stayed within it.
    pids = {r[0] for r in rows}
    assert pids <= {w.pid for w in workers}
    assert len(pids) > 1, f"all 20 ran in one process {pids}; the test cannot tell a global limit\n{procs.logs()}"
    print(f"\n[fleet] concurrency limit 2 across 4 processes: peak {peak}, processes used {len(pids)}")


# -- 3. a rate limit held across processes ---------------------------------------------------------------


def test_queue_rate_limit_paces_starts_across_worker_processes(
    app: pgflow.App, dsn: str, schema: str, worker_env: dict[str, str], procs: Processes,
) -> None:
    flows = fleet.build(app)
    workers = [fleet_worker(procs, f"worker-{i}", worker_env, queues=fleet.PACED, concurrency=8) for i in range(3)]
    app.migrate()
    wait_until(lambda: registered_pids(dsn, schema) == {w.pid for w in workers}, "3 workers to register",
               procs, *workers)

    handles = [flows.paced.start(i) for i in range(15)]
    pids = [result_of(h, procs) for h in handles]
    starts = [row[0] for row in query_sync(
        dsn, f'SELECT started_at FROM "{schema}".workflows WHERE queue = %s ORDER BY started_at', (fleet.PACED,))]
    assert len(starts) == 15
    offsets = [(s - starts[0]).total_seconds() for s in starts]
    # A token bucket of 5, full at the first start and refilled at 5 per second: by t seconds after the
    # first start at most 5 + 5t have started, so the k-th start (from 0) comes at least (k - 4) / 5 s
    # after the first. Lower bounds only (a loaded machine may start them later, never earlier).
    per_token = fleet.PACED_PER / fleet.PACED_RATE
    for k, offset in enumerate(offsets):
        assert offset >= (k + 1 - fleet.PACED_RATE) * per_token - 0.05, (k, offsets)
    assert offsets[-1] >= 1.6, offsets
    print(f"\n[fleet] 15 starts at 5/s over {len(set(pids))} processes took {offsets[-1]:.2f}s "
          f"(bucket minimum 2.0s)")


# -- 5. cancellation -------------------------------------------------------------------------------------


def test_cancelled_queued_workflow_never_starts(
    app: pgflow.App, dsn: str, schema: str, worker_env: dict[str, str], procs: Processes, tmp_path: Path,
) -> None:
    flows = fleet.build(app)
    effects = tmp_path / "effects.txt"
    handle = flows.beats["async"].start(str(effects), 3)
    handle.cancel()
    assert handle.status() == "cancelled"

    fleet_worker(procs, "worker", worker_env)
    # The worker serves the queue: a workflow started after the cancelled one runs to its end.
    assert result_of(flows.ping.start(1), procs) == 2
    with pytest.raises(pgflow.WorkflowCancelled):
        handle.result(timeout=WAIT)
    assert handle.status() == "cancelled"
    assert handle.steps() == []
    assert lines(effects) == []
    assert query_sync(dsn, f'SELECT attempt, started_at FROM "{schema}".workflows WHERE id = %s',
                 (handle.id,)) == [(0, None)]


@pytest.mark.parametrize("kind", KINDS)
def test_cancelled_running_workflow_stops_at_its_next_step(
    app: pgflow.App, dsn: str, schema: str, worker_env: dict[str, str], procs: Processes, tmp_path: Path,
    kind: str,
) -> None:
    flows = fleet.build(app)
    effects = tmp_path / "effects.txt"
    w = fleet_worker(procs, "worker", worker_env)
    handle = flows.beats[kind].start(str(effects), 100_000)
    wait_until(lambda: len(handle.steps()) >= 3, "three steps to be recorded", procs, w)

    handle.cancel()
    with pytest.raises(pgflow.WorkflowCancelled):
        handle.result(timeout=WAIT)
    assert handle.status() == "cancelled"
    recorded = len(handle.steps())
    # The worker goes on serving (a workflow started now runs to its end) and the cancelled one made
    # no more progress meanwhile: no further step ran, none was recorded.
    assert result_of(flows.ping.start(1), procs) == 2
    steps = handle.steps()
    assert len(steps) == recorded < 100_000
    assert [s.position for s in steps] == list(range(recorded))
    # The step that ran when the cancel came was recorded, and no step ran after it.
    assert lines(effects) == [f"beat {i}" for i in range(recorded)]
    assert w.alive()


# -- 6. timeouts -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_workflow_past_its_timeout_fails_with_workflow_timeout(
    app: pgflow.App, worker_env: dict[str, str], procs: Processes, tmp_path: Path, kind: str,
) -> None:
    flows = fleet.build(app)
    effects, gate = tmp_path / "effects.txt", tmp_path / "gate"
    w = fleet_worker(procs, "worker", worker_env)
    handle = flows.slow[kind].start(str(effects), str(gate))
    try:
        failure = failure_of(handle, procs)
        assert failure.error_type == "pgflow.errors.WorkflowTimeout"
        assert "timeout of 1.0s" in failure.message
        assert handle.status() == "failed"
        # It was cut short inside its step, which therefore never finished nor was recorded.
        assert lines(effects) == [f"held start {w.pid}"]
        assert handle.steps() == []
    finally:
        gate.touch()  # lets an abandoned step thread end
    assert result_of(flows.ping.start(1), procs) == 2
    assert handle.status() == "failed"
    assert handle.steps() == []


def test_timeout_deadline_is_fixed_at_first_start_and_survives_a_crash(
    app: pgflow.App, dsn: str, schema: str, worker_env: dict[str, str], procs: Processes, tmp_path: Path,
) -> None:
    flows = fleet.build(app)
    effects, gate = tmp_path / "effects.txt", tmp_path / "gate"
    a = fleet_worker(procs, "worker-A", worker_env)
    handle = flows.deadline_flow.start(str(effects), str(gate))
    wait_until(lambda: f"held start {a.pid}" in lines(effects), "the step to start in worker A", procs, a)
    a.kill()
    # A died before the deadline: the workflow is still claimed by it.
    assert workflow_row(dsn, schema, handle.id)[:2] == ("running", 1), procs.logs()
    wait_until(lambda: query_sync(dsn, f'SELECT deadline_at < now() FROM "{schema}".workflows WHERE id = %s',
                             (handle.id,)) == [(True,)], "the deadline to pass", procs)

    gate.touch()  # the step could finish at once now: only the deadline can stop B from running it
    b = fleet_worker(procs, "worker-B", worker_env)
    failure = failure_of(handle, procs)
    assert failure.error_type == "pgflow.errors.WorkflowTimeout"
    assert "ran out of time" in failure.message
    # B claimed it past its deadline and failed it without running the step again.
    assert workflow_row(dsn, schema, handle.id)[:2] == ("failed", 2)
    assert lines(effects) == [f"held start {a.pid}"]
    assert handle.steps() == []
    assert b.alive()


# -- 7. poison workflows ---------------------------------------------------------------------------------


def test_workflow_whose_worker_dies_max_attempts_times_is_failed_without_running_again(
    app: pgflow.App, dsn: str, schema: str, worker_env: dict[str, str], procs: Processes, tmp_path: Path,
) -> None:
    flows = fleet.build(app)
    effects, gate = tmp_path / "effects.txt", tmp_path / "gate"
    handle = flows.poison.start(str(effects), str(gate))
    for attempt, name in enumerate(["worker-A", "worker-B"], start=1):
        w = fleet_worker(procs, name, worker_env)
        wait_until(lambda w=w: f"held start {w.pid}" in lines(effects), f"the step to start in {name}", procs, w)
        assert workflow_row(dsn, schema, handle.id)[:2] == ("running", attempt)
        w.kill()

    gate.touch()  # the step could finish at once now: only max_attempts can stop C from running it
    fleet_worker(procs, "worker-C", worker_env)
    failure = failure_of(handle, procs)
    assert failure.error_type == "pgflow.errors.MaxAttemptsExceeded"
    assert "its worker process died 2 times while running it alone" in failure.message
    assert workflow_row(dsn, schema, handle.id)[:2] == ("failed", 3)
    assert [line.split()[:2] for line in lines(effects)] == [["held", "start"]] * 2
    assert handle.steps() == []


# -- 8. child workflows across a crash of the parent's worker ------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_parent_resumed_after_a_crash_finds_its_children_instead_of_starting_new_ones(
    app: pgflow.App, dsn: str, schema: str, worker_env: dict[str, str], procs: Processes, tmp_path: Path,
    kind: str,
) -> None:
    flows = fleet.build(app)
    effects, gate = tmp_path / "effects.txt", tmp_path / "gate"
    a = fleet_worker(procs, "worker-A", worker_env, concurrency=8)
    parent = flows.parent[kind].start(str(effects), str(gate), 3)

    def waiting() -> bool:
        seen = lines(effects)
        return f"parent waiting {a.pid}" in seen and all(f"child {i} waiting {a.pid}" in seen for i in range(3))

    wait_until(waiting, "the parent to wait on 3 blocked children in worker A", procs, a)
    a.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    assert a.wait_exit() == -signal.SIGKILL

    b = fleet_worker(procs, "worker-B", worker_env, concurrency=8)
    wait_until(lambda: f"parent waiting {b.pid}" in lines(effects), "worker B to resume the parent", procs, b)
    resumed = time.monotonic() - killed_at
    gate.touch()
    assert result_of(parent, procs) == 0 + 10 + 20

    children = query_sync(dsn, f'SELECT id, name, status, attempt FROM "{schema}".workflows WHERE id <> %s'
                          ' ORDER BY id', (parent.id,))
    assert [(c[0], c[1], c[2]) for c in children] == [
        (f"{parent.id}.{i}", flows.child.name, "succeeded") for i in range(3)]
    # Every child was taken over from the dead worker (attempt 2), and its step ran once, in B.
    assert [c[3] for c in children] == [2, 2, 2]
    ran = sorted(line for line in lines(effects) if " ran " in line)
    assert ran == [f"child {i} ran {b.pid}" for i in range(3)]
    for i in range(3):
        assert app.handle(f"{parent.id}.{i}").result(timeout=WAIT) == i * 10
    print(f"\n[fleet] parent ({kind}) resumed {resumed:.2f}s after SIGKILL (lease {LEASE}s, incl. process start)")


# -- 9. the worker registry ------------------------------------------------------------------------------


def test_worker_registers_itself_and_unregisters_on_a_graceful_stop(
    app: pgflow.App, dsn: str, schema: str, worker_env: dict[str, str], procs: Processes,
) -> None:
    app.migrate()
    w = fleet_worker(procs, "worker", worker_env, queues="default,other")
    [row] = wait_until(lambda: [r for r in registered(dsn, schema) if r[2] == w.pid], "the worker to register",
                       procs, w)
    id, host, pid, queues, version = row
    assert (host, pid, queues, version) == (socket.gethostname(), w.pid, ["default", "other"],
                                            pgflow.__version__)
    assert id.startswith(f"{host}:{w.pid}:")
    w.signal(signal.SIGTERM)
    assert w.wait_exit() == 0, procs.logs()
    assert registered(dsn, schema) == []


def test_killed_workers_row_is_forgotten_by_a_live_workers_heartbeat_once_stale(
    app: pgflow.App, dsn: str, schema: str, worker_env: dict[str, str], procs: Processes,
) -> None:
    """A SIGKILLed worker cannot unregister; the others forget it once it has been silent for
    max(60 s, 10 leases). Waiting a minute in real time is too slow for the suite, so the test ages the
    dead worker's last heartbeat in the table instead: what it checks is that a live worker's heartbeat
    removes a stale row, and only that one."""
    app.migrate()
    dead = fleet_worker(procs, "worker-dead", worker_env)
    live = fleet_worker(procs, "worker-live", worker_env)
    wait_until(lambda: registered_pids(dsn, schema) == {dead.pid, live.pid}, "both workers to register",
               procs, dead, live)
    dead.kill()
    # Both rows still there: a dead worker's row stays until it is stale.
    assert registered_pids(dsn, schema) == {dead.pid, live.pid}
    query_sync(dsn, f'UPDATE "{schema}".workers SET heartbeat_at = heartbeat_at - interval \'61 seconds\''
               ' WHERE pid = %s RETURNING 1', (dead.pid,))
    wait_until(lambda: registered_pids(dsn, schema) == {live.pid}, "the live worker to forget the dead one",
               procs, live)


def test_live_worker_silent_past_the_forget_bound_is_registered_again(
    app: pgflow.App, dsn: str, schema: str, worker_env: dict[str, str], procs: Processes,
) -> None:
    """As if the worker could not reach the database for over a minute: its row is as old as that when
    its heartbeats get through again. A live worker must then be in the registry again."""
    app.migrate()
    w = fleet_worker(procs, "worker", worker_env)
    wait_until(lambda: registered_pids(dsn, schema) == {w.pid}, "the worker to register", procs, w)
    query_sync(dsn, f'UPDATE "{schema}".workers SET heartbeat_at = heartbeat_at - interval \'61 seconds\'')

    def after_a_heartbeat() -> list[tuple[Any, ...]] | bool:
        """Its row refreshed by a heartbeat (a list), or gone (True)."""
        rows = query_sync(dsn, f'SELECT pid FROM "{schema}".workers WHERE heartbeat_at > now() - interval \'30 s\'')
        return rows or not query_sync(dsn, f'SELECT 1 FROM "{schema}".workers')

    wait_until(after_a_heartbeat, "the worker's next heartbeat", procs, w)
    # A heartbeat every lease/3: 10 s are 15 chances to come back.
    deadline = time.monotonic() + 10.0
    while registered_pids(dsn, schema) != {w.pid} and time.monotonic() < deadline:
        time.sleep(0.1)
    assert w.alive(), procs.logs()
    assert registered_pids(dsn, schema) == {w.pid}, "a live worker is missing from the registry"


# -- 10. the supervisor ----------------------------------------------------------------------------------


def parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def children_of(pid: int) -> set[int]:
    return {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and parent_of(int(p.name)) == pid}


def serves_fleet(pid: int) -> bool:
    try:
        return FLEET in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def supervised(dsn: str, schema: str, supervisor: Proc, seen: set[int], n: int,
               exclude: frozenset[int] = frozenset()) -> set[int] | None:
    """The registered workers the supervisor started, but those in ``exclude``, once there are ``n`` of
    them (None until then). Each one found is added to ``seen``, for ``stop_supervisor``."""
    pids = {p for p in registered_pids(dsn, schema) if p not in exclude and parent_of(p) == supervisor.pid}
    seen.update(pids)
    return pids if len(pids) == n else None


def stop_supervisor(supervisor: Proc, children: set[int]) -> None:
    """Kill a supervisor and its worker processes (``children``: those the test saw, and any it has now).
    The children live in sessions of their own, so killing the supervisor would orphan them, and killing
    them first would have it start new ones: freeze it, kill its children, then it."""
    if supervisor.alive():
        supervisor.signal(signal.SIGSTOP)
        children = children | children_of(supervisor.pid)
    for pid in children:
        if serves_fleet(pid):
            os.kill(pid, signal.SIGKILL)
    supervisor.stop()


@ONE_SERVER  # the supervisor's restarts and signals are its process's matter: the same on any server
def test_supervisor_runs_two_worker_processes_restarts_a_killed_one_and_stops_them_all(
    app: pgflow.App, dsn: str, schema: str, worker_env: dict[str, str], procs: Processes, tmp_path: Path,
) -> None:
    flows = fleet.build(app)
    app.migrate()
    effects = tmp_path / "effects.txt"
    supervisor = fleet_worker(procs, "supervisor", worker_env, extra=["--processes", "2"])
    children: set[int] = set()  # every child pid seen, killed in the finally if one outlives the test

    def run_on_both(gate: Path) -> set[int]:
        """Eight workflows held in their step at once: with 4 slots a process, both must run some."""
        before = len(lines(effects))
        handles = [flows.hold.start(str(effects), str(gate)) for _ in range(8)]
        wait_until(lambda: len(lines(effects)) - before >= 8, "8 held steps to start", procs, supervisor)
        gate.touch()
        return {result_of(h, procs) for h in handles}

    try:
        first = wait_until(lambda: supervised(dsn, schema, supervisor, children, 2), "2 worker processes to register",
                           procs, supervisor)
        assert supervisor.pid not in first
        assert run_on_both(tmp_path / "gate-1") == first

        victim, survivor = sorted(first)
        os.kill(victim, signal.SIGKILL)
        [replacement] = wait_until(lambda: supervised(dsn, schema, supervisor, children, 1, exclude=frozenset(first)),
                                   "the supervisor to restart a worker", procs, supervisor)
        assert not is_gone(survivor)
        assert run_on_both(tmp_path / "gate-2") == {survivor, replacement}

        supervisor.signal(signal.SIGTERM)
        assert supervisor.wait_exit() == 0, procs.logs()
        assert is_gone(survivor) and is_gone(replacement)
        # The two stopped gracefully and unregistered; only the killed one's row is left, until stale.
        assert registered_pids(dsn, schema) == {victim}
    finally:
        stop_supervisor(supervisor, children)


@ONE_SERVER  # the supervisor's restarts and signals are its process's matter: the same on any server
def test_a_child_killed_by_a_signal_while_the_supervisor_stops_makes_its_exit_code_non_zero(
    app: pgflow.App, dsn: str, schema: str, worker_env: dict[str, str], procs: Processes, tmp_path: Path,
) -> None:
    """A signal death is a negative returncode, which ranked below a clean 0 in the worst-of: the
    supervisor reported a clean stop when one of its workers had been killed mid-drain."""
    flows = fleet.build(app)
    app.migrate()
    effects, gate = tmp_path / "effects.txt", tmp_path / "gate"
    # A long grace, so the child holding a step is still draining when the test kills it.
    supervisor = fleet_worker(procs, "supervisor", worker_env, grace=60.0, extra=["--processes", "2"])
    children: set[int] = set()
    try:
        wait_until(lambda: supervised(dsn, schema, supervisor, children, 2), "2 worker processes to register",
                   procs, supervisor)
        flows.hold.start(str(effects), str(gate))
        [holder] = wait_until(lambda: [int(line.split()[-1]) for line in lines(effects) if "held start" in line],
                              "the held step to start", procs, supervisor)

        supervisor.signal(signal.SIGTERM)
        # Both children log that they drain once the supervisor has passed the signal on: past that
        # it restarts nothing, and the idle child exits 0 while the holder waits out its step.
        wait_until(lambda: supervisor.output().count("received SIGTERM: draining") == 2,
                   "both children to start draining", procs, supervisor)
        assert not is_gone(holder)
        os.kill(holder, signal.SIGKILL)
        assert supervisor.wait_exit() == 128 + signal.SIGKILL, procs.logs()
        assert all(is_gone(pid) for pid in children)  # the supervisor waited for the other one
    finally:
        gate.touch()
        stop_supervisor(supervisor, children)
