"""Crash attribution, across real worker processes killed by a real crash.

A workflow whose step kills its own worker process (SIGKILL from inside the step) takes down every
workflow that process was running. Those become suspects: each is run again alone, and only a crash of
a run that was alone is charged. The innocent neighbours of a crash never lose an attempt, and the
poison workflow is given up within its limit, in bounded time, with an error that says what it did.

The workers are one ``pgflow worker --processes N`` supervisor, which restarts a worker process that
died (as systemd or Kubernetes would), so the test does nothing but start workflows and wait.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import pgflow
from pgflow._core.engine import Claimed, Engine

from .apps import suspects
from .helpers import query
from .processes import LEASE, Proc, Processes, failure_of, is_gone, lines, result_of, wait_until

SUSPECTS = "tests.apps.suspects:app"
RESTARTS = ["--restart-delay", "0.1", "--restart-delay-max", "0.2"]
BOUND = 60.0  # seconds: what a poison workflow may take to be given up, from its start


@contextlib.contextmanager
def fleet(procs: Processes, env: dict[str, str], processes: int, lease: float = LEASE,
          concurrency: int = 8) -> Iterator[Proc]:
    """A supervised fleet of ``processes`` worker processes serving tests/apps/suspects.py, stopped
    with SIGTERM at the end, which the supervisor passes on to its workers (a SIGKILL would leave them
    running, orphaned)."""
    supervisor = procs.worker("fleet", SUSPECTS, env, concurrency=concurrency, lease=lease, grace=0.0,
                              extra=["--processes", str(processes), *RESTARTS])
    try:
        yield supervisor
    finally:
        if supervisor.alive():
            supervisor.signal(signal.SIGTERM)
            supervisor.wait_exit()


@pytest.mark.slow
def test_a_poison_workflow_is_given_up_alone_and_none_of_its_twenty_neighbours_loses_an_attempt(
    app: pgflow.App, worker_env: dict[str, str], procs: Processes, tmp_path: Path,
) -> None:
    wf = suspects.build(app)
    effects, release = tmp_path / "effects.txt", tmp_path / "release"
    with fleet(procs, worker_env, processes=3):
        # 20 innocents in 3 processes of 8 slots: at least 4 in each, all running until released.
        innocents = [wf.innocent.start(str(effects), f"i{n}", str(release)) for n in range(20)]
        wait_until(lambda: len([line for line in lines(effects) if " start " in line]) >= 20,
                   "the 20 innocent workflows to run", procs)
        began = time.monotonic()
        poison = wf.poison.start(str(effects), 0.5)  # claimed beside innocents, killing their worker 0.5 s in
        first = wait_until(lambda: [line for line in lines(effects) if line.startswith("poison start")],
                           "the poison workflow to run", procs)[0]
        wait_until(lambda: is_gone(int(first.split()[2])), "the poison's first worker process to die", procs)
        release.touch()  # its neighbours there died with it; those elsewhere may end now
        failure = failure_of(poison, procs)
        failed_after = time.monotonic() - began
        results = [result_of(handle, procs) for handle in innocents]

    assert failure.error_type == "pgflow.errors.MaxAttemptsExceeded", failure
    assert f"its worker process died {suspects.LIMIT} times while running it alone" in failure.message
    # Its first crash was beside others: not charged. Then LIMIT crashes alone, each charged.
    runs = [line for line in lines(effects) if line.startswith("poison start")]
    assert len(runs) == suspects.LIMIT + 1, lines(effects)
    assert [int(line.split()[3]) for line in runs] == list(range(1, len(runs) + 1))  # each try counted once
    details = app.workflow_details(poison.id)
    assert (details.status, details.attempt, details.max_attempts) == ("failed", suspects.LIMIT, suspects.LIMIT)
    assert [(s.position, s.attempts) for s in details.in_progress] == [(0, len(runs))]
    assert failed_after < BOUND, f"the poison workflow took {failed_after:.1f}s to be given up"

    # Every innocent workflow succeeded on its first attempt; those its worker died under were run
    # again, and their step's try cut short is counted.
    by_name = {f"i{n}": result for n, result in enumerate(results)}
    tries = {name: len([line for line in lines(effects) if line.startswith(f"{name} start ")]) for name in by_name}
    killed = {name for name, n in tries.items() if n > 1}
    assert killed, "the poison workflow killed no neighbour: it did not run beside them"
    for name, (attempt, step_attempt) in by_name.items():
        assert attempt == 1, (name, by_name)
        assert step_attempt == tries[name], (name, tries)
    for handle, name in zip(innocents, by_name, strict=True):
        details = app.workflow_details(handle.id)
        assert (details.status, details.attempt) == ("succeeded", 1)
        assert [s.attempts for s in details.steps] == [tries[name]]
    print(f"\n[crash attribution] poison given up {failed_after:.1f}s after its start;"
          f" {len(killed)} innocent workflows were cut short by its first crash and all succeeded")


@pytest.mark.slow
@pytest.mark.chaos  # half a minute a server, waiting out default leases: make chaos runs it
def test_a_poison_workflow_is_given_up_within_a_minute_with_the_default_lease_and_attempts(
    app: pgflow.App, worker_env: dict[str, str], procs: Processes, tmp_path: Path,
) -> None:
    """The worker's default lease (10 s) and the workflow's default max_attempts (20): the crash loop
    ends after a few crashes alone, not 20 (it took 217 s before)."""
    wf = suspects.build(app)
    effects = tmp_path / "effects.txt"
    with fleet(procs, worker_env, processes=2, lease=10.0):
        began = time.monotonic()
        poison = wf.poison_by_default.start(str(effects), 0.2)
        failure = failure_of(poison, procs, timeout=120.0)
        failed_after = time.monotonic() - began
    assert failure.error_type == "pgflow.errors.MaxAttemptsExceeded", failure
    assert "its worker process died 3 times while running it alone" in failure.message
    details = app.workflow_details(poison.id)
    assert (details.attempt, details.max_attempts) == (3, 20)
    print(f"\n[crash attribution] with the defaults, poison given up {failed_after:.1f}s after its start")
    assert failed_after < BOUND, f"the poison workflow took {failed_after:.1f}s to be given up"


# -- the rules, claim by claim ---------------------------------------------------------------------------


async def _expire(dsn: str, schema: str, *ids: str, ago: str = "1 s") -> None:
    """Their leases ran out ``ago`` (the claims that follow are full ones, which rescue them)."""
    await query(dsn, f'UPDATE "{schema}".workflows SET lease_expires_at = now() - %s::interval'
                     ' WHERE id = ANY(%s)', ago, list(ids))


async def _full_claim(store: Engine, worker: str, names: list[str]) -> list[Claimed]:
    store.claims._full_claim_at.clear()  # noqa: SLF001 - a full claim now, not in a second
    claimed, _ = await store.claims.claim(worker, ["default"], names, 8, LEASE)
    return claimed


async def _died_with_three(app: pgflow.App, wf: pgflow.Workflow[[], Any], dsn: str,
                           schema: str) -> tuple[Engine, list[str], list[str]]:
    """Worker A claimed three runs of ``wf`` and died (its heartbeat an hour old; their leases as they
    were): the store, the names a worker serves, the runs' ids."""
    await app.migrate_async()
    store = await app._client.runtime().store()  # noqa: SLF001 - the claims, as a worker makes them
    names = [wf.name]
    await store.workers.register_worker("A", socket.gethostname(), os.getpid(), ["default"], "test", names, LEASE)
    ids = [(await wf.start_async()).id for _ in range(3)]
    assert len(await _full_claim(store, "A", names)) == 3
    await query(dsn, f'UPDATE "{schema}".workers SET heartbeat_at = now() - interval \'1 hour\' WHERE id = \'A\'')
    return store, names, ids


@pytest.mark.anyio
async def test_who_is_charged_for_a_crash(app: pgflow.App, dsn: str, schema: str) -> None:
    """Beside others: nobody, each a suspect run alone with its attempt kept. Alone: the one it ran.
    A worker that lives on and let a lease go: no suspect, charged as a lost lease always was."""

    @app.workflow(name="rules.w", max_attempts=5)
    async def w() -> None:
        pass

    # A dies with the three: its heartbeat stops, their leases run out.
    store, names, ids = await _died_with_three(app, w, dsn, schema)
    await _expire(dsn, schema, *ids)
    assert await _full_claim(store, "B", names) == []  # rescued as suspects, none run beside others
    rows = await query(dsn, f'SELECT status, crashes, uncounted, attempt - attempt_base FROM "{schema}".workflows'
                            ' WHERE id = ANY(%s)', ids)
    assert sorted(rows) == [("queued", 0, True, 1)] * 3
    suspect = await store.claims.claim_suspect("B", ["default"], names, LEASE)
    assert suspect is not None and suspect.suspect and (suspect.run, suspect.crashes) == (1, 0)
    assert await store.claims.claim_suspect("B2", ["default"], ["nothing.of.these"], LEASE) is None
    # B, running it alone (B never registered: no heartbeat at all), dies too: charged.
    await _expire(dsn, schema, suspect.id)
    assert await _full_claim(store, "C", names) == []
    assert await query(dsn, f'SELECT status, crashes, uncounted, attempt - attempt_base FROM "{schema}".workflows'
                            ' WHERE id = %s', suspect.id) == [("queued", 1, False, 1)]
    # (the two others, suspects still, are claimed first: they were due before)
    for _ in range(2):
        other_suspect = await store.claims.claim_suspect("C", ["default"], names, LEASE)
        assert other_suspect is not None and other_suspect.id != suspect.id
    again = await store.claims.claim_suspect("C", ["default"], names, LEASE)
    assert again is not None and again.id == suspect.id
    assert (again.run, again.crashes, again.give_up) == (2, 1, False)
    # A worker that lives on and let a lease go: no suspect; its next run is a new attempt. (Heard from
    # within its lease, it may be alive: its run is left until the lease ran out a lease ago.)
    await store.workers.register_worker("D", socket.gethostname(), os.getpid(), ["default"], "test", names, LEASE)
    other = await w.start_async()
    [held] = [c for c in await _full_claim(store, "D", names) if c.id == other.id]
    await _expire(dsn, schema, other.id)
    assert other.id not in [c.id for c in await _full_claim(store, "E", names)]
    assert await query(dsn, f'SELECT status FROM "{schema}".workflows WHERE id = %s', other.id) == [("running",)]
    await _expire(dsn, schema, other.id, ago="1 hour")
    await _full_claim(store, "E", names)
    [taken] = [c for c in await _full_claim(store, "E", names) if c.id == other.id]
    assert (taken.suspect, taken.run) == (False, 2) and held.run == 1

    # A worker whose heartbeat came after it claimed a run it had not taken on yet (a heartbeat renews
    # only the runs the worker holds), and which then died: judged by its silence, it is dead, and the
    # run, alone on it, is a suspect charged with the crash (it was taken for a lost lease).
    await store.workers.register_worker("F", socket.gethostname(), os.getpid(), ["default"], "test", names, LEASE)
    late = await w.start_async()
    [claimed_late] = [c for c in await _full_claim(store, "F", names) if c.id == late.id]
    await query(dsn, f'UPDATE "{schema}".workflows SET lease_expires_at = now() - %s::interval WHERE id = %s',
                f"{LEASE + 1} s", late.id)
    await query(dsn, f'UPDATE "{schema}".workers SET heartbeat_at = now() - %s::interval WHERE id = \'F\'',
                f"{LEASE + 0.5} s")  # after the claim (lease set LEASE before expiry), and a lease ago
    assert late.id not in [c.id for c in await _full_claim(store, "G", names)]
    assert await query(dsn, f'SELECT status, crashes FROM "{schema}".workflows WHERE id = %s', late.id) \
        == [("queued", 1)] and claimed_late.run == 1


@pytest.mark.anyio
async def test_a_dead_workers_runs_are_rescued_together_whatever_their_leases(
        app: pgflow.App, dsn: str, schema: str) -> None:
    """A worker died with three runs, one claimed after its last heartbeat (its lease runs out later).
    The first claim after the first lease ran out rescues all three, beside each other: none is charged.
    (Rescued one by one, the last looked alone and was charged with a crash it only shared: the poison
    test above failed so, one run in three.)"""

    @app.workflow(name="rules.crew", max_attempts=5)
    async def crew() -> None:
        pass

    store, names, ids = await _died_with_three(app, crew, dsn, schema)
    await _expire(dsn, schema, *ids[:2])  # the third's lease runs on: it was claimed last
    await query(dsn, f'UPDATE "{schema}".workflows SET lease_expires_at = now() + interval \'1 hour\''
                     ' WHERE id = %s', ids[2])
    assert await _full_claim(store, "B", names) == []  # rescued as suspects, none run beside others
    rows = await query(dsn, f'SELECT id, status, crashes, uncounted FROM "{schema}".workflows WHERE id = ANY(%s)',
                       ids)
    assert sorted(rows) == sorted((i, "queued", 0, True) for i in ids)
