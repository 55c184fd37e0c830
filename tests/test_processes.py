"""Workflows across real worker processes: crashes, failures, shutdown, the CLI and concurrent migrations.

Every worker here is a separate ``python -m pgflow worker`` process serving an app module from
tests/apps/. The test process starts workflows and reads their outcome through its own App, on the same
schema. Crashes are real: a worker is killed with SIGKILL, mid-step, and another process takes over.

Synchronisation is on events, never on sleeps: steps append lines to a side-effect file the test passed
in, and the test waits (with a generous bounded deadline) for a line to appear; a step holds still until
the test creates a gate file.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import psycopg
import pytest

import pgflow
from pgflow._core.engine import migrations

from .apps import crashy, failing
from .helpers import KINDS, ONE_SERVER, query_sync
from .processes import WAIT, Proc, Processes, lines, result_of, wait_until

ROOT = Path(__file__).resolve().parent.parent
CRASHY = "tests.apps.crashy:app"
FAILING = "tests.apps.failing:app"


# -- processes ------------------------------------------------------------------------------------------


def held_in_step_2(
    app: pgflow.App, worker_env: dict[str, str], procs: Processes, tmp_path: Path, kind: str, n: int,
    **worker: Any,
) -> tuple[Any, Proc, pgflow.WorkflowHandle[Any], Path, Path]:
    """Worker A (``worker``: its options) running the crashy workflow of ``kind`` with ``n``, held in its
    gated step 2: the crashy app (tests/apps/crashy.py), worker A, the handle, the effects file, the gate."""
    wf = crashy.build(app)
    effects, gate = tmp_path / "effects.txt", tmp_path / "gate"
    a = procs.worker("worker-A", CRASHY, worker_env, **worker)
    handle = wf.flows[kind].start(str(effects), str(gate), n)
    wait_until(lambda: "s2 start" in lines(effects), "step 2 to start in worker A", procs, a)
    return wf, a, handle, effects, gate


# -- 1. a worker killed mid-workflow ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_sigkill_mid_step_resumes_in_another_process_from_the_journal(
    app: pgflow.App, dsn: str, schema: str, worker_env: dict[str, str], procs: Processes, tmp_path: Path,
    kind: str,
) -> None:
    wf, a, handle, effects, gate = held_in_step_2(app, worker_env, procs, tmp_path, kind, 4)
    # The attempt's note goes out as the step's body starts, beside it (pgflow/_core/execution.py):
    # the kill comes once it is in, so that the count below is of an attempt the record knew had begun.
    def noted() -> bool:
        return bool(query_sync(dsn, f'SELECT 1 FROM "{schema}".step_attempts WHERE workflow_id = %s AND position = 1',
                          (handle.id,)))
    wait_until(noted, "step 2's start to be noted", procs, a)

    a.kill()
    # The crash left the workflow claimed by the dead worker, with step 1 recorded and step 2 not.
    assert handle.status() == "running"
    assert [s.name for s in handle.steps()] == [wf.first.name]

    gate.touch()
    procs.worker("worker-B", CRASHY, worker_env)
    assert result_of(handle, procs) == crashy.expected(4)
    assert handle.status() == "succeeded"

    # Step 1 was recorded before the crash, so worker B replayed its output instead of running it again,
    # and step 3 ran once. Step 2 had started but not finished (nothing recorded) when worker A died,
    # so it ran again from its beginning in worker B: steps are at-least-once until they are recorded,
    # hence "s2 start" twice and "s2 done" once.
    assert lines(effects) == ["s1", "s2 start", "s2 start", "s2 done", "s3"]
    # Its record counts both attempts, the one the kill cut short included.
    steps = handle.steps()
    assert [(s.position, s.name, s.error_type, s.attempts) for s in steps] == [
        (0, wf.first.name, None, 1),
        (1, wf.gated[kind].name, None, 2),
        (2, wf.third.name, None, 1),
    ]


# -- 2. failures, as another process reads them ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_workflow_failure_in_a_worker_reaches_the_caller_with_type_message_and_traceback(
    app: pgflow.App, dsn: str, schema: str, worker_env: dict[str, str], procs: Processes, kind: str,
) -> None:
    wf = failing.build(app)
    procs.worker("worker", FAILING, worker_env)
    handle = wf.explode[kind].start(42)

    with pytest.raises(pgflow.WorkflowFailed) as raised:
        handle.result(timeout=WAIT)
    failure = raised.value
    assert failure.workflow_id == handle.id
    assert failure.error_type == "ValueError"
    assert "bad input 42" in failure.message
    # The traceback is the worker's: it goes through the app module down to the nested function.
    assert "validate_payload" in failure.traceback
    assert "tests/apps/failing.py" in failure.traceback.replace(os.sep, "/")
    assert "ValueError: bad input 42" in failure.traceback
    assert handle.status() == "failed"
    assert handle.steps() == []

    # A process that registered none of these workflows reads the same recorded failure.
    with pgflow.App(dsn, schema=schema) as other:
        with pytest.raises(pgflow.WorkflowFailed) as again:
            other.handle(handle.id).result(timeout=WAIT)
    assert (again.value.error_type, again.value.message) == (failure.error_type, failure.message)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_custom_step_exception_is_recorded_once_and_caught_by_type_also_on_replay(
    app: pgflow.App, worker_env: dict[str, str], procs: Processes, tmp_path: Path, kind: str,
) -> None:
    wf = failing.build(app)
    effects, gate = tmp_path / "effects.txt", tmp_path / "gate"

    a = procs.worker("worker-A", FAILING, worker_env)
    handle = wf.recover[kind].start(str(effects), str(gate), 7)
    # Reaching the hold step means worker A caught InputRejected by its type and went on.
    wait_until(lambda: "hold start" in lines(effects), "the workflow to catch and move on", procs, a)
    [rejected] = handle.steps()
    assert (rejected.position, rejected.name) == (0, wf.reject.name)
    assert (rejected.error_type, rejected.attempts) == ("tests.apps.failing.InputRejected", 1)

    # Worker B replays the workflow: the recorded exception is raised again, as an InputRejected the
    # workflow's `except InputRejected` catches, with its arguments, and the step does not run again.
    a.kill()
    gate.touch()
    procs.worker("worker-B", FAILING, worker_env)
    assert result_of(handle, procs) == "caught InputRejected ('rejected 7', 7) held"
    assert lines(effects) == ["reject", "hold start", "hold start"]
    assert [(s.name, s.error_type) for s in handle.steps()] == [
        (wf.reject.name, "tests.apps.failing.InputRejected"),
        (wf.hold[kind].name, None),
    ]


# -- 3. many processes migrating one schema at once -----------------------------------------------------

# Each process gets ready (interpreter up, pgflow imported, App built: no connection yet), says so, and
# migrates when the test creates the go file, so that all of them hit the database together.
MIGRATE_AT_GO = """
import pathlib, sys, time
import pgflow
ready, go = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
app = pgflow.App()
ready.touch()
deadline = time.monotonic() + 60
while not go.exists():
    if time.monotonic() > deadline:
        sys.exit("no go file after 60s")
    time.sleep(0.005)
with app:
    print("version", app.migrate())
"""


@pytest.mark.slow
@pytest.mark.new_schema  # the eight make it
@pytest.mark.parametrize("via", ["cli", "barrier"])
def test_eight_processes_migrating_at_once_apply_each_migration_once(
    dsn: str, schema: str, worker_env: dict[str, str], procs: Processes, tmp_path: Path, via: str,
) -> None:
    shipped = migrations.available()
    latest = shipped[-1].version
    go = tmp_path / "go"
    if via == "cli":
        started = [procs.start(f"migrate-{i}", ["-m", "pgflow", "migrate"], worker_env) for i in range(8)]
    else:
        started = [procs.start(f"migrate-{i}", ["-c", MIGRATE_AT_GO, str(tmp_path / f"ready-{i}"), str(go)],
                               worker_env) for i in range(8)]
        wait_until(lambda: all((tmp_path / f"ready-{i}").exists() for i in range(8)),
                   "all 8 processes to be ready", procs, *started)
        go.touch()

    codes = [proc.wait_exit(WAIT) for proc in started]
    assert codes == [0] * 8, procs.logs()
    for proc in started:
        expected = f"schema {schema!r} is at version {latest}" if via == "cli" else f"version {latest}"
        assert expected in proc.output(), procs.logs()

    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(f'SELECT version, name FROM "{schema}".migrations ORDER BY version').fetchall()
        tables = conn.execute(
            "SELECT to_regclass(%s), to_regclass(%s), to_regclass(%s)",
            (f'"{schema}".workflows', f'"{schema}".steps', f'"{schema}".migrations'),
        ).fetchone()
    assert rows == [(m.version, m.name) for m in shipped]
    assert tables is not None and None not in tables


# -- 4. the CLI explains a bad app argument -------------------------------------------------------------


def cli_env() -> dict[str, str]:
    """The environment of a CLI process that must fail before it ever connects: the DSN leads nowhere."""
    return {**os.environ, "PGFLOW_DSN": "postgresql://nobody@127.0.0.1:1/nowhere?connect_timeout=1",
            "PGFLOW_SCHEMA": "unused",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


@pytest.mark.parametrize(("target", "says"), [
    ("no_such_module:app", ["cannot import module 'no_such_module'", "PYTHONPATH"]),
    ("tests.apps.crashy:nothing", ["module 'tests.apps.crashy' has no attribute 'nothing'",
                                   "its pgflow.App: tests.apps.crashy:app"]),
    ("tests.apps.crashy:flows", ["tests.apps.crashy.flows (from 'tests.apps.crashy:flows') is a SimpleNamespace,"
                                 " not a pgflow.App", "its pgflow.App: tests.apps.crashy:app"]),
    ("badformat", ["expected module:app", "'badformat'"]),
    ("tests.apps.crashy:", ["expected module:app", "'tests.apps.crashy:'"]),
])
def test_worker_cli_rejects_a_bad_app_with_exit_code_2_and_a_reason(
    procs: Processes, target: str, says: list[str],
) -> None:
    proc = procs.start("cli", ["-m", "pgflow", "worker", target], cli_env())
    code = proc.wait_exit(WAIT)
    out = proc.output()
    assert code == 2, out
    assert "pgflow: error:" in out
    for text in says:
        assert text in out
    assert "Traceback" not in out


def test_worker_cli_names_the_missing_dependency_of_an_app_module(procs: Processes) -> None:
    # tests/apps/needs_missing.py exists, but it imports tests.apps.needs, which does not. The user must
    # learn which module is missing; being told the app module itself cannot be found sends them looking
    # in the wrong place.
    proc = procs.start("cli", ["-m", "pgflow", "worker", "tests.apps.needs_missing:app"], cli_env())
    code = proc.wait_exit(WAIT)
    out = proc.output()
    assert code != 0, out
    assert "'tests.apps.needs'" in out, out


# -- 5. SIGTERM: drain, then give the running workflow back -------------------------------------------

# The exit codes `pgflow worker` documents (pgflow/cli.py, workers/README.md).
EXIT_DRAINED, EXIT_RELEASED, EXIT_FORCED = 0, 3, 130
SIGTERM_EXIT = 15.0  # seconds: a stopping worker past its grace period normally exits in well under one
# kind: the workflow's flavour and, where it differs, the flavour of the step that blocks. A def step
# blocks in a thread, which a stopping worker cannot cancel the way it cancels a coroutine.
ALL_KINDS = ["async", "sync", "sync+async step", "async+sync step"]


def stop_worker_mid_step(
    app: pgflow.App, worker_env: dict[str, str], procs: Processes, tmp_path: Path, kind: str,
    grace: float,
) -> tuple[Any, Proc, pgflow.WorkflowHandle[Any], Path, Path]:
    """Start worker A (a lease longer than any test), run a workflow into its gated step, SIGTERM A and
    wait until it has taken the signal (it logs that it drains)."""
    # With a 300 s lease, a workflow A left claimed could not be taken by another worker in this test:
    # B finishing it proves A gave it back.
    wf, a, handle, effects, gate = held_in_step_2(app, worker_env, procs, tmp_path, kind, 5, lease=300, grace=grace)
    a.popen.send_signal(signal.SIGTERM)
    wait_until(lambda: "draining" in a.output(), "worker A to start draining", procs, a)
    return wf, a, handle, effects, gate


def resume_elsewhere(wf: Any, worker_env: dict[str, str], procs: Processes, handle: pgflow.WorkflowHandle[Any],
                     effects: Path, gate: Path, kind: str) -> None:
    """The given-back workflow, finished by worker B once the gate opens."""
    assert handle.status() == "queued", procs.logs()
    assert [s.name for s in handle.steps()] == [wf.first.name]
    gate.touch()
    procs.worker("worker-B", CRASHY, worker_env, lease=300)
    assert result_of(handle, procs) == crashy.expected(5)
    # Step 1 is replayed, not re-run; the interrupted step 2 runs again from its start in worker B
    # (unfinished steps are at-least-once).
    assert lines(effects) == ["s1", "s2 start", "s2 start", "s2 done", "s3"]
    assert [s.name for s in handle.steps()] == [wf.first.name, wf.gated[kind].name, wf.third.name]


@ONE_SERVER  # how a stopping process cuts each kind of step short is Python's; the give-back is tested on both below
@pytest.mark.slow
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_sigterm_past_the_grace_period_gives_the_workflow_back_and_exits(
    app: pgflow.App, worker_env: dict[str, str], procs: Processes, tmp_path: Path, kind: str,
) -> None:
    wf, a, handle, effects, gate = stop_worker_mid_step(app, worker_env, procs, tmp_path, kind, grace=1)
    # The gate stays closed, so the step cannot finish within the grace period: the worker must
    # interrupt it, hand the workflow back and exit, without waiting for the step.
    assert a.wait_exit(SIGTERM_EXIT) == EXIT_RELEASED, procs.logs()
    resume_elsewhere(wf, worker_env, procs, handle, effects, gate, kind)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_second_sigterm_cuts_the_drain_short_and_gives_the_workflow_back(
    app: pgflow.App, worker_env: dict[str, str], procs: Processes, tmp_path: Path, kind: str,
) -> None:
    wf, a, handle, effects, gate = stop_worker_mid_step(app, worker_env, procs, tmp_path, kind, grace=300)
    a.popen.send_signal(signal.SIGTERM)
    assert a.wait_exit(SIGTERM_EXIT) == EXIT_FORCED, procs.logs()
    resume_elsewhere(wf, worker_env, procs, handle, effects, gate, kind)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_sigterm_lets_a_running_workflow_finish_within_the_grace_period(
    app: pgflow.App, worker_env: dict[str, str], procs: Processes, tmp_path: Path, kind: str,
) -> None:
    wf, a, handle, effects, gate = stop_worker_mid_step(app, worker_env, procs, tmp_path, kind, grace=300)
    gate.touch()  # only now, the worker having taken the signal, may the step go on
    assert a.wait_exit(WAIT) == EXIT_DRAINED, procs.logs()
    assert handle.status() == "succeeded"
    assert handle.result(timeout=WAIT) == crashy.expected(5)
    # Worker A finished it: every step ran exactly once.
    assert lines(effects) == ["s1", "s2 start", "s2 done", "s3"]
    assert [s.name for s in handle.steps()] == [wf.first.name, wf.gated[kind].name, wf.third.name]
