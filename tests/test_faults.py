"""Liveness under faults and poisoned input (issue 11): what the adversarial trial found, each with a
test that failed before its fix. Real servers throughout: backends are terminated with
pg_terminate_backend, bad values go through the public API."""

from __future__ import annotations

import logging
import math
import os
import re
from typing import Any

import anyio
import psycopg
import pytest

import pgflow
from pgflow._core.engine import unreachable

from .helpers import ONE_SERVER, query

pytestmark = pytest.mark.anyio

WAIT = 60.0


# -- A. dead idle pooled connections ---------------------------------------------------------------------


async def test_idle_pooled_connections_killed_by_the_server_are_replaced_at_once(app: pgflow.App, dsn: str) -> None:
    @app.workflow
    async def nothing() -> None: ...

    handle = await nothing.start_async()
    with anyio.fail_after(WAIT):  # the pool grows while callers wait for a connection
        while app.stats().pool_connections < 4:
            async with anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(handle.status_async)
    await anyio.sleep(2.5)  # the connections sit idle past the point where a checkout checks them
    killed = await query(dsn, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
                         f"pgflow-{os.getpid()}")
    assert len(killed) >= 4
    # Before: the pool tried one dead connection after another, pausing 1, 2, 4 ... s between tries.
    with anyio.fail_after(3):
        assert await handle.status_async() == "queued"


# -- D. exceptions whose messages PostgreSQL cannot store ---------------------------------------------------


async def test_a_failure_whose_message_holds_nul_or_a_lone_surrogate_is_recorded(app: pgflow.App) -> None:
    @app.step
    async def poisoned_step() -> None:
        raise ValueError("step\x00message \ud800")

    @app.workflow
    async def poisoned_body() -> None:
        raise ValueError("bad\x00msg")

    @app.workflow
    async def calls_poisoned_step() -> None:
        await poisoned_step()

    async with app.worker(concurrency=2):
        body = await poisoned_body.start_async()
        step = await calls_poisoned_step.start_async()
        with anyio.fail_after(WAIT), pytest.raises(pgflow.WorkflowFailed) as failed:
            await body.result_async()
        assert (failed.value.error_type, failed.value.message) == ("ValueError", "bad\\x00msg")
        with anyio.fail_after(WAIT), pytest.raises(pgflow.WorkflowFailed) as failed:
            await step.result_async()
        assert failed.value.message == "step\\x00message \\ud800"
    assert [(s.name, s.error_type, s.attempts) for s in await step.steps_async()] == [
        (poisoned_step.name, "ValueError", 1)]


# -- E and F. stream keys and ids that cannot be stored -----------------------------------------------------


def stream_writer(app: pgflow.App, go: anyio.Event | None = None) -> pgflow.Workflow[Any, int]:
    """``writer(key, n)``: writes 0..n-1 to the stream ``key`` and closes it (once ``go`` is set, when
    given); returns n. Started beside a poisoned one, for the innocents a poison must leave alone."""

    @app.workflow
    async def writer(key: str, n: int) -> int:
        if go is not None:
            await go.wait()
        for i in range(n):
            await pgflow.write_stream_async(key, i)
        await pgflow.close_stream_async(key)
        return n

    return writer


async def test_a_stream_key_with_nul_fails_its_own_workflow_and_no_other(app: pgflow.App) -> None:
    writer = stream_writer(app)
    async with app.worker(concurrency=8):
        poison = await writer.start_async("p\x00", 1)
        innocents = [await writer.start_async("s", 50) for _ in range(4)]
        with anyio.fail_after(WAIT):
            assert [await h.result_async() for h in innocents] == [50] * 4
            with pytest.raises(pgflow.WorkflowFailed) as failed:
                await poison.result_async()
    assert failed.value.error_type == "ValueError" and "NUL" in failed.value.message
    assert (await poison.status_async(), await query_attempts(app, poison.id)) == ("failed", 1)
    for h in innocents:
        assert await query_attempts(app, h.id) == 1  # nobody was interrupted and run again


async def query_attempts(app: pgflow.App, workflow_id: str) -> int:
    return int((await pgflow_row(app, workflow_id))["attempt"])


async def pgflow_row(app: pgflow.App, workflow_id: str) -> dict[str, Any]:
    rows = await query(app.dsn, f'SELECT attempt FROM "{app.schema}".workflows WHERE id = %s', workflow_id)
    return {"attempt": rows[0][0]}


async def test_one_bad_reader_does_not_break_the_other_readers_of_its_process(app: pgflow.App) -> None:
    release = anyio.Event()

    @app.workflow
    async def slow(n: int) -> int:
        await release.wait()
        for i in range(n):
            await pgflow.write_stream_async("t", i)
        await pgflow.close_stream_async("t")
        return n

    handle = await slow.start_async(20)
    got: list[list[int]] = []
    errors: list[BaseException] = []

    async def read(h: pgflow.WorkflowHandle[Any], key: str) -> None:
        try:
            got.append([v async for v in h.stream_async(key)])
        except ValueError as exc:
            errors.append(exc)

    async with app.worker(concurrency=2):
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                for _ in range(29):
                    tg.start_soon(read, handle, "t")
                tg.start_soon(read, handle, "t\x00")
                tg.start_soon(read, handle, "t\udc80")
                release.set()
    assert got == [list(range(20))] * 29
    assert len(errors) == 2 and all("stream key" in str(e) for e in errors)
    for bad in ("x\x00", "\ud800", "x" * 1001):
        with pytest.raises(ValueError, match="workflow id"):
            app.handle(bad)


# -- cancellation reaches a workflow that never writes again ------------------------------------------------


async def test_a_running_workflow_that_never_reaches_a_step_is_cancelled_by_its_worker(app: pgflow.App) -> None:
    started = anyio.Event()

    @app.workflow
    async def stuck() -> None:
        started.set()
        await anyio.sleep(3600)

    async with app.worker(concurrency=1, lease=1.5):
        handle = await stuck.start_async()
        with anyio.fail_after(WAIT):
            await started.wait()
            await handle.cancel_async()
            with pytest.raises(pgflow.WorkflowCancelled):
                await handle.result_async()
    assert await handle.status_async() == "cancelled"


# -- G. input checked at start, before anything is written ---------------------------------------------------


def deep(n: int) -> Any:
    value: Any = []
    for _ in range(n):
        value = [value]
    return value


@ONE_SERVER  # the input is checked in Python before any statement: the same on any server
@pytest.mark.parametrize(("options", "args", "error", "words"), [
    ({}, ("\ud800",), pgflow.SerializationError, "not valid Unicode"),
    ({}, (deep(10_000),), pgflow.SerializationError, "nested too deeply"),
    ({"priority": "5"}, (), TypeError, "priority is an int"),
    ({"priority": 1.5}, (), TypeError, "priority is an int"),
    ({"priority": True}, (), TypeError, "priority is an int"),
    ({"priority": 2**31}, (), ValueError, "priority must be between"),
    ({"priority": 2**70}, (), ValueError, "priority must be between"),
    ({"delay": math.nan}, (), ValueError, "delay must be between"),
    ({"delay": math.inf}, (), ValueError, "delay must be between"),
    ({"delay": True}, (), TypeError, "delay is a number"),
    ({"delay": 1e12}, (), ValueError, "ten years"),
    ({"delay": -1}, (), ValueError, "delay must be between"),
    ({"queue": ""}, (), ValueError, "a queue name is a non-empty string"),
    ({"queue": "q\x00"}, (), ValueError, "a queue name must not contain NUL"),
    ({"id": "a\x00b"}, (), ValueError, "a workflow id must not contain NUL"),
    ({"id": "x" * 10_000}, (), ValueError, "a workflow id is at most 1000 bytes"),
])
@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_bad_start_input_raises_a_clear_error_before_anything_is_written(
    app: pgflow.App, options: dict[str, Any], args: tuple[Any, ...], error: type[Exception], words: str,
    kind: str,
) -> None:
    @app.workflow
    async def takes(value: Any = None) -> None: ...

    await app.migrate_async()

    async def start() -> None:
        starter = takes.with_options(**options)
        if kind == "sync":
            await anyio.to_thread.run_sync(lambda: starter.start(*args))
        else:
            await starter.start_async(*args)

    with pytest.raises(error, match=words):
        await start()
    assert await query(app.dsn, f'SELECT count(*) FROM "{app.schema}".workflows') == [(0,)]


def test_errors_that_waiting_cannot_mend_are_not_retried() -> None:
    assert unreachable(psycopg.OperationalError("connection refused"))
    assert unreachable(psycopg.errors.AdminShutdown())
    assert unreachable(psycopg.errors.TooManyConnections())
    assert not unreachable(psycopg.errors.ProgramLimitExceeded())
    assert not unreachable(psycopg.errors.UntranslatableCharacter())
    assert not unreachable(ValueError())


async def test_a_chunk_the_server_refuses_fails_its_own_workflow_and_no_other_in_its_batch(
    app: pgflow.App, dsn: str,
) -> None:
    # A trigger makes the server refuse one stream's chunks (whatever a real server may refuse that
    # the checks let through): the batch is split until the refused chunk is alone.
    await app.migrate_async()
    s = f'"{app.schema}"'
    await query(dsn, f"CREATE FUNCTION {s}.refuse() RETURNS trigger LANGUAGE plpgsql AS"
                     f" $$BEGIN IF (SELECT key FROM {s}.stream_ids WHERE id = NEW.stream_id) = 'poison' THEN"
                     " RAISE EXCEPTION 'refused by the server'; END IF; RETURN NEW; END$$")
    await query(dsn, f"CREATE TRIGGER refuse BEFORE INSERT ON {s}.chunks FOR EACH ROW EXECUTE FUNCTION {s}.refuse()")
    go = anyio.Event()  # every writer's first chunk rides in the same batch
    writer = stream_writer(app, go)

    async with app.worker(concurrency=16):
        poison = await writer.start_async("poison", 5)
        innocents = [await writer.start_async("fine", 20) for _ in range(7)]
        with anyio.fail_after(WAIT):
            while app.stats().runtimes == 0 or len(await app.list_workflows_async(status="running")) < 8:
                await anyio.sleep(0.02)
            go.set()
            assert [await h.result_async() for h in innocents] == [20] * 7
            with pytest.raises(pgflow.WorkflowFailed, match="refused by the server") as failed:
                await poison.result_async()
    assert failed.value.error_type.endswith("ChunkRefused")
    assert await query_attempts(app, poison.id) == 1  # failed once, not run again and again
    for h in innocents:
        assert await query_attempts(app, h.id) == 1
        assert [v async for v in h.stream_async("fine")] == list(range(20))


# -- H. the listener's reconnect backoff --------------------------------------------------------------------


async def test_the_listeners_reconnect_backoff_starts_afresh_after_each_good_connection(
        app: pgflow.App, dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    """Before: the backoff doubled on every reconnect for the life of the process (0.05, 0.1, 0.2, ...
    s), so each later outage lost pings for longer."""
    @app.workflow
    async def never_run() -> None: ...

    handle = await never_run.start_async()  # no worker: its result is waited on for ever
    caplog.set_level(logging.WARNING, logger="pgflow")
    runtime = app._client.runtime()

    async def connected_other_than(pid: int | None) -> int:
        while ((listener := runtime.signals.listener) is None or not listener.connected
               or listener.backend_pid in (None, pid)):
            await anyio.sleep(0.01)
        assert listener.backend_pid is not None
        return listener.backend_pid

    async with anyio.create_task_group() as tg:
        tg.start_soon(handle.result_async)  # something waits: the listener connects
        with anyio.fail_after(WAIT):
            pid = await connected_other_than(None)
            for _ in range(5):
                await query(dsn, "SELECT pg_terminate_backend(%s)", pid)
                pid = await connected_other_than(pid)
        tg.cancel_scope.cancel()
    delays = re.findall(r"listener connection lost .*?; reconnecting in ([\d.]+)s", caplog.text, re.S)
    assert len(delays) >= 5
    assert set(delays) == {"0.05"}, delays


# -- a lease its worker gave up --------------------------------------------------------------------------------


async def test_a_lease_its_worker_no_longer_runs_lapses_and_the_workflow_runs_again(
        app: pgflow.App, dsn: str, schema: str) -> None:
    """A worker that gave a workflow up but could not release it (the server dropped both its
    finish and its release: the fault suite cancelled them) still held the lease. Before: every
    heartbeat renewed every lease of the worker, so the workflow stayed running, run by nobody, for
    as long as the worker lived."""
    @app.workflow
    async def seven() -> int:
        return 7

    handle = await seven.with_options(delay=3600).start_async()
    async with app.worker(concurrency=2, lease=1.0) as worker:
        # What the failed release left behind: a lease of this worker's on a workflow it does not run.
        await query(dsn, f'UPDATE "{schema}".workflows SET status = \'running\', attempt = 1, due_at = now(),'
                         " lease_owner = %s, lease_expires_at = now() + interval '1 second' WHERE id = %s",
                    worker.id, handle.id)
        with anyio.fail_after(WAIT):
            assert await handle.result_async() == 7
