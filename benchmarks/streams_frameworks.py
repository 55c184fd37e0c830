"""The designs of streams.py that run on a framework: pgflow (and pgflow-off, the same without NOTIFY),
and DBOS Transact, each writer a worker running one workflow per stream, each reader its API's reader.
Also the no-op start-to-result scenario's worker and caller, which are pgflow's."""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

from benchmarks import harness
from benchmarks.streams_roles import STREAM_KEY, Reads, Tally, emit, next_line, stream_id

OFF_POLL = 0.1  # pgflow-off's poll_interval: its readers find chunks by polling
DBOS_POOL = int(os.environ.get("BENCH_DBOS_POOL", "32"))
DBOS_THREADS = int(os.environ.get("BENCH_DBOS_THREADS", "64"))
DBOS_DATABASE = "pgflow_bench_dbos"


# == pgflow ============================================================================================

# The writer's workflow bodies park on _go and count themselves in _tally (see Tally.all_finished).
_go: asyncio.Event | None = None
_tally = Tally()


async def stream_tokens(chunks: int) -> int:
    """The benchmark's workflow: wait for the orchestrator's go, then write ``chunks`` chunks flat out."""
    import pgflow

    assert _go is not None
    await _tally.produce(chunks, lambda value: pgflow.write_stream_async(STREAM_KEY, value),
                         lambda: pgflow.close_stream_async(STREAM_KEY), _go)
    return chunks


async def noop() -> None:
    return None


def pgflow_app(a: argparse.Namespace) -> Any:
    import pgflow

    off = a.design == "pgflow-off"
    app = pgflow.App(a.dsn, schema=a.schema, notify="off" if off else "buffered",
                     poll_interval=OFF_POLL if off else 1.0)
    app.workflow(name="bench.stream_tokens")(stream_tokens)
    app.workflow(name="bench.noop")(noop)
    return app


async def pgflow_writer(a: argparse.Namespace) -> None:
    global _go
    _go = asyncio.Event()
    app = pgflow_app(a)
    workflow = app.workflows["bench.stream_tokens"]
    try:
        handles = [await workflow.with_options(id=stream_id(a.run, i)).start_async(a.chunks)
                   for i in range(a.streams)]
        async with app.worker(concurrency=a.streams):
            cpu, t_go = await _tally.released(a.streams, _go, lambda: _tally.all_finished(a.streams))
            await asyncio.gather(*(h.result_async(timeout=a.timeout) for h in handles))
            stats = app.stats()
            extra = {"notifier_flushes": stats.notify_flushes, "batches": stats.stream_batches,
                     "batched_chunks": stats.stream_chunks}
        emit("result", **_tally.result(a.streams * a.chunks, cpu, t_go, **extra))
    finally:
        await app.close_async()


async def pgflow_reader(a: argparse.Namespace) -> None:
    app = pgflow_app(a)
    reads = Reads(a.streams, a.chunks)
    try:
        await app.migrate_async()

        async def consume(i: int) -> None:
            async for value in app.handle(stream_id(a.run, i)).stream_async(STREAM_KEY):
                reads.chunk(i, value)
            reads.end(i)

        result = await reads.follow([consume(i) for i in range(a.streams)])
        emit("result", **result, fetch_queries=app.stats().fetch_queries)
    finally:
        await app.close_async()


async def noop_worker(a: argparse.Namespace) -> None:
    app = pgflow_app(a)
    try:
        await app.migrate_async()
        async with app.worker(concurrency=16):
            emit("ready")
            await next_line()  # "stop" (EOF, when the orchestrator goes, ends the process)
    finally:
        await app.close_async()


async def noop_caller(a: argparse.Namespace) -> None:
    app = pgflow_app(a)
    workflow = app.workflows["bench.noop"]
    latencies: list[float] = []
    try:
        for n in range(a.noop_warmup + a.noop_runs):
            t0 = time.perf_counter()
            handle = await workflow.with_options(id=f"noop-{a.run}-{n}").start_async()
            await handle.result_async(timeout=30)
            if n >= a.noop_warmup:
                latencies.append(time.perf_counter() - t0)
        emit("result", latency=harness.latency_summary(latencies))
    finally:
        await app.close_async()


# == DBOS Transact =====================================================================================


def dbos_url(dsn: str) -> str:
    """The SQLAlchemy URL of the DBOS system database: the same server, the database DBOS_DATABASE."""
    if "://" in dsn:
        return harness.with_database(dsn, DBOS_DATABASE)
    import psycopg.conninfo
    import sqlalchemy as sa

    params = psycopg.conninfo.conninfo_to_dict(dsn)
    url = sa.engine.URL.create("postgresql", username=params.pop("user", None),
                               password=params.pop("password", None), host=params.pop("host", None),
                               port=int(params.pop("port")) if "port" in params else None,
                               database=DBOS_DATABASE, query={k: str(v) for k, v in params.items()
                                                              if k != "dbname"})
    return url.render_as_string(hide_password=False)


def dbos_threads() -> None:
    """DBOS's sync calls run on the loop's default executor: as many threads as its own executor; and its
    logging, which launching it sets up, down to warnings."""
    import logging
    from concurrent.futures import ThreadPoolExecutor

    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(DBOS_THREADS))
    for name in ("dbos", "sqlalchemy"):
        logging.getLogger(name).setLevel(logging.WARNING)


async def dbos_writer(a: argparse.Namespace) -> None:
    from dbos import DBOS, SetWorkflowID

    go, tally = asyncio.Event(), Tally()

    @DBOS.workflow(name="bench_dbos_tokens")
    async def dbos_tokens(chunks: int) -> int:
        await tally.produce(chunks, lambda value: DBOS.write_stream_async(STREAM_KEY, value),
                            lambda: DBOS.close_stream_async(STREAM_KEY), go)
        return chunks

    config: Any = {
        "name": "pgflow-bench", "system_database_url": dbos_url(a.dsn), "sys_db_pool_size": DBOS_POOL,
        "max_executor_threads": DBOS_THREADS, "log_level": "WARNING",
    }
    DBOS(config=config)
    try:
        await asyncio.to_thread(DBOS.launch)
        dbos_threads()
        handles = []
        for i in range(a.streams):
            with SetWorkflowID(stream_id(a.run, i)):
                handles.append(await DBOS.start_workflow_async(dbos_tokens, a.chunks))
        cpu, t_go = await tally.released(a.streams, go, lambda: tally.all_finished(a.streams))
        await asyncio.gather(*(h.get_result() for h in handles))
        emit("result", **tally.result(a.streams * a.chunks, cpu, t_go))
    finally:
        await asyncio.to_thread(DBOS.destroy)


async def dbos_reader(a: argparse.Namespace) -> None:
    from dbos import DBOSClient

    client = await asyncio.to_thread(lambda: DBOSClient(
        system_database_url=dbos_url(a.dsn), use_listen_notify=True, system_database_pool_size=DBOS_POOL))
    dbos_threads()
    reads = Reads(a.streams, a.chunks)
    try:
        async def consume(i: int) -> None:
            async for value in client.read_stream_async(stream_id(a.run, i), STREAM_KEY):
                reads.chunk(i, value)
            reads.end(i)

        emit("result", **await reads.follow([consume(i) for i in range(a.streams)]))
    finally:
        await asyncio.to_thread(client.destroy)
