"""pgflow behind a real pgbouncer in transaction mode: the queries, claims and batches through it
(``dsn``), the LISTEN and the fleet's service locks on the server directly (``listen_dsn``).

pgbouncer (tests/pgbouncer.py) refuses ``options`` (pgflow's connect-time settings) and runs each
transaction on any of its server sessions, where a statement prepared on another is unknown: each
core path running here shows pgflow relies on no session state on ``dsn``.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.to_thread
import pytest

import pgflow

from .pgbouncer import SKIP_REASON, Pgbouncer, binary
from .processes import Processes, result_of, wait_until

pytestmark = pytest.mark.skipif(binary() is None, reason=SKIP_REASON)


@pytest.fixture
def bouncer(dsn: str) -> Iterator[Pgbouncer]:
    with Pgbouncer(dsn) as running:
        yield running


def pooled_app(dsn: str, schema: str, bouncer: Pgbouncer, **settings: Any) -> pgflow.App:
    return pgflow.App(bouncer.dsn(dsn), listen_dsn=dsn, schema=schema, poll_interval=0.5, **settings)


@pytest.mark.anyio
async def test_the_core_paths_run_through_a_transaction_mode_pgbouncer(
        dsn: str, schema: str, bouncer: Pgbouncer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="pgflow")
    async with pooled_app(dsn, schema, bouncer, suspend_after=0.5) as app:
        @app.step(name="pgb.double")
        async def double(x: int) -> int:
            return x * 2

        @app.workflow(name="pgb.flow")
        async def flow(n: int) -> int:
            total = 0
            for i in range(n):
                total += await double(i)
                await pgflow.write_stream_async("tokens", f"t{i}")
            await pgflow.close_stream_async("tokens")
            await pgflow.set_event_async("progress", 1.0)
            await pgflow.sleep_async(1.0)  # longer than suspend_after: queued again, claimed again
            approval = await pgflow.recv_async("approval", timeout=60)
            return total + int(approval["extra"])

        @app.workflow(name="pgb.forever")
        async def forever() -> None:
            await pgflow.sleep_async(3600)

        handles = await flow.start_many_async([(5,), (3,)])
        doomed = await forever.start_async()
        async with app.worker(concurrency=8):
            tokens = [token async for token in handles[0].stream_async("tokens")]
            assert tokens == [f"t{i}" for i in range(5)]
            assert await handles[1].get_event_async("progress", timeout=60) == 1.0
            for handle in handles:
                await handle.send_async("approval", {"extra": 100}, idempotency_key="once")
                await handle.send_async("approval", {"extra": 100}, idempotency_key="once")  # no second
            assert await handles[0].result_async(timeout=60) == 2 * (0 + 1 + 2 + 3 + 4) + 100
            assert await handles[1].result_async(timeout=60) == 2 * (0 + 1 + 2) + 100
            await handle_cancelled(doomed)

        # Management calls, through the pooler too.
        listed = await app.list_workflows_async(name="pgb.flow")
        assert sorted(record.id for record in listed) == sorted(handle.id for handle in handles)
        info = await handles[0].info_async()
        assert [step.name for step in info.steps if step.name == "pgb.double"] == ["pgb.double"] * 5
        assert [position for position, _ in [item async for item in handles[0].stream_items_async("tokens")]] \
            == list(range(5))
        await doomed.resume_async()
        assert await doomed.status_async() == "queued"
    assert not [r for r in caplog.records if "lack settings" in r.getMessage()]  # connect_query made them


async def handle_cancelled(handle: pgflow.Handle[Any]) -> None:
    with anyio.fail_after(60):
        while await handle.status_async() != "queued":  # asleep: given back to the queue
            await anyio.sleep(0.05)
    await handle.cancel_async()
    with pytest.raises(pgflow.WorkflowCancelled):
        await handle.result_async(timeout=60)


def test_the_sync_api_runs_through_a_transaction_mode_pgbouncer(dsn: str, schema: str, bouncer: Pgbouncer) -> None:
    with pooled_app(dsn, schema, bouncer) as app:
        @app.workflow(name="pgb.sync")
        def echo(text: str) -> str:
            pgflow.write_stream("echo", text)
            return text.upper()

        handle = echo.start("hello")

        async def serve() -> None:
            async with app.worker(concurrency=2):
                await anyio.to_thread.run_sync(lambda: handle.result(timeout=60))

        anyio.run(serve)
        assert handle.result(timeout=10) == "HELLO"
        assert list(handle.stream("echo")) == ["hello"]
        assert handle.status() == "succeeded"
        assert [record.id for record in app.list_workflows(name="pgb.sync")] == [handle.id]


@pytest.mark.anyio
async def test_a_pgbouncer_dsn_without_listen_dsn_is_refused_with_what_to_do(
        dsn: str, schema: str, bouncer: Pgbouncer) -> None:
    async with pgflow.App(bouncer.dsn(dsn), schema=schema) as app:
        @app.workflow(name="pgb.never")
        async def never() -> None:
            pass

        with pytest.raises(pgflow.ConfigurationError, match="listen_dsn"):
            await never.start_async()


def test_listen_dsn_without_a_dsn_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PGFLOW_DSN", raising=False)
    monkeypatch.setenv("PGFLOW_LISTEN_DSN", "postgresql://somewhere/db")
    with pytest.raises(pgflow.ConfigurationError, match="no dsn"):
        pgflow.App()


@pytest.mark.anyio
async def test_settings_the_pooler_does_not_make_are_named_in_a_warning(
        dsn: str, schema: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="pgflow")
    with Pgbouncer(dsn, connect_query=None) as bare:
        async with pooled_app(dsn, schema, bare) as app:
            @app.workflow(name="pgb.bare")
            async def bare_flow() -> int:
                return 1

            handle = await bare_flow.start_async()
            async with app.worker(concurrency=1):
                assert await handle.result_async(timeout=60) == 1
    warned = [r.getMessage() for r in caplog.records if "lack settings" in r.getMessage()]
    assert len(warned) == 1
    assert "SET search_path = 'pg_catalog, pg_temp'" in warned[0]
    assert "SET idle_in_transaction_session_timeout = 10000" in warned[0]


@pytest.mark.anyio
async def test_the_fleets_services_have_one_leader_behind_a_pgbouncer_with_one_server_session(
        dsn: str, schema: str) -> None:
    """The services' advisory locks are session locks: taken through a pooler, two workers whose
    tries reach the same server session would both win. They go to ``listen_dsn``."""
    with Pgbouncer(dsn, pool_size=1) as narrow:
        async with pooled_app(dsn, schema, narrow) as one, pooled_app(dsn, schema, narrow) as two:
            async with one.worker(concurrency=1, lease=1.0) as first, two.worker(concurrency=1, lease=1.0) as second:
                with anyio.fail_after(60):
                    while len(first.leading | second.leading) < 3:
                        await anyio.sleep(0.05)
                assert not first.leading & second.leading


@pytest.mark.anyio
async def test_a_worker_whose_pgbouncer_restarts_goes_on_claiming_and_finishing(
        dsn: str, schema: str, bouncer: Pgbouncer) -> None:
    async with pooled_app(dsn, schema, bouncer, suspend_after=0.5) as app:
        @app.workflow(name="pgb.nap")
        async def nap(i: int) -> int:
            await pgflow.sleep_async(2.0)
            return i

        before = await nap.start_many_async([(i,) for i in range(10)])
        async with app.worker(concurrency=16):
            with anyio.fail_after(60):  # every one asleep, queued again: the worker holds nothing
                while not all([await handle.status_async() == "queued" for handle in before]):
                    await anyio.sleep(0.05)
            await anyio.to_thread.run_sync(bouncer.restart)
            after = await nap.start_many_async([(i,) for i in range(10, 20)])
            results = [await handle.result_async(timeout=90) for handle in before + after]
            assert results == list(range(20))
            bouncer.kill()  # down for a while, mid-work
            await anyio.to_thread.run_sync(bouncer.start)
            more = await nap.start_many_async([(i,) for i in range(20, 25)])
            assert [await handle.result_async(timeout=90) for handle in more] == list(range(20, 25))
    assert bouncer.starts == 3


@pytest.mark.anyio
async def test_statements_run_many_times_are_not_prepared_on_the_pooled_connections(
        dsn: str, schema: str, caplog: pytest.LogCaptureFixture) -> None:
    """psycopg prepares a statement it runs a few times; through transaction pooling the next run
    may reach a server session that never saw it ("prepared statement does not exist")."""
    caplog.set_level(logging.WARNING)
    with Pgbouncer(dsn, pool_size=3) as bouncer, pooled_app(dsn, schema, bouncer) as app:
        @app.workflow(name="pgb.many")
        async def many(i: int) -> int:
            return i

        async with app.worker(concurrency=4):
            for i in range(12):  # the same statements, well past psycopg's prepare_threshold (5)
                assert await (await many.start_async(i)).result_async(timeout=60) == i
    assert not [r for r in caplog.records if "prepared statement" in r.getMessage()]


def test_a_worker_process_whose_pgbouncer_is_killed_and_restarted_finishes_everything(
        dsn: str, schema: str, bouncer: Pgbouncer, worker_env: dict[str, str], procs: Processes) -> None:
    env = {**worker_env, "PGFLOW_DSN": bouncer.dsn(dsn), "PGFLOW_LISTEN_DSN": dsn}
    worker = procs.worker("pooled-worker", "tests.apps.pooled:app", env, concurrency=8, grace=5.0)
    with pooled_app(dsn, schema, bouncer) as app:
        first = [app.start_by_name("pooled.nap", i) for i in range(8)]
        wait_until(lambda: all(handle.status() == "queued" for handle in first) and
                   all(handle.info().steps for handle in first), "the first naps", procs, worker)
        bouncer.kill()
        time.sleep(1.0)  # an outage of a second, not an event to wait for: the worker meets it
        bouncer.start()
        second = [app.start_by_name("pooled.nap", i) for i in range(8, 16)]
        assert [result_of(handle, procs) for handle in first + second] == [2 * i * i for i in range(16)]
        assert [list(handle.stream("done")) for handle in second] == [[i] for i in range(8, 16)]
    assert worker.alive(), procs.logs()
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit() == 0, procs.logs()


@pytest.mark.anyio
async def test_free_stream_appends_run_through_a_transaction_mode_pgbouncer(
        dsn: str, schema: str, bouncer: Pgbouncer, caplog: pytest.LogCaptureFixture) -> None:
    """The group commit of free-stream appends sends its transaction in pipelines (BEGIN with the locks,
    COMMIT with the writes; or all of it in one round trip on what the server process knows), unnamed
    through the pooler: a producer's appends, its duplicate and its gap, then a live reader's read."""
    from pgflow.durable_streams import asgi_app

    from .test_durable_streams import JSON, call

    caplog.set_level(logging.WARNING, logger="pgflow")
    async with pooled_app(dsn, schema, bouncer) as app:
        asgi = asgi_app(app)
        assert (await call(asgi, "PUT", "/pooled", JSON))[0] == 201

        def producer(seq: int) -> list[tuple[str, str]]:
            return [*JSON, ("producer-id", "p"), ("producer-epoch", "0"), ("producer-seq", str(seq))]

        for seq in range(5):
            assert (await call(asgi, "POST", "/pooled", producer(seq), f"[{seq}]".encode()))[0] == 200
        assert (await call(asgi, "POST", "/pooled", producer(4), b"[4]"))[0] == 204  # a duplicate
        assert (await call(asgi, "POST", "/pooled", producer(9), b"[9]"))[0] == 409  # a gap
        status, _, body = await call(asgi, "GET", "/pooled")
        assert status == 200 and body == b"[0,1,2,3,4]"
        store = await app._internals().runtime().store()
        assert store.free_streams.batches["known"] >= 4  # (the first batch read under its locks)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
