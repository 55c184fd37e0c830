"""pgflow.testing: the fixture's schema and worker, running until idle, the reads, and the virtual
clock that durable sleeps, message timeouts, delays, retry backoff, cron ticks and workflow timeouts
follow (the sample project under examples/testing_sample/ uses the fixture from outside, as a user's
project does: tests/test_examples.py runs it)."""

from __future__ import annotations

import time
from datetime import datetime, timedelta

import psycopg
import pytest

import pgflow
from pgflow.testing import PgflowEnv
from pgflow.testing.plugin import load_app

app = pgflow.App(poll_interval=60.0)  # no poll comes to the rescue: advancing must wake the worker
attempts: list[int] = []
ticks: list[datetime] = []


@app.step(max_attempts=3, backoff=3600, backoff_rate=2, max_backoff=86400)
def flaky(x: int) -> int:
    attempts.append(pgflow.step_attempt())
    if pgflow.step_attempt() < 3:
        raise ConnectionError("not yet")
    return x * 2


@app.workflow
async def month(x: int) -> dict:
    await pgflow.sleep_async(86400)
    doubled = await flaky(x)
    await pgflow.set_event_async("doubled", doubled)
    reply = await pgflow.recv_async("approval", timeout=7 * 86400)
    await pgflow.write_stream_async("log", f"reply {reply}")
    await pgflow.sleep_async(20 * 86400)
    await pgflow.close_stream_async("log")
    return {"doubled": doubled, "reply": reply}


@app.workflow
def sync_month(x: int) -> int:  # a def workflow: its sleep goes through the worker's loop
    pgflow.sleep(10 * 86400)
    return x + 1


@app.workflow
async def napper() -> str:
    await pgflow.sleep_async(86400)
    return "rested"


@app.workflow
async def parent() -> str:
    child = await napper.start_async()
    return await child.result_async()


@app.workflow(timeout=3600)
async def too_slow() -> str:
    await pgflow.sleep_async(2 * 3600)
    return "never"


@app.step(max_attempts=5, backoff=1000, max_backoff=86400)
def always_fails() -> None:
    raise ConnectionError("down")


@app.workflow(timeout=1800)
async def out_of_time() -> None:
    await always_fails()  # its retries wait 500-1000 s, then 1000-2000 s, in the slot: the timeout comes first


@app.workflow
async def plain(x: int) -> int:
    return x


# Its own App: each tick is a step of every advance (720 in a month), which the other tests do not want.
cron_app = pgflow.App(poll_interval=60.0)


@cron_app.workflow(schedule="0 * * * *")
async def hourly(tick: datetime) -> str:
    ticks.append(tick)
    return tick.isoformat()


@pytest.fixture
def pgflow_app() -> pgflow.App:
    return app


@pytest.fixture
def pgflow_dsn(dsn: str) -> str:
    return dsn


def test_a_month_with_retries_and_a_message_timeout_in_well_under_two_seconds(pgflow_env: PgflowEnv) -> None:
    attempts.clear()
    began = time.monotonic()
    start = pgflow_env.clock.now()
    handle = month.start(21)
    pgflow_env.clock.advance(days=30)
    took = time.monotonic() - began
    assert handle.status() == "succeeded"
    assert handle.result(timeout=5) == {"doubled": 42, "reply": None}
    assert attempts == [1, 2, 3]  # backoffs of 1 h and 2 h, on the clock
    assert pgflow_env.events(handle) == {"doubled": 42}
    assert pgflow_env.stream(handle, "log") == ["reply None"]
    assert [step.name for step in pgflow_env.steps(handle)] == [
        "pgflow.sleep", "tests.test_testing.flaky", "pgflow.set_event:doubled", "pgflow.recv:approval",
        "pgflow.sleep"]
    assert [step.attempts for step in pgflow_env.steps(handle)][1] == 3
    info = handle.info()
    # 1 day + about 3 h of (jittered) backoff + 7 days of waiting + 20 days, as the schema's clock saw it
    lived = (info.record.finished_at - info.record.created_at).total_seconds()
    assert 28 * 86400 + 3600 <= lived < 29 * 86400, lived
    assert timedelta(days=30) <= pgflow_env.clock.now() - start < timedelta(days=30, minutes=1)
    assert took < 2.0, f"a month took {took:.2f}s of wall time"


def test_a_message_before_its_timeout_is_received(pgflow_env: PgflowEnv) -> None:
    handle = month.start(1)
    pgflow_env.clock.advance(days=2)  # slept, retried, now waiting for the approval
    assert handle.status() == "queued"
    assert [m.topic for m in pgflow_env.messages(handle)] == []
    handle.send("approval", {"ok": True})
    pgflow_env.run_until_idle()
    [message] = pgflow_env.messages(handle)
    assert (message.topic, message.value) == ("approval", {"ok": True})
    assert message.consumed_at is not None
    assert pgflow_env.stream(handle, "log") == ["reply {'ok': True}"]
    assert handle.status() == "queued"  # its last sleep: 20 days
    pgflow_env.clock.advance(days=19)
    assert handle.status() == "queued"
    pgflow_env.clock.advance(days=1)
    assert handle.result(timeout=5) == {"doubled": 2, "reply": {"ok": True}}


def test_nothing_moves_until_the_clock_does(pgflow_env: PgflowEnv) -> None:
    handle = napper.start()
    pgflow_env.run_until_idle()
    assert handle.status() == "queued"
    pgflow_env.clock.advance(hours=23, minutes=59)
    assert handle.status() == "queued"
    began = time.monotonic()
    pgflow_env.clock.advance(minutes=1)
    assert handle.result(timeout=10) == "rested"
    assert time.monotonic() - began < 10  # the worker's poll is 60 s: the advance woke it


def test_a_sync_workflow_sleeps_on_the_clock(pgflow_env: PgflowEnv) -> None:
    handle = sync_month.start(1)
    pgflow_env.clock.advance(days=10)
    assert handle.result(timeout=5) == 2


def test_delay_follows_the_clock(pgflow_env: PgflowEnv) -> None:
    handle = plain.with_options(delay=3600).start(7)
    pgflow_env.run_until_idle()
    assert handle.status() == "queued"
    pgflow_env.clock.advance(minutes=59)
    assert handle.status() == "queued"
    pgflow_env.clock.advance(minutes=1)
    assert handle.result(timeout=5) == 7


def test_a_parent_waiting_for_a_sleeping_child_is_idle(pgflow_env: PgflowEnv) -> None:
    handle = parent.start()
    pgflow_env.run_until_idle()  # the parent runs, parked on its child; the child sleeps
    assert handle.status() == "running"
    pgflow_env.clock.advance(days=1)
    assert handle.result(timeout=5) == "rested"


def test_workflow_timeouts_follow_the_clock(pgflow_env: PgflowEnv) -> None:
    asleep = too_slow.start()  # given its slot back while it sleeps: due again at its deadline
    retrying = out_of_time.start()  # in its slot, between retries: its timeout is a timer on the clock
    pgflow_env.clock.advance(hours=3)
    for handle in (asleep, retrying):
        with pytest.raises(pgflow.WorkflowFailed) as failed:
            handle.result(timeout=5)
        assert failed.value.error_type.endswith("WorkflowTimeout"), failed.value


def test_cron_ticks_follow_the_clock(dsn: str) -> None:
    ticks.clear()
    env = PgflowEnv(cron_app, dsn).start()
    try:
        start = env.clock.now()
        env.clock.advance(hours=3)
        hours = [(start + timedelta(hours=n)).replace(minute=0, second=0, microsecond=0) for n in (1, 2, 3)]
        # (a tick up to 3 leases before the start is started too: the service catches up with its gap)
        assert sorted(tick for tick in ticks if tick > start) == hours
        done = env.workflows(status="succeeded", name=hourly.name)
        assert sorted(w.id for w in done) == sorted(f"{hourly.name}@{tick.isoformat()}" for tick in ticks)
    finally:
        env.stop()


def test_the_schema_is_the_tests_own_and_dropped_after(dsn: str) -> None:
    env = PgflowEnv(app, dsn).start()
    try:
        assert plain.start(3).result(timeout=10) == 3
        assert [w.name for w in env.workflows()] == [plain.name]
    finally:
        env.stop()
    with psycopg.connect(dsn, autocommit=True) as conn:
        found = conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname = %s", (env.schema,)).fetchone()
    assert found == (0,)
    assert app._dsn is None and app._settings["schema"] == "pgflow" and not app._runtimes.clock.virtual


def test_a_server_that_cannot_be_reached_leaves_the_app_as_it_was() -> None:
    env = PgflowEnv(app, "postgresql://nobody@127.0.0.1:1/nothing")
    with pytest.raises(pgflow.ConfigurationError, match="127.0.0.1"):
        env.start()
    assert app._dsn is None and app._settings["schema"] == "pgflow" and not app._runtimes.clock.virtual


def test_bad_input_is_refused(pgflow_env: PgflowEnv) -> None:
    with pytest.raises(ValueError, match="only moves forward"):
        pgflow_env.clock.advance(-1)
    with pytest.raises(ValueError, match="only moves forward"):
        pgflow_env.clock.advance(days=float("nan"))
    for spec, match in [("nocolon", "module:attribute"), ("no_such_module_xyz:app", "cannot import"),
                        ("tests.test_testing:attempts", "not a pgflow.App")]:
        with pytest.raises(pytest.UsageError, match=match):
            load_app(spec)
    for offset in (float("inf"), -1.0, "1; DROP SCHEMA x"):
        with pytest.raises(ValueError, match="offset"):
            pgflow_env._call(lambda: pgflow_env.set_schema_clock(offset))  # type: ignore[arg-type]  # noqa: B023


@pytest.mark.anyio
async def test_async_twins(pgflow_env: PgflowEnv) -> None:
    handle = await month.start_async(5)
    await pgflow_env.clock.advance_async(days=30)
    assert await handle.result_async(timeout=5) == {"doubled": 10, "reply": None}
    assert await pgflow_env.events_async(handle) == {"doubled": 10}
    assert await pgflow_env.stream_async(handle, "log") == ["reply None"]
    assert len(await pgflow_env.steps_async(handle)) == 5
    assert await pgflow_env.messages_async(handle) == []
    assert [w.id for w in await pgflow_env.workflows_async(status="succeeded")] == [handle.id]
    await pgflow_env.run_until_idle_async()


def test_production_pays_nothing(dsn: str, schema: str) -> None:
    """Outside a test the schema's clock is now() itself, one expression the planner inlines."""
    with pgflow.App(dsn, schema=schema) as production:
        production.migrate()
    with psycopg.connect(dsn, autocommit=True) as conn:
        body = conn.execute("SELECT prosrc, provolatile FROM pg_proc WHERE proname = 'clock_now'"
                            " AND pronamespace = %s::regnamespace", (schema,)).fetchone()
        plan = conn.execute(f"EXPLAIN (VERBOSE) SELECT * FROM \"{schema}\".workflows"
                            f" WHERE due_at <= \"{schema}\".clock_now()").fetchall()
    assert body == ("SELECT pg_catalog.now()", "s")
    text = "\n".join(row[0] for row in plan)
    assert "clock_now" not in text and "now()" in text, text
