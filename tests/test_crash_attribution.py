"""Crash attribution, across real worker processes killed by a real crash.

A workflow whose step kills its own worker process (SIGKILL from inside the step) takes down every
workflow that process was running. Those become suspects: each is run again alone, and only a crash of
a run that was alone is charged. The innocent neighbours of a crash never lose an attempt, and the
poison workflow is given up within its limit, in bounded time, with an error that says what it did.

The workers are one ``pgflow worker --processes N`` supervisor, which restarts a worker process that
died (as systemd or Kubernetes would), so the test does nothing but start workflows and wait.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import pgflow

from .apps import suspects
from .processes import LEASE, Processes, failure_of, lines, result_of, wait_until

SUSPECTS = "tests.apps.suspects:app"
RESTARTS = ["--restart-delay", "0.1", "--restart-delay-max", "0.2"]
BOUND = 60.0  # seconds: what a poison workflow may take to be given up, from its start


def fleet(procs: Processes, env: dict[str, str], processes: int, lease: float = LEASE, concurrency: int = 8) -> None:
    """A supervised fleet of ``processes`` worker processes serving tests/apps/suspects.py."""
    procs.worker("fleet", SUSPECTS, env, concurrency=concurrency, lease=lease,
                 extra=["--processes", str(processes), *RESTARTS])


@pytest.mark.slow
def test_a_poison_workflow_is_given_up_alone_and_none_of_its_twenty_neighbours_loses_an_attempt(
    app: pgflow.App, worker_env: dict[str, str], procs: Processes, tmp_path: Path,
) -> None:
    wf = suspects.build(app)
    effects = tmp_path / "effects.txt"
    fleet(procs, worker_env, processes=3)
    innocents = [wf.innocent.start(str(effects), f"i{n}", 3.0) for n in range(20)]
    wait_until(lambda: len([line for line in lines(effects) if " start " in line]) >= 20,
               "the 20 innocent workflows to run", procs)
    began = time.monotonic()
    poison = wf.poison.start(str(effects), 0.5)  # claimed beside innocents, killing their worker 0.5 s in

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
def test_a_poison_workflow_is_given_up_within_a_minute_with_the_default_lease_and_attempts(
    app: pgflow.App, worker_env: dict[str, str], procs: Processes, tmp_path: Path,
) -> None:
    """The worker's default lease (10 s) and the workflow's default max_attempts (20): the crash loop
    ends after a few crashes alone, not 20 (it took 217 s before)."""
    wf = suspects.build(app)
    effects = tmp_path / "effects.txt"
    fleet(procs, worker_env, processes=2, lease=10.0)
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
