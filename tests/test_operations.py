"""Day two: listing, looking into, resuming and forking workflows; the worker's log lines; errors
that waiting cannot fix, reported at once."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import psycopg
import pytest

import pgflow

from .servers import EmbeddedServer

pytestmark = pytest.mark.anyio

WAIT = 60.0


async def test_list_workflows_filters_orders_and_limits(app: pgflow.App) -> None:
    @app.workflow
    async def fine(x: int) -> int:
        return x

    @app.workflow(queue="other")
    async def broken() -> None:
        raise RuntimeError("no")

    before = datetime.now(UTC) - timedelta(seconds=1)
    oks = [await fine.start_async(i) for i in range(3)]
    bad = await broken.start_async()
    async with app.worker(concurrency=4, queues=["default", "other"]):
        with anyio.fail_after(WAIT):
            for h in [*oks, bad]:
                with pytest.raises(Exception) if h is bad else _nothing():
                    await h.result_async()
    listed = await app.list_workflows_async()
    assert [r.id for r in listed] == [bad.id, *[h.id for h in reversed(oks)]]  # newest first
    failed = app.list_workflows(status="failed")  # the sync twin
    assert [(r.id, r.name, r.queue, r.status, r.error_type, r.attempt) for r in failed] == [
        (bad.id, broken.name, "other", "failed", "RuntimeError", 1)]
    assert failed[0].started_at is not None and failed[0].finished_at is not None
    assert [r.id for r in await app.list_workflows_async(name=fine.name, order="asc", limit=2)] == [
        oks[0].id, oks[1].id]
    assert len(await app.list_workflows_async(queue="default", created_after=before)) == 3
    assert await app.list_workflows_async(created_before=before) == []
    with pytest.raises(ValueError, match="status is one of"):
        await app.list_workflows_async(status="done")
    with pytest.raises(ValueError, match="limit is between"):
        await app.list_workflows_async(limit=0)
    with pytest.raises(ValueError, match="timezone-aware"):
        await app.list_workflows_async(created_after=datetime.now())  # noqa: DTZ005


class _nothing:
    def __enter__(self) -> None: ...

    def __exit__(self, *exc: object) -> None: ...


async def test_resume_reruns_from_the_failed_third_step_and_not_the_first_two(app: pgflow.App) -> None:
    ran: list[str] = []
    broken = {"third": True}

    @app.step
    async def step_one() -> int:
        ran.append("one")
        return 1

    @app.step
    def step_two() -> int:
        ran.append("two")
        return 2

    @app.step
    async def step_three() -> int:
        ran.append("three")
        if broken["third"]:
            raise ValueError("not yet")
        return 3

    @app.workflow(max_attempts=1)
    async def three_steps() -> int:
        await pgflow.write_stream_async("progress", "start")
        total = await step_one() + await step_two() + await step_three()
        await pgflow.close_stream_async("progress")
        return total

    async with app.worker(concurrency=2):
        handle = await three_steps.start_async()
        with anyio.fail_after(WAIT), pytest.raises(pgflow.WorkflowFailed, match="not yet"):
            await handle.result_async()
        waiting = await three_steps.with_options(delay=3600).start_async()
        with pytest.raises(pgflow.CannotResume, match="is queued"):
            await waiting.resume_async()  # queued (or running): refused
        info = await handle.info_async()
        assert [(s.position, s.error_type) for s in info.steps] == [(0, None), (1, None), (2, "ValueError")]
        broken["third"] = False
        await handle.resume_async()
        with anyio.fail_after(WAIT):
            assert await handle.result_async() == 6
        with pytest.raises(pgflow.CannotResume, match="succeeded"):
            handle.resume()  # the sync twin; a succeeded workflow does not resume
    assert ran == ["one", "two", "three", "three"]  # steps one and two were not run again
    info = await handle.info_async()
    assert info.record.status == "succeeded" and info.record.attempt == 1  # a fresh attempt count
    assert [(s.name, s.attempts) for s in info.steps] == [(step_one.name, 1), (step_two.name, 1),
                                                          (step_three.name, 1)]
    assert [(s.key, s.length, s.closed) for s in info.streams] == [("progress", 1, True)]
    with pytest.raises(pgflow.UnknownWorkflow):
        await app.handle("nobody").resume_async()
    with pytest.raises(pgflow.UnknownWorkflow):
        app.handle("nobody").steps()


async def test_step_attempts_count_those_cut_short_and_a_resume_counts_afresh(app: pgflow.App) -> None:
    """A step cut short (its worker stopped mid-step) counts with the attempts that ran to the end,
    retries included; a resume of a workflow cancelled mid-step starts the count again."""
    started = anyio.Event()
    calls: list[str] = []

    @app.step(max_attempts=2, backoff=0.01)
    async def slow_then_flaky() -> str:
        calls.append("call")
        if len(calls) == 1:
            started.set()
            await anyio.sleep_forever()  # cut short: the worker stops under it
        if len(calls) == 2:
            raise ConnectionError("once")
        return "ok"

    @app.workflow
    async def counted() -> str:
        return await slow_then_flaky()

    handle = await counted.start_async()
    async with app.worker(concurrency=1, grace=0.0):
        with anyio.fail_after(WAIT):
            await started.wait()
    assert await handle.status_async() == "queued"  # given back, unrecorded
    async with app.worker(concurrency=1):
        with anyio.fail_after(WAIT):
            assert await handle.result_async() == "ok"
    [step] = await handle.steps_async()
    assert (step.name, step.attempts, len(calls)) == (slow_then_flaky.name, 3, 3)

    gate = anyio.Event()

    @app.step
    async def held() -> int:
        if not gate.is_set():
            gate.set()
            await anyio.sleep_forever()  # cut short by the cancellation
        return 1

    @app.workflow
    async def holder() -> int:
        return await held()

    other = await holder.start_async()
    async with app.worker(concurrency=1):
        with anyio.fail_after(WAIT):
            await gate.wait()
            await other.cancel_async()
            with pytest.raises(pgflow.WorkflowCancelled):
                await other.result_async()
        assert await other.steps_async() == []
        await other.resume_async()
        with anyio.fail_after(WAIT):
            assert await other.result_async() == 1
    assert [(s.name, s.attempts) for s in await other.steps_async()] == [(held.name, 1)]


async def test_fork_copies_the_first_steps_and_runs_the_rest_anew(app: pgflow.App) -> None:
    ran: list[tuple[str, int]] = []

    @app.step
    async def numbered(i: int) -> int:
        ran.append(("step", i))
        await pgflow.write_stream_async("s", f"in step {i}")
        return i

    @app.workflow
    async def four(tag: str) -> list[int]:
        out = []
        for i in range(4):
            out.append(await numbered(i))
        await pgflow.close_stream_async("s")
        return out

    async with app.worker(concurrency=2):
        original = await four.start_async("x")
        with anyio.fail_after(WAIT):
            assert await original.result_async() == [0, 1, 2, 3]
        ran.clear()
        forked = await original.fork_async(from_step=2)
        assert forked.id != original.id
        with anyio.fail_after(WAIT):
            assert await forked.result_async() == [0, 1, 2, 3]
            assert [v async for v in forked.stream_async("s")] == [f"in step {i}" for i in range(4)]
    assert ran == [("step", 2), ("step", 3)]  # steps 0 and 1 were copied, not run
    with pytest.raises(ValueError, match="from_step"):
        await original.fork_async(from_step=-1)
    with pytest.raises(pgflow.UnknownWorkflow):
        app.handle("nobody").fork(1)


async def test_a_fork_past_a_fan_out_reuses_the_ended_children(app: pgflow.App) -> None:
    """The children a copied position started (one by ``start``, three by ``start_many``) are found
    ended in the fork: none runs twice. Forked before the fan-out, they run anew."""
    ran: list[int] = []

    @app.workflow(name="fork.child")
    async def child(i: int) -> int:
        ran.append(i)
        return i * 10

    @app.step(name="fork.after")
    async def after(total: int) -> int:
        return total + 1

    @app.workflow(name="fork.parent")
    async def parent() -> int:
        one = await child.start_async(0)  # position 0
        many = await child.start_many_async([(1,), (2,), (3,)])  # position 1
        results = [await h.result_async() for h in (one, *many)]
        return await after(sum(results))  # position 2

    async with app.worker(concurrency=8):
        original = await parent.start_async()
        with anyio.fail_after(WAIT):
            assert await original.result_async() == 61
        assert sorted(ran) == [0, 1, 2, 3]
        ran.clear()
        past = await original.fork_async(from_step=2)
        with anyio.fail_after(WAIT):
            assert await past.result_async() == 61
        assert ran == []  # every child was reused
        children = await app.list_workflows_async(name="fork.child", limit=100)
        assert sorted(r.id for r in children if r.parent_id == past.id) == sorted(
            [f"{past.id}.0", *(f"{past.id}.1.{n}" for n in range(3))])
        before = await original.fork_async(from_step=1)  # position 1 (start_many) is not copied
        with anyio.fail_after(WAIT):
            assert await before.result_async() == 61
        assert sorted(ran) == [1, 2, 3]


async def test_the_worker_logs_each_start_and_end_and_a_failure_with_its_traceback(
    app: pgflow.App, caplog: pytest.LogCaptureFixture,
) -> None:
    @app.workflow
    async def fails() -> None:
        raise KeyError("the missing key")

    @app.workflow
    async def works() -> int:
        return 1

    with caplog.at_level(logging.DEBUG, logger="pgflow"):
        async with app.worker(concurrency=2):
            bad, good = await fails.start_async(), await works.start_async()
            with anyio.fail_after(WAIT):
                assert await good.result_async() == 1
                with pytest.raises(pgflow.WorkflowFailed):
                    await bad.result_async()
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "pgflow.workflows"]
    # At INFO one line per workflow, its end; its start at DEBUG.
    assert ("DEBUG", f"workflow {works.name} {good.id} started (attempt 1)") in lines
    assert any(level == "INFO" and m.startswith(f"workflow {works.name} {good.id} succeeded in ")
               for level, m in lines), lines
    [failure] = [m for level, m in lines if level == "WARNING"]
    assert f"workflow {fails.name} {bad.id} failed in " in failure and "KeyError" in failure
    assert "Traceback (most recent call last)" in failure and "the missing key" in failure
    started = [m for r in caplog.records if (m := r.getMessage()).startswith("worker ") and " started:" in m]
    assert started and f"schema {app.schema}" in started[0] and "password" not in started[0]


async def test_the_worker_warns_once_per_name_of_queued_workflows_nobody_runs(
    app: pgflow.App, caplog: pytest.LogCaptureFixture,
) -> None:
    @app.workflow
    async def known() -> int:
        return 1

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.name == "pgflow.worker" and r.levelname == "WARNING" and "no live worker runs" in r.getMessage()]

    # Started by a caller whose code has names the worker's has not.
    async with pgflow.App(app.dsn, schema=app.schema) as caller:

        @caller.workflow(name="renamed.away")
        async def renamed() -> None: ...

        @caller.workflow(name="also.unknown")
        async def unknown() -> None: ...

        ghosts = [await renamed.start_async() for _ in range(2)]
        with caplog.at_level(logging.INFO, logger="pgflow"):
            async with app.worker(concurrency=2, lease=0.5) as worker:
                with anyio.fail_after(WAIT):
                    assert await (await known.start_async()).result_async() == 1  # a name it runs: no warning
                    while not warnings():
                        await anyio.sleep(0.02)
                assert "names" in worker.leading
                await unknown.start_async()
                await worker._on.unserved()  # the service's next looks: a new name warns, the old one not again
                await worker._on.unserved()
    assert warnings() == [
        "2 queued workflows are named 'renamed.away', which no live worker runs: they wait until a worker that"
        " registers that name starts (a renamed workflow? a worker serving another module?)",
        "1 queued workflows are named 'also.unknown', which no live worker runs: they wait until a worker that"
        " registers that name starts (a renamed workflow? a worker serving another module?)"]
    assert [await g.status_async() for g in ghosts] == ["queued", "queued"]


@pytest.mark.parametrize(("dsn_of", "words"), [
    (lambda dsn: dsn.rsplit("/", 1)[0] + "/no_such_database_xyz", "does not exist"),
    (lambda dsn: dsn.replace("postgres@", "no_such_role_xyz@"), "does not exist"),
    (lambda dsn: "postgresql://127.0.0.1:1/test", "nothing accepts connections"),
    (lambda dsn: "postgresql://[not a host", "malformed"),
    (lambda dsn: "postgresql://postgres@no-such-host.invalid:5432/test", "does not resolve"),
])
def test_errors_waiting_cannot_fix_raise_configuration_error_within_3_seconds(
    schema: str, dsn_of: Any, words: str,
) -> None:
    dsn = dsn_of("postgresql://postgres@127.0.0.1:5432/test")
    t0 = time.monotonic()
    with pytest.raises(pgflow.ConfigurationError, match=words) as raised:
        with pgflow.App(dsn, schema=schema) as app:
            app.migrate()
    assert time.monotonic() - t0 < 3.0
    assert "\n" not in str(raised.value) and "secret" not in str(raised.value)
    try:
        with psycopg.connect("postgresql://postgres@127.0.0.1:5432/test", connect_timeout=2):
            pass
    except psycopg.OperationalError:
        pytest.skip("no PostgreSQL 15 at 127.0.0.1:5432 to compare with")


def test_a_wrong_password_raises_configuration_error_within_3_seconds(embedded_server: EmbeddedServer,
                                                                      schema: str) -> None:
    """The test servers trust every connection; for this test one role of the embedded server must
    give a password (a line of its own at the top of pg_hba.conf, taken out again afterwards)."""
    hba = embedded_server.pgdata / "pg_hba.conf"
    before = hba.read_text()
    with psycopg.connect(embedded_server.dsn, autocommit=True) as conn:
        conn.execute("DROP ROLE IF EXISTS pgflow_password_probe")
        conn.execute("CREATE ROLE pgflow_password_probe LOGIN PASSWORD 'the-right-one'")
        hba.write_text("local all pgflow_password_probe scram-sha-256\n" + before)
        conn.execute("SELECT pg_reload_conf()")
    try:
        dsn = embedded_server.dsn.replace("postgres@", "pgflow_password_probe:secret-but-wrong@", 1)
        t0 = time.monotonic()
        with pytest.raises(pgflow.ConfigurationError, match="password authentication failed") as raised:
            with pgflow.App(dsn, schema=schema) as app:
                app.migrate()
        assert time.monotonic() - t0 < 3.0
        assert "check the password" in str(raised.value) and "secret-but-wrong" not in str(raised.value)
    finally:
        hba.write_text(before)
        with psycopg.connect(embedded_server.dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_reload_conf()")
            conn.execute("DROP ROLE IF EXISTS pgflow_password_probe")


async def test_the_names_a_worker_warned_of_are_bounded(app: pgflow.App, dsn: str, schema: str) -> None:
    """Names of queued workflows are anybody's to make up: the worker remembers at most
    MAX_WARNED_NAMES of those it warned of, however many there are."""
    from pgflow._core.chores import MAX_WARNED_NAMES

    @app.workflow
    async def known() -> int:
        return 1

    await app.migrate_async()
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(f'INSERT INTO "{schema}".workflows (id, name, queue, inputs)'
                           " SELECT 'x' || n, 'made.up.' || n, 'default', '\\x80'"
                           " FROM generate_series(1, %s) AS n", (MAX_WARNED_NAMES + 50,))
    async with app.worker(concurrency=1, queues=["elsewhere"]) as worker:
        await worker._on.unserved()
        assert 0 < len(worker._on.unserved.warned) <= MAX_WARNED_NAMES
