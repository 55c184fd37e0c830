"""``pgflow workflows show`` (and ``app.workflow_details``): what a workflow did, told after the fact
by real processes reading real rows: the error with its message and traceback, the arguments and the
result decoded, each step's start and duration, and every retried attempt's error, kept bounded."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import anyio
import msgspec
import psycopg
import pytest

import pgflow
from pgflow.records import Undecodable, WorkflowDetails

from .apps import show_app
from .helpers import ONE_SERVER

pytestmark = pytest.mark.anyio

WAIT = 60.0


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pgflow", *args], env=env, capture_output=True, text=True,
                          timeout=WAIT)


async def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return await anyio.to_thread.run_sync(lambda: cli(env, *args))


async def shown_json(env: dict[str, str], workflow_id: str) -> Any:
    result = await run_cli(env, "workflows", "show", workflow_id, "--json")
    assert result.returncode == 0, result.stderr
    return msgspec.json.decode(result.stdout)


async def finished(handle: pgflow.WorkflowHandle[Any]) -> None:
    with anyio.fail_after(WAIT):
        try:
            await handle.result_async()
        except pgflow.WorkflowFailed:
            pass


async def test_show_tells_why_a_workflow_failed(app: pgflow.App, worker_env: dict[str, str]) -> None:
    flows = show_app.build(app)
    async with app.worker(concurrency=2):
        failed = await flows.fails.start_async(4)
        await finished(failed)

    data = await shown_json(worker_env, failed.id)
    assert data["status"] == "failed" and data["attempt"] == 1 and data["arguments"] == {"n": 4}
    assert data["error"]["type"] == "tests.apps.show_app.Refused"
    assert data["error"]["message"] == "no for 4 (step attempt 2)"
    assert "Traceback (most recent call last)" in data["error"]["traceback"]
    assert 'in doomed\n    raise Refused(f"no for {n}' in data["error"]["traceback"]
    assert data["duration_s"] is not None and data["duration_s"] >= 0
    flaky, doomed = data["steps"]
    assert (flaky["name"], flaky["attempts"], flaky["output"], flaky["error"]) == ("show.flaky", 3, 8, None)
    assert [(e["run"], e["step_attempt"], e["error"]["type"], e["error"]["message"]) for e in flaky["attempt_errors"]] \
        == [(1, 1, "ConnectionError", "try 1 of 4 refused"), (1, 2, "ConnectionError", "try 2 of 4 refused")]
    assert all("Traceback" in e["error"]["traceback"] for e in flaky["attempt_errors"])
    assert doomed["error"]["message"] == "no for 4 (step attempt 2)" and doomed["attempts"] == 2
    assert [e["error"]["message"] for e in doomed["attempt_errors"]] == ["no for 4 (step attempt 1)"]
    for step in data["steps"]:
        # Its start is this run's first attempt's: the duration spans the retries and their backoff (the
        # first wait is at least half the policy's backoff).
        assert step["started_at"] <= step["finished_at"] and step["duration_s"] >= show_app.BACKOFF / 2
        assert step["started_at"] >= data["started_at"]
    assert flaky["finished_at"] <= doomed["started_at"]

    text = await run_cli(worker_env, "workflows", "show", failed.id)
    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert "error:        tests.apps.show_app.Refused: no for 4 (step attempt 2)" in out
    assert "traceback:\n  Traceback (most recent call last):" in out
    assert 'arguments:    {"n":4}' in out
    assert "step 0 show.flaky, step attempt 1 of workflow attempt 1 at " in out
    assert ": ConnectionError: try 2 of 4 refused" in out
    header = next(line for line in out.splitlines() if line.startswith("POSITION"))
    assert header.split() == ["POSITION", "NAME", "STARTED_AT", "DURATION_S", "ATTEMPTS", "OUTCOME"]
    assert f"{flaky['duration_s']:.3f}" in out


@ONE_SERVER  # the command's output, cut and escaped in Python: the same on any server
async def test_show_decodes_the_arguments_and_result_and_cuts_them_unless_full(
        app: pgflow.App, worker_env: dict[str, str]) -> None:
    flows = show_app.build(app)
    async with app.worker(concurrency=2):
        done = await flows.recovers.start_async(3, label="a\x1b[2Jb")
        with anyio.fail_after(WAIT):
            await done.result_async()
    data = await shown_json(worker_env, done.id)
    assert data["arguments"] == {"n": 3, "label": "a\x1b[2Jb"}
    assert data["result"] == {"doubled": 6, "label": "a\x1b[2Jb", "long": "y" * 1000}
    assert data["error"] is None and data["steps_total"] == 1

    cut = (await run_cli(worker_env, "workflows", "show", done.id)).stdout
    assert "y" * 1000 not in cut and "more characters)" in cut and "--full prints them whole" in cut
    assert "\x1b" not in cut and "a\\u001b[2Jb" in cut  # stored text reaches the terminal escaped
    whole = (await run_cli(worker_env, "workflows", "show", done.id, "--full")).stdout
    assert "y" * 1000 in whole and "more characters)" not in whole
    assert "      Traceback (most recent call last):" in whole  # the retried attempts' tracebacks


@ONE_SERVER  # a traceback the worker records in Python: the same on any server
async def test_a_failed_sync_step_tells_its_own_traceback(app: pgflow.App, worker_env: dict[str, str]) -> None:
    flows = show_app.build(app)
    async with app.worker(concurrency=2):
        failed = await flows.fails_sync.start_async(5)
        await finished(failed)
    error = (await shown_json(worker_env, failed.id))["error"]
    assert error["message"] == "sync no for 5" and "in sync_doomed" in error["traceback"]
    assert "no running event loop" not in error["traceback"]
    assert "During handling of the above exception" not in error["traceback"]


async def test_workflow_details_sync_and_async_agree(app: pgflow.App) -> None:
    flows = show_app.build(app)
    async with app.worker(concurrency=2):
        failed = await flows.fails.start_async(2)
        await finished(failed)
    async_details = await app.workflow_details_async(failed.id)
    sync_details = await anyio.to_thread.run_sync(app.workflow_details, failed.id)
    assert isinstance(async_details, WorkflowDetails) and async_details == sync_details
    assert [s.name for s in async_details.steps] == ["show.flaky", "show.doomed"]
    info = await failed.info_async()  # handle.info() carries the same starts and durations
    assert [(s.started_at, s.duration_s) for s in info.steps] == [
        (s.started_at, s.duration_s) for s in async_details.steps]
    assert all(s.duration_s is not None and s.duration_s > 0 for s in info.steps)
    with pytest.raises(pgflow.UnknownWorkflow, match="no workflow with id 'nobody'"):
        await app.workflow_details_async("nobody")
    with pytest.raises(pgflow.UnknownWorkflow):
        await anyio.to_thread.run_sync(app.workflow_details, "nobody")
    for bad in (0, -1, True, 10**9, "5"):
        with pytest.raises(ValueError, match="steps_limit is between 1 and"):
            await app.workflow_details_async(failed.id, steps_limit=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="steps_limit is between 1 and"):
            app.workflow_details(failed.id, steps_limit=bad)  # type: ignore[arg-type]


async def test_show_lists_the_first_steps_and_says_how_many_there_are(
        app: pgflow.App, worker_env: dict[str, str]) -> None:
    @app.step(name="show.one")
    async def one(i: int) -> int:
        return i

    @app.workflow(name="show.many")
    async def many() -> int:
        return sum([await one(i) for i in range(5)])

    async with app.worker():
        handle = await many.start_async()
        with anyio.fail_after(WAIT):
            assert await handle.result_async() == 10
    details = await app.workflow_details_async(handle.id, steps_limit=2)
    assert [s.position for s in details.steps] == [0, 1] and details.steps_total == 5
    out = (await run_cli(worker_env, "workflows", "show", handle.id, "--steps", "2")).stdout
    assert "steps (the first 2 of 5):" in out
    for bad in ("0", "-3", "many"):
        refused = await run_cli(worker_env, "workflows", "show", handle.id, "--steps", bad)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr
        assert "argument --steps" in refused.stderr.splitlines()[-1]
    unknown = await run_cli(worker_env, "workflows", "show", "nobody")
    assert unknown.returncode == 1 and "no workflow with id 'nobody'" in unknown.stderr


async def test_a_step_running_now_shows_as_begun(app: pgflow.App, worker_env: dict[str, str]) -> None:
    release = anyio.Event()
    entered = anyio.Event()

    @app.step(name="show.gate")
    async def gate() -> None:
        entered.set()
        await release.wait()

    @app.workflow(name="show.gated")
    async def gated() -> None:
        await gate()

    async with app.worker():
        handle = await gated.start_async()
        with anyio.fail_after(WAIT):
            await entered.wait()
            while not (details := await app.workflow_details_async(handle.id)).in_progress:
                await anyio.sleep(0.05)  # the start's note is written beside the step, not before it
        [begun] = details.in_progress
        assert details.status == "running" and details.steps == [] and details.lease_owner is not None
        assert (begun.position, begun.attempts) == (0, 1) and begun.started_at is not None
        out = (await run_cli(worker_env, "workflows", "show", handle.id)).stdout
        assert "begun, not recorded (running, or cut short):\n  step 0: 1 attempts" in out
        assert "lease_owner:" in out
        release.set()
        with anyio.fail_after(WAIT):
            await handle.result_async()
    details = await app.workflow_details_async(handle.id)
    assert details.in_progress == [] and details.steps[0].started_at == begun.started_at


async def test_attempt_errors_are_bounded_pruned_and_go_with_a_resume(app: pgflow.App, dsn: str) -> None:
    huge = "m" * 100_000

    @app.step(name="show.always", max_attempts=15, backoff=0.001, max_backoff=0.001)
    async def always() -> None:
        raise RuntimeError(f"{pgflow.step_attempt()}:{huge}")

    @app.workflow(name="show.hopeless")
    async def hopeless() -> None:
        await always()

    async with app.worker():
        handle = await hopeless.start_async()
        await finished(handle)
    details = await app.workflow_details_async(handle.id)
    [step] = details.steps
    assert step.attempts == 15 and step.error is not None and step.error.message.startswith("15:")
    # The latest 10 retried attempts are kept (5 to 14), each cut to a bounded size.
    assert [e.step_attempt for e in step.attempt_errors] == list(range(5, 15))
    for kept in step.attempt_errors:
        assert kept.error.message.startswith(f"{kept.step_attempt}:m") and "characters cut" in kept.error.message
        assert len(kept.error.message) < 2100 and len(kept.error.traceback) < 8100
        assert kept.error.traceback.rstrip().endswith("characters cut ...]\n" + kept.error.traceback.rstrip()
                                                      .split("characters cut ...]\n")[-1])

    def rows() -> int:
        with psycopg.connect(dsn) as conn:
            found = conn.execute(f'SELECT count(*) FROM "{app.schema}".step_errors WHERE workflow_id = %s',
                                 (handle.id,)).fetchone()
            return int(found[0]) if found else 0

    assert rows() == 10
    await handle.resume_async()  # the step runs again from scratch: its old attempts' errors go
    assert rows() == 0
    async with app.worker():
        await finished(handle)
    assert rows() == 10
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'UPDATE "{app.schema}".workflows SET finished_at = now() - interval \'2 days\''
                     " WHERE id = %s", (handle.id,))
    assert await app.prune_async(86400) == 1
    assert rows() == 0


HOSTILE_ERRORS = ['"just a string"', "[1, 2, 3]", '{"type": 7, "message": ["x"], "traceback": null}',
                  '{"type": "Evil\\u001b]52;c;cGduZmxvdw==\\u0007", "message": "line\\nbreak\\r",'
                  ' "traceback": "a\\u009bb"}']


@ONE_SERVER  # rows decoded and escaped in Python: the same on any server (the details read is tested on both)
@pytest.mark.parametrize("error", HOSTILE_ERRORS)
async def test_rows_written_by_anyone_are_shown_as_data(app: pgflow.App, dsn: str, worker_env: dict[str, str],
                                                        error: str) -> None:
    """Rows are data: bytes that do not decode, msgpack extension types, keys JSON cannot hold and an
    error that is not what pgflow writes are shown for what they are, escaped, never a traceback."""
    await app.migrate_async()
    s = f'"{app.schema}"'
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"INSERT INTO {s}.workflows (id, name, queue, status, inputs, output, error, finished_at)"
                     " VALUES ('planted', 'evil.one', 'default', 'failed', %s, %s, %s::jsonb, now())",
                     (b"\xc1\xff\x00", b"\xd4\x05\x01", error))  # an invalid byte; an ext type (5)
        conn.execute(f"INSERT INTO {s}.steps (workflow_id, position, name, output, attempts, attempt)"
                     " VALUES ('planted', 0, 'evil\x1b[2J.step', %s, 1, 1)", (b"\x81\xc0\x01",))  # {None: 1}
        conn.execute(f"INSERT INTO {s}.step_errors (workflow_id, position, run, step_attempt, error)"
                     " VALUES ('planted', 0, 1, 1, %s::jsonb)", (error,))
    details = await app.workflow_details_async("planted")
    assert isinstance(details.arguments, Undecodable) and details.arguments.size == 3
    assert isinstance(details.result, Undecodable) and isinstance(details.steps[0].output, Undecodable)
    assert details.error is not None and details.steps[0].attempt_errors[0].error == details.error
    as_json = await run_cli(worker_env, "workflows", "show", "planted", "--json")
    assert as_json.returncode == 0, as_json.stderr
    data = msgspec.json.decode(as_json.stdout)
    assert data["arguments"]["type"] == "undecodable" and data["arguments"]["size"] == 3
    for full in ((), ("--full",)):
        text = await run_cli(worker_env, "workflows", "show", "planted", *full)
        assert text.returncode == 0 and "Traceback" not in text.stderr, text.stderr
        assert "<undecodable, 3 bytes: " in text.stdout
        for raw in ("\x1b", "\x07", "\r", "\x9b"):
            assert raw not in text.stdout
        assert "evil\\x1b[2J.step" in text.stdout


def prepared_plan(conn: psycopg.Connection[Any], schema: str, name: str, sql: str, types: list[str],
                  values: list[str], named: list[str] | None = None) -> str:
    """A statement's generic plan, as pgflow's connections run it (prepared, planned for any value)."""
    sql = sql.replace("{s}", f'"{schema}"')
    if named is None:
        for n in range(1, len(types) + 1):
            sql = sql.replace("%s", f"${n}", 1)
    else:
        for n, param in enumerate(named, 1):
            sql = sql.replace(f"%({param})s", f"${n}")
    conn.execute(f"PREPARE {name}({', '.join(types)}) AS {sql}")
    cur = conn.execute(f"EXPLAIN EXECUTE {name}({', '.join(values)})")
    return "\n".join(row[0] for row in cur.fetchall())


async def test_every_statement_of_a_details_read_goes_by_an_index(app: pgflow.App, dsn: str, schema: str) -> None:
    """At 50,000 workflows with steps, attempt errors, notes and streams, no statement of a details read
    (nor the note of an attempt's error) scans a table: the cost of `show` does not grow with the data."""
    from pgflow._core.engine.details import DETAILS, NOTE_ERROR

    await app.migrate_async()
    s = f'"{schema}"'
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"INSERT INTO {s}.workflows (id, name, queue, inputs, status, finished_at)"
                     " SELECT 'w' || i, 'n', 'default', '\\x80', 'succeeded', now() FROM generate_series(1, 50000) i")
        conn.execute(f"INSERT INTO {s}.steps (workflow_id, position, name, output, attempts, attempt, started_at)"
                     " SELECT 'w' || i, p, 'step', '\\x01', 1, 1, now() FROM generate_series(1, 50000) i,"
                     " generate_series(0, 3) p")
        conn.execute(f"INSERT INTO {s}.step_errors (workflow_id, position, run, step_attempt, error)"
                     " SELECT 'w' || i, 0, 1, t, '{\"type\": \"E\"}' FROM generate_series(1, 50000) i,"
                     " generate_series(1, 2) t")
        conn.execute(f"INSERT INTO {s}.step_attempts (workflow_id, position, attempt, tries)"
                     " SELECT 'w' || i, 4, 1, 1 FROM generate_series(1, 50000, 7) i")
        conn.execute(f"INSERT INTO {s}.stream_ids (workflow_id, key) SELECT 'w' || i, 'out'"
                     " FROM generate_series(1, 50000) i")
        conn.execute(f"INSERT INTO {s}.chunks (stream_id, position, value) SELECT id, p, '\\x01'"
                     f" FROM {s}.stream_ids, generate_series(0, 4) p")
        for table in ("workflows", "steps", "step_errors", "step_attempts", "stream_ids", "chunks"):
            conn.execute(f"ANALYZE {s}.{table}")
        conn.execute("SET jit = off")
        conn.execute("SET plan_cache_mode = force_generic_plan")
        args = {"workflow": (["text"], ["'w77'"]), "steps": (["text", "int"], ["'w77'", "1000"]),
                "step_count": (["text"], ["'w77'"]),
                "attempt_errors": (["text", "bool", "int"], ["'w77'", "true", "3"]),
                "begun": (["text"], ["'w77'"]), "streams": (["text"], ["'w77'"])}
        plans = {name: prepared_plan(conn, schema, name, sql, *args[name]) for name, sql in DETAILS.items()}
        plans["note"] = prepared_plan(conn, schema, "note", NOTE_ERROR,
                                      ["text", "int8", "int", "int", "int", "jsonb", "int"],
                                      ["'w77'", "1", "0", "1", "3", "'{}'", "9"],
                                      ["id", "lease", "position", "run", "step_attempt", "error", "keep"])
    for name, text in plans.items():
        assert "Seq Scan" not in text and "Index" in text, (name, text)


def test_durations_follow_the_schemas_clock_under_pgflow_testing(dsn: str) -> None:
    """Under pgflow.testing's clock, a day ahead of the wall's, a step's start, its attempts' errors and
    its end are all read on the schema's clock (clock_now()): its duration is its own, not the day."""
    from pgflow.testing import PgflowEnv

    app = pgflow.App(dsn)

    @app.step(name="show.quick_retry", max_attempts=2, backoff=0.01)
    async def quick_retry() -> int:
        if pgflow.step_attempt() == 1:
            raise ConnectionError("once")
        return 1

    @app.workflow(name="show.patient")
    async def patient() -> int:
        return await quick_retry()

    env = PgflowEnv(app, dsn).start()
    try:
        env._call(lambda: env.set_schema_clock(86400.0))
        handle = patient.start()
        env.clock.advance(seconds=1)
        assert handle.result(timeout=WAIT) == 1
        details = app.workflow_details(handle.id)
        [step] = details.steps
        assert step.started_at is not None and step.duration_s is not None
        assert 0 <= step.duration_s < 60, step
        [kept] = step.attempt_errors
        assert details.created_at <= step.started_at <= kept.failed_at <= step.finished_at
    finally:
        env.stop()
        app.close()
