"""Streams benchmark: 256 streams written flat out by one process and read to the end by another.

    python benchmarks/streams.py                       # every design, 3 repeats, medians
    python benchmarks/streams.py --designs pgflow,naive --repeats 1 --chunks 200
    python benchmarks/streams.py --dsn postgresql://postgres@127.0.0.1:5432/test

The orchestrator (this file run without --role) starts, for each design and repeat, a writer process
and a reader process (this same file with --role writer / --role reader), each on its own schema (or,
for DBOS, its own database) on the same server, dropped afterwards. The writer makes all 256 producers
ready and parked; the reader attaches to all 256 streams; then the orchestrator says "go" and the
writer writes every chunk flat out. Every chunk carries ``time.time()`` taken just before its write
call, so the reader computes write-to-read latency of every chunk. Subprocesses talk to the
orchestrator in ``@@ {json}`` lines on stdout and are always terminated in ``finally`` blocks; every
design run has a deadline (--timeout) after which it is reported as timed out, not waited for.

Designs:
  raw            the hand-written minimum of pgflow's design, the ceiling pgflow is measured against: the
                 writer process group-commits the chunks of all 256 producers in one multi-row INSERT per
                 batch (two batches in flight, each producer awaits its batch) whose statement also sends
                 one NOTIFY carrying the batch's stream ids; the reader process has one LISTEN connection
                 and answers every wake with one shared query for all pinged streams. No fencing, no
                 workflows, no framework.
  naive          one transaction per chunk: INSERT at an explicit position + pg_notify in the same
                 transaction (one statement), 256 asyncio writers over a 32-connection pool; the reader
                 has one LISTEN connection and runs one query per notified stream.
  pgflow         pgflow workflows run by one worker (concurrency=256), pgflow.write_stream_async; the
                 reader uses app.handle(id).stream_async("tokens"). Buffered notifier (the default).
  pgflow-off     the same with App(notify="off", poll_interval=0.1): readers find chunks by polling.
  dbos           DBOS Transact workflows with DBOS.write_stream_async, read with
                 DBOSClient.read_stream_async (LISTEN/NOTIFY on), in a database of its own.

It also measures an idle pgflow worker's start-to-result latency for a no-op workflow, the caller in
another process than the worker (--noop-runs sequential runs after a warm-up).

Results go to benchmarks/results/streams-<date>-pg<major>.json (raw runs, medians, targets); a table
is printed at the end. --profile DIR also records every writer and reader with py-spy (raw collapsed
stacks, idle frames included). BENCH_DBOS_POOL / BENCH_DBOS_THREADS (default 32 / 64) size DBOS's
system-database pool and executor threads.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import queue
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

from benchmarks.harness import (  # noqa: E402
    RunFailed,
    commit,
    fmt,
    latency_summary,
    median,
    postgres_cpu,
    self_cpu,
    server_info,
    versions,
)

DESIGNS = ["raw", "naive", "pgflow", "pgflow-off", "dbos"]
# Chunks per stream, chosen so one run of each design lasts roughly 5-15 s on a 2-core machine.
DEFAULT_CHUNKS = {"raw": 500, "naive": 100, "pgflow": 500, "pgflow-off": 500, "dbos": 20}
NAIVE_POOL = 32
DBOS_POOL = int(os.environ.get("BENCH_DBOS_POOL", "32"))
DBOS_THREADS = int(os.environ.get("BENCH_DBOS_THREADS", "64"))
DBOS_DATABASE = "pgflow_bench_dbos"
OFF_POLL = 0.1
STREAM_KEY = "tokens"
STREAM_PACKAGES = ("pgflow-durable", "dbos", "psycopg", "anyio")


# == small helpers, used by every role ===============================================================


def emit(event: str, **data: Any) -> None:
    """One line to the orchestrator."""
    sys.stdout.write("@@ " + json.dumps({"event": event, **data}) + "\n")
    sys.stdout.flush()


_lines: queue.Queue[str] = queue.Queue()


def watch_orchestrator(deadline: float) -> None:
    """In a role subprocess: read the orchestrator's lines, and exit at once if the orchestrator goes
    away (stdin closes) or the run overstays its deadline, so no process outlives a benchmark."""

    def read_stdin() -> None:
        for line in sys.stdin:
            _lines.put(line.strip())
        os._exit(2)

    def overstay() -> None:
        time.sleep(deadline)
        sys.stderr.write(f"role process still running after {deadline:.0f}s; exiting\n")
        os._exit(4)

    threading.Thread(target=read_stdin, daemon=True, name="bench-stdin").start()
    threading.Thread(target=overstay, daemon=True, name="bench-deadline").start()


async def next_line() -> str:
    return await asyncio.to_thread(_lines.get)


async def wait_for_go() -> None:
    line = await next_line()
    if line != "go":
        raise SystemExit(f"expected 'go' from the orchestrator, got {line!r}")


def stream_id(run: str, i: int) -> str:
    return f"bench-{run}-{i}"


class Tally:
    """What a writer process records: when the first write started and the last one returned."""

    def __init__(self) -> None:
        self.first_write = float("inf")
        self.last_write = 0.0
        self.last_close = 0.0
        self.started = 0
        self.finished = 0

    async def released(self, streams: int, go: asyncio.Event) -> tuple[float, float]:
        """For writers whose bodies count themselves (pgflow's, DBOS's workflows): once every body
        has started, say "ready", wait for the orchestrator's go, release the bodies and wait until
        all have finished. Returns the CPU seconds this process spent from the go, and when it was."""
        while self.started < streams:  # every workflow claimed and parked on the go event
            await asyncio.sleep(0.01)
        emit("ready")
        await wait_for_go()
        cpu0, t_go = self_cpu(), time.time()
        go.set()
        # Counted in the bodies rather than by a result waiter per workflow, which would load the
        # writer process (pgflow's result_async polls each one's row at its poll_interval).
        while self.finished < streams:
            await asyncio.sleep(0.005)
        return self_cpu() - cpu0, t_go

    def result(self, chunks: int, cpu: float, go: float, **extra: Any) -> dict[str, Any]:
        window = self.last_write - self.first_write
        return {
            "chunks": chunks, "first_write": self.first_write, "last_write": self.last_write,
            "last_close": self.last_close, "write_seconds": window,
            "chunks_per_s": chunks / window if window > 0 else float("nan"),
            "cpu_seconds": cpu, "cpu_share": cpu / max(1e-9, self.last_close - go), **extra,
        }


class Reads:
    """What a reader process records: every chunk's latency, and that each stream came whole and in order."""

    def __init__(self, streams: int, chunks: int) -> None:
        self.chunks = chunks
        self.latencies: list[float] = []
        self.counts = [0] * streams
        self.errors: list[str] = []
        self.last_end = 0.0

    def chunk(self, i: int, value: Any) -> None:
        now = time.time()
        ts, n = value[0], value[1]
        self.latencies.append(now - ts)
        if n != self.counts[i] and len(self.errors) < 20:
            self.errors.append(f"stream {i}: chunk {n} arrived at position {self.counts[i]}")
        self.counts[i] += 1

    def end(self, i: int) -> None:
        self.last_end = max(self.last_end, time.time())
        if self.counts[i] != self.chunks and len(self.errors) < 20:
            self.errors.append(f"stream {i}: {self.counts[i]} chunks read, {self.chunks} written")

    def result(self, cpu: float, ready: float) -> dict[str, Any]:
        return {
            "latency": latency_summary(self.latencies), "chunks_read": sum(self.counts),
            "last_end": self.last_end, "errors": self.errors, "cpu_seconds": cpu,
            "cpu_share": cpu / max(1e-9, self.last_end - ready),
        }


async def gather_all(tasks: list[asyncio.Task[Any]]) -> None:
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


# == naive: one transaction per chunk, INSERT + pg_notify ==============================================


def naive_names(schema: str) -> tuple[str, str]:
    return f'"{schema}".streams', f"{schema}_chunks"


async def naive_setup(dsn: str, schema: str) -> None:
    import psycopg

    table, _ = naive_names(schema)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await conn.execute(f'CREATE SCHEMA "{schema}"')
        await conn.execute(
            f"CREATE TABLE {table} (stream_id text NOT NULL, position integer NOT NULL, value bytea,"
            " PRIMARY KEY (stream_id, position))"
        )


async def naive_writer(a: argparse.Namespace) -> None:
    import msgspec
    from psycopg_pool import AsyncConnectionPool

    table, channel = naive_names(a.schema)
    sql = (f"WITH w AS (INSERT INTO {table} (stream_id, position, value) VALUES (%s, %s, %s)"
           " RETURNING stream_id) SELECT pg_notify(%s, stream_id) FROM w")
    tally, go = Tally(), asyncio.Event()
    async with AsyncConnectionPool(a.dsn, min_size=NAIVE_POOL, max_size=NAIVE_POOL, open=False,
                                   kwargs={"autocommit": True}) as pool:
        await pool.open(wait=True, timeout=30)

        async def produce(i: int) -> None:
            sid = stream_id(a.run, i)
            await go.wait()
            for n in range(a.chunks):
                ts = time.time()
                tally.first_write = min(tally.first_write, ts)
                async with pool.connection() as conn:
                    await conn.execute(sql, (sid, n, msgspec.json.encode([ts, n, "tok"]), channel))
                tally.last_write = max(tally.last_write, time.time())
            async with pool.connection() as conn:
                await conn.execute(sql, (sid, a.chunks, None, channel))
            tally.last_close = max(tally.last_close, time.time())

        tasks = [asyncio.create_task(produce(i)) for i in range(a.streams)]
        emit("ready")
        await wait_for_go()
        cpu0, t_go = self_cpu(), time.time()
        go.set()
        await gather_all(tasks)
        emit("result", **tally.result(a.streams * a.chunks, self_cpu() - cpu0, t_go))


async def naive_reader(a: argparse.Namespace) -> None:
    import msgspec
    import psycopg
    from psycopg_pool import AsyncConnectionPool

    table, channel = naive_names(a.schema)
    reads = Reads(a.streams, a.chunks)
    ids = [stream_id(a.run, i) for i in range(a.streams)]
    events = {sid: asyncio.Event() for sid in ids}
    listen = await psycopg.AsyncConnection.connect(a.dsn, autocommit=True)
    await listen.execute(f'LISTEN "{channel}"')

    async def listener() -> None:
        async for note in listen.notifies():
            event = events.get(note.payload)
            if event is not None:
                event.set()

    async with AsyncConnectionPool(a.dsn, min_size=10, max_size=10, open=False,
                                   kwargs={"autocommit": True}) as pool:
        await pool.open(wait=True, timeout=30)

        async def consume(i: int) -> None:
            sid, event, offset = ids[i], events[ids[i]], 0
            while True:
                event.clear()  # before the query: a notification during it makes us query again
                async with pool.connection() as conn:
                    cur = await conn.execute(
                        f"SELECT position, value FROM {table} WHERE stream_id = %s AND position >= %s"
                        " ORDER BY position", (sid, offset))
                    rows = await cur.fetchall()
                for position, value in rows:
                    if value is None:
                        reads.end(i)
                        return
                    reads.chunk(i, msgspec.json.decode(value))
                    offset = position + 1
                with contextlib.suppress(TimeoutError):  # the slow poll, in case a notification is lost
                    await asyncio.wait_for(event.wait(), 1.0)

        listen_task = asyncio.create_task(listener())
        ready_cpu, ready = self_cpu(), time.time()
        tasks = [asyncio.create_task(consume(i)) for i in range(a.streams)]
        await asyncio.sleep(1.0)
        emit("ready")
        try:
            await gather_all(tasks)
        finally:
            listen_task.cancel()
            await listen.close()
        emit("result", **reads.result(self_cpu() - ready_cpu, ready))


# == raw: the design's hand-written minimum =============================================================


async def raw_writer(a: argparse.Namespace) -> None:
    import msgspec
    from psycopg_pool import AsyncConnectionPool

    from benchmarks.raw_design import GroupWriter

    table, channel = naive_names(a.schema)
    sql = (f"WITH w AS (INSERT INTO {table} (stream_id, position, value)"
           " SELECT * FROM unnest(%b::text[], %b::int[], %b::bytea[]) RETURNING 1)"
           f" SELECT pg_notify('{channel}', p) FROM unnest(%s::text[]) AS p WHERE (SELECT count(*) FROM w) > 0")
    tally, go = Tally(), asyncio.Event()

    async with AsyncConnectionPool(a.dsn, min_size=2, max_size=2, open=False,
                                   kwargs={"autocommit": True}) as pool:
        await pool.open(wait=True, timeout=30)
        writer = GroupWriter(pool, sql, per_payload=200)

        async def produce(i: int) -> None:
            sid = stream_id(a.run, i)
            await go.wait()
            for n in range(a.chunks):
                ts = time.time()
                tally.first_write = min(tally.first_write, ts)
                await writer.write(sid, n, msgspec.json.encode([ts, n, "tok"]))
                tally.last_write = max(tally.last_write, time.time())
            await writer.write(sid, a.chunks, None)
            tally.last_close = max(tally.last_close, time.time())

        batching = asyncio.create_task(writer.run())
        tasks = [asyncio.create_task(produce(i)) for i in range(a.streams)]
        emit("ready")
        await wait_for_go()
        cpu0, t_go = self_cpu(), time.time()
        go.set()
        await gather_all(tasks)
        batching.cancel()
        emit("result", **tally.result(a.streams * a.chunks, self_cpu() - cpu0, t_go))


async def raw_reader(a: argparse.Namespace) -> None:
    import msgspec
    import psycopg

    table, channel = naive_names(a.schema)
    reads = Reads(a.streams, a.chunks)
    ids = [stream_id(a.run, i) for i in range(a.streams)]
    index = {sid: i for i, sid in enumerate(ids)}
    offsets = [0] * a.streams
    open_streams = set(range(a.streams))
    dirty: set[int] = set(range(a.streams))
    wake = asyncio.Event()
    listen = await psycopg.AsyncConnection.connect(a.dsn, autocommit=True)
    query = await psycopg.AsyncConnection.connect(a.dsn, autocommit=True)
    await listen.execute(f'LISTEN "{channel}"')
    fetch = (f"SELECT r.i, c.position, c.value FROM unnest(%b::text[], %b::int[]) WITH ORDINALITY"
             f" AS r(sid, start, i) JOIN LATERAL (SELECT position, value FROM {table}"
             " WHERE stream_id = r.sid AND position >= r.start ORDER BY position LIMIT 1000) c ON true"
             " ORDER BY r.i, c.position")

    async def listener() -> None:
        async for note in listen.notifies():
            dirty.update(index[sid] for sid in json.loads(note.payload) if sid in index)
            wake.set()

    async def fetcher() -> None:
        while open_streams:
            with contextlib.suppress(TimeoutError):  # the slow poll, in case a notification is lost
                await asyncio.wait_for(wake.wait(), 1.0)
            wake.clear()
            asked = sorted((dirty or open_streams) & open_streams)
            dirty.clear()
            if not asked:
                continue
            cur = await query.execute(fetch, ([ids[i] for i in asked], [offsets[i] for i in asked]), binary=True)
            got = [0] * len(asked)
            for ordinal, position, value in await cur.fetchall():
                i = asked[ordinal - 1]
                got[ordinal - 1] += 1
                if value is None:
                    reads.end(i)
                    open_streams.discard(i)
                    continue
                reads.chunk(i, msgspec.json.decode(value))
                offsets[i] = position + 1
            again = [asked[k] for k, n in enumerate(got) if n == 1000]
            if again:  # more than one page waits: look again at once
                dirty.update(again)
                wake.set()

    listen_task = asyncio.create_task(listener())
    ready_cpu, ready = self_cpu(), time.time()
    fetch_task = asyncio.create_task(fetcher())
    await asyncio.sleep(1.0)
    emit("ready")
    try:
        await fetch_task
    finally:
        listen_task.cancel()
        await listen.close()
        await query.close()
    emit("result", **reads.result(self_cpu() - ready_cpu, ready))


# == pgflow ============================================================================================

_go: asyncio.Event | None = None
_tally = Tally()


async def stream_tokens(chunks: int) -> int:
    """The benchmark's workflow: wait for the orchestrator's go, then write ``chunks`` chunks flat out."""
    import pgflow

    _tally.started += 1
    assert _go is not None
    await _go.wait()
    for n in range(chunks):
        ts = time.time()
        if ts < _tally.first_write:
            _tally.first_write = ts
        await pgflow.write_stream_async(STREAM_KEY, [ts, n, "tok"])
        _tally.last_write = max(_tally.last_write, time.time())
    await pgflow.close_stream_async(STREAM_KEY)
    _tally.last_close = max(_tally.last_close, time.time())
    _tally.finished += 1
    return chunks


async def noop() -> None:
    return None


def pgflow_app(a: argparse.Namespace) -> Any:
    import pgflow

    mode = "off" if a.design == "pgflow-off" else "buffered"
    poll = OFF_POLL if a.design == "pgflow-off" else 1.0
    app = pgflow.App(a.dsn, schema=a.schema, notify=mode, poll_interval=poll)
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
            cpu, t_go = await _tally.released(a.streams, _go)
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

        ready_cpu, ready = self_cpu(), time.time()
        tasks = [asyncio.create_task(consume(i)) for i in range(a.streams)]
        await asyncio.sleep(1.0)
        emit("ready")
        await gather_all(tasks)
        result = reads.result(self_cpu() - ready_cpu, ready)
        result["fetch_queries"] = app.stats().fetch_queries
        emit("result", **result)
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
        emit("result", latency=latency_summary(latencies))
    finally:
        await app.close_async()


# == DBOS Transact =====================================================================================


def dbos_url(dsn: str) -> str:
    """The DSN of the DBOS system database: the same server, the database DBOS_DATABASE."""
    import sqlalchemy as sa

    if "://" not in dsn:
        import psycopg.conninfo

        params = psycopg.conninfo.conninfo_to_dict(dsn)
        url = sa.engine.URL.create("postgresql", username=params.pop("user", None),
                                   password=params.pop("password", None), host=params.pop("host", None),
                                   port=int(params.pop("port")) if "port" in params else None,
                                   database=DBOS_DATABASE, query={k: str(v) for k, v in params.items()
                                                                  if k != "dbname"})
        return url.render_as_string(hide_password=False)
    url = sa.make_url(dsn).set(database=DBOS_DATABASE)
    return url.render_as_string(hide_password=False)


def dbos_silence() -> None:
    import logging

    for name in ("dbos", "sqlalchemy"):
        logging.getLogger(name).setLevel(logging.WARNING)


async def dbos_writer(a: argparse.Namespace) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from dbos import DBOS, SetWorkflowID

    go = asyncio.Event()
    tally = Tally()

    @DBOS.workflow(name="bench_dbos_tokens")
    async def dbos_tokens(chunks: int) -> int:
        tally.started += 1
        await go.wait()
        for n in range(chunks):
            ts = time.time()
            tally.first_write = min(tally.first_write, ts)
            await DBOS.write_stream_async(STREAM_KEY, [ts, n, "tok"])
            tally.last_write = max(tally.last_write, time.time())
        await DBOS.close_stream_async(STREAM_KEY)
        tally.last_close = max(tally.last_close, time.time())
        tally.finished += 1
        return chunks

    config: Any = {
        "name": "pgflow-bench", "system_database_url": dbos_url(a.dsn), "sys_db_pool_size": DBOS_POOL,
        "max_executor_threads": DBOS_THREADS, "log_level": "WARNING",
    }
    DBOS(config=config)
    try:
        await asyncio.to_thread(DBOS.launch)
        dbos_silence()
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(DBOS_THREADS))
        handles = []
        for i in range(a.streams):
            with SetWorkflowID(stream_id(a.run, i)):
                handles.append(await DBOS.start_workflow_async(dbos_tokens, a.chunks))
        cpu, t_go = await tally.released(a.streams, go)
        await asyncio.gather(*(h.get_result() for h in handles))
        emit("result", **tally.result(a.streams * a.chunks, cpu, t_go))
    finally:
        await asyncio.to_thread(DBOS.destroy)


async def dbos_reader(a: argparse.Namespace) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from dbos import DBOSClient

    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(DBOS_THREADS))
    client = await asyncio.to_thread(lambda: DBOSClient(
        system_database_url=dbos_url(a.dsn), use_listen_notify=True, system_database_pool_size=DBOS_POOL))
    dbos_silence()
    reads = Reads(a.streams, a.chunks)
    try:
        async def consume(i: int) -> None:
            async for value in client.read_stream_async(stream_id(a.run, i), STREAM_KEY):
                reads.chunk(i, value)
            reads.end(i)

        ready_cpu, ready = self_cpu(), time.time()
        tasks = [asyncio.create_task(consume(i)) for i in range(a.streams)]
        await asyncio.sleep(1.0)
        emit("ready")
        await gather_all(tasks)
        emit("result", **reads.result(self_cpu() - ready_cpu, ready))
    finally:
        await asyncio.to_thread(client.destroy)


ROLES: dict[tuple[str, str], Callable[[argparse.Namespace], Any]] = {
    ("writer", "raw"): raw_writer, ("reader", "raw"): raw_reader,
    ("writer", "naive"): naive_writer, ("reader", "naive"): naive_reader,
    ("writer", "dbos"): dbos_writer, ("reader", "dbos"): dbos_reader,
    **{("writer", d): pgflow_writer for d in ("pgflow", "pgflow-off")},
    **{("reader", d): pgflow_reader for d in ("pgflow", "pgflow-off")},
    ("noop-worker", "pgflow"): noop_worker, ("noop-caller", "pgflow"): noop_caller,
}


# == the orchestrator ==================================================================================


class Child:
    """A role subprocess: its stdout carries ``@@`` event lines, its stderr goes to a log file."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process, log: Path) -> None:
        self.name, self.proc, self.log = name, proc, log
        self.profiler: asyncio.subprocess.Process | None = None

    async def expect(self, event: str, deadline: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RunFailed(f"timed out waiting for {self.name} to report {event!r}")
            try:
                line = await asyncio.wait_for(self.proc.stdout.readline(), left)
            except TimeoutError:
                raise RunFailed(f"timed out waiting for {self.name} to report {event!r}") from None
            if not line:
                await self.proc.wait()
                raise RunFailed(f"{self.name} exited with code {self.proc.returncode} before reporting "
                                f"{event!r}:\n{self.tail()}")
            text = line.decode(errors="replace").rstrip()
            if not text.startswith("@@ "):
                continue
            message = json.loads(text[3:])
            if message["event"] == event:
                return message  # type: ignore[no-any-return]

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def stop(self) -> None:
        """Terminate (then kill) the process if it is still running."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()
        if self.profiler is not None:
            try:  # py-spy writes its file when the profiled process exits
                await asyncio.wait_for(self.profiler.wait(), 30)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.profiler.kill()
                await self.profiler.wait()


class Orchestrator:
    def __init__(self, a: argparse.Namespace, dsn: str, logdir: Path, postmaster: int | None) -> None:
        self.a, self.dsn, self.logdir, self.postmaster = a, dsn, logdir, postmaster

    async def spawn(self, role: str, design: str, schema: str, run: str, chunks: int,
                    profile_name: str | None = None) -> Child:
        a = self.a
        log = self.logdir / f"{run}-{role}.log"
        args = [sys.executable, str(Path(__file__).resolve()), "--role", role, "--design", design,
                "--dsn", self.dsn, "--schema", schema, "--run", run, "--streams", str(a.streams),
                "--chunks", str(chunks), "--timeout", str(a.timeout), "--noop-runs", str(a.noop_runs),
                "--noop-warmup", str(a.noop_warmup)]
        with open(log, "wb") as err:
            proc = await asyncio.create_subprocess_exec(
                *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=err,
                cwd=str(ROOT), limit=1 << 20)
        child = Child(f"{design} {role}", proc, log)
        if a.profile and profile_name:
            out = Path(a.profile) / f"{profile_name}-{role}.txt"
            out.parent.mkdir(parents=True, exist_ok=True)
            beside = Path(sys.executable).parent / "py-spy"
            pyspy = str(beside) if beside.exists() else (shutil.which("py-spy") or "py-spy")
            child.profiler = await asyncio.create_subprocess_exec(
                pyspy, "record", "--pid", str(proc.pid), "--format", "raw", "--rate", "200",
                "--nonblocking", "-o", str(out), stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL)
        return child

    # -- the streams scenario ---------------------------------------------------------------------------

    async def stream_run(self, design: str, repeat: int) -> dict[str, Any]:
        a = self.a
        chunks = a.chunks or DEFAULT_CHUNKS[design]
        run = f"{design.replace('-', '')}{repeat}x{uuid.uuid4().hex[:6]}"
        schema = f"bench_{run}"
        record: dict[str, Any] = {"design": design, "repeat": repeat, "streams": a.streams,
                                  "chunks_per_stream": chunks, "loadavg_before": os.getloadavg()[0]}
        deadline = time.monotonic() + a.timeout
        children: list[Child] = []
        try:
            if design == "dbos":
                try:
                    import dbos  # noqa: F401
                except ImportError as exc:
                    raise RunFailed(f"DBOS Transact is not installed (pip install 'pgflow-durable[bench]'): {exc}") from None
            await self.setup(design, schema)
            writer = await self.spawn("writer", design, schema, run, chunks, f"{design}-{repeat}")
            children.append(writer)
            await writer.expect("ready", deadline)
            reader = await self.spawn("reader", design, schema, run, chunks, f"{design}-{repeat}")
            children.append(reader)
            await reader.expect("ready", deadline)
            pg0 = postgres_cpu(self.postmaster)
            writer.send("go")
            w = await writer.expect("result", deadline)
            r = await reader.expect("result", deadline)
            pg1 = postgres_cpu(self.postmaster)
            total = r["last_end"] - w["first_write"]
            record.update(
                ok=not r["errors"] and r["chunks_read"] == a.streams * chunks,
                chunks_per_s=w["chunks_per_s"], write_seconds=w["write_seconds"],
                p50_ms=r["latency"]["p50_ms"], p99_ms=r["latency"]["p99_ms"],
                completion_s=total, writer=w, reader=r,
                postgres_cpu_share=None if pg0 is None or pg1 is None else (pg1 - pg0) / total,
            )
            if r["errors"]:
                record["error"] = "; ".join(r["errors"][:5])
        except Exception as exc:  # noqa: BLE001 - one failed run is reported, the others still run
            record.update(ok=False, error=str(exc) if isinstance(exc, RunFailed) else f"{type(exc).__name__}: {exc}")
        finally:
            for child in reversed(children):
                await child.stop()
            with contextlib.suppress(Exception):
                await self.teardown(design, schema)
            record["loadavg_after"] = os.getloadavg()[0]
        return record

    async def setup(self, design: str, schema: str) -> None:
        if design in ("naive", "raw"):
            await naive_setup(self.dsn, schema)
        elif design == "dbos":
            await self.drop_dbos_database()

    async def teardown(self, design: str, schema: str) -> None:
        import psycopg

        if design == "dbos":
            await self.drop_dbos_database()
            return
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')

    async def drop_dbos_database(self) -> None:
        import psycopg

        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            await conn.execute(f'DROP DATABASE IF EXISTS "{DBOS_DATABASE}" WITH (FORCE)')

    # -- the no-op latency scenario ---------------------------------------------------------------------

    async def noop_run(self) -> dict[str, Any]:
        a = self.a
        run = f"noop{uuid.uuid4().hex[:6]}"
        schema = f"bench_{run}"
        deadline = time.monotonic() + a.timeout
        children: list[Child] = []
        record: dict[str, Any] = {"runs": a.noop_runs, "warmup": a.noop_warmup}
        try:
            worker = await self.spawn("noop-worker", "pgflow", schema, run, 0, "noop")
            children.append(worker)
            await worker.expect("ready", deadline)
            await asyncio.sleep(0.5)
            caller = await self.spawn("noop-caller", "pgflow", schema, run, 0, "noop")
            children.append(caller)
            result = await caller.expect("result", deadline)
            record.update(ok=True, **result["latency"])
            worker.send("stop")
        except Exception as exc:  # noqa: BLE001
            record.update(ok=False, error=str(exc) if isinstance(exc, RunFailed) else f"{type(exc).__name__}: {exc}")
        finally:
            for child in reversed(children):
                await child.stop()
            with contextlib.suppress(Exception):
                await self.teardown("pgflow", schema)
        return record


def summarize(runs: list[dict[str, Any]], designs: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for design in designs:
        ok = [r for r in runs if r["design"] == design and r.get("ok")]
        mine = [r for r in runs if r["design"] == design]
        summary[design] = {
            "runs_ok": len(ok), "runs": len(mine),
            "chunks_per_stream": mine[0]["chunks_per_stream"] if mine else None,
            "chunks_per_s": median([r["chunks_per_s"] for r in ok]),
            "p50_ms": median([r["p50_ms"] for r in ok]),
            "p99_ms": median([r["p99_ms"] for r in ok]),
            "completion_s": median([r["completion_s"] for r in ok]),
            "writer_cpu_share": median([r["writer"]["cpu_share"] for r in ok]),
            "reader_cpu_share": median([r["reader"]["cpu_share"] for r in ok]),
            "postgres_cpu_share": median([r["postgres_cpu_share"] for r in ok]),
            "errors": [r["error"] for r in mine if r.get("error")],
        }
    return summary


def ratio(runs: list[dict[str, Any]], num: str, den: str) -> float | None:
    """Median over repeats of num's chunks/s divided by den's, measured in the same repeat."""
    by = {(r["design"], r["repeat"]): r for r in runs if r.get("ok")}
    repeats = sorted({r["repeat"] for r in runs})
    values = [by[(num, k)]["chunks_per_s"] / by[(den, k)]["chunks_per_s"]
              for k in repeats if (num, k) in by and (den, k) in by]
    return median(values)


def targets(runs: list[dict[str, Any]], summary: dict[str, Any], noop: dict[str, Any] | None) -> list[dict[str, Any]]:
    out = []

    def target(name: str, value: float | None, ok: Callable[[float], bool], unit: str) -> None:
        out.append({"target": name, "value": value, "unit": unit,
                    "status": "N/A" if value is None else ("PASS" if ok(value) else "MISS")})

    if "pgflow" in summary and "raw" in summary:
        target("pgflow chunks/s >= 70% of raw", ratio(runs, "pgflow", "raw"), lambda v: v >= 0.7, "x")
        raw_p99 = summary["raw"]["p99_ms"]
        target("pgflow p99 <= 1.5x raw's", None if not raw_p99 else summary["pgflow"]["p99_ms"] / raw_p99,
               lambda v: v <= 1.5, "x")
    if "pgflow" in summary and "naive" in summary:
        target("pgflow chunks/s >= 10x naive", ratio(runs, "pgflow", "naive"), lambda v: v >= 10, "x")
    if "pgflow" in summary:
        target("pgflow p99 write-to-read <= 100 ms", summary["pgflow"]["p99_ms"], lambda v: v <= 100, "ms")
    if "pgflow" in summary and "dbos" in summary:
        target("pgflow chunks/s >= 20x DBOS", ratio(runs, "pgflow", "dbos"), lambda v: v >= 20, "x")
    if noop is not None:
        target("no-op start-to-result p50 <= 4 ms", noop.get("p50_ms") if noop.get("ok") else None,
               lambda v: v <= 4, "ms")
        target("no-op start-to-result p99 <= 8 ms", noop.get("p99_ms") if noop.get("ok") else None,
               lambda v: v <= 8, "ms")
    return out


def print_report(report: dict[str, Any]) -> None:
    s = report["server"]
    print(f"\npgflow streams benchmark, {report['date']}: {report['streams']} streams, "
          f"{report['repeats']} repeat(s), medians; PostgreSQL {s.get('server_version')} "
          f"({report['server_kind']}), {report['machine']['cpus']} CPUs, "
          f"pgflow {report['versions'].get('pgflow_commit')}, dbos {report['versions'].get('dbos')}")
    head = (f"{'design':<14}{'K':>6}{'chunks/s':>11}{'p50 ms':>9}{'p99 ms':>9}{'total s':>9}"
            f"{'writer':>8}{'reader':>8}{'pg cpu':>8}  ok")
    print(head)
    print("-" * len(head))
    for design, d in report["summary"].items():
        print(f"{design:<14}{fmt(d['chunks_per_stream'], 'd'):>6}{fmt(d['chunks_per_s'], ',.0f'):>11}"
              f"{fmt(d['p50_ms'], '.1f'):>9}{fmt(d['p99_ms'], '.1f'):>9}{fmt(d['completion_s'], '.2f'):>9}"
              f"{fmt(d['writer_cpu_share'], '.0%'):>8}{fmt(d['reader_cpu_share'], '.0%'):>8}"
              f"{fmt(d['postgres_cpu_share'], '.0%'):>8}  {d['runs_ok']}/{d['runs']}")
        for error in d["errors"][:3]:
            print(f"    error: {error.splitlines()[0][:150]}")
    print("(writer/reader/pg cpu: CPU seconds per wall second of the run; 100% = one core of the machine's "
          f"{report['machine']['cpus']})")
    noop = report.get("noop")
    if noop:
        if noop.get("ok"):
            print(f"\nno-op workflow, start -> result from another process ({noop['runs']} runs): "
                  f"p50 {noop['p50_ms']:.1f} ms, p99 {noop['p99_ms']:.1f} ms, max {noop['max_ms']:.1f} ms")
        else:
            print(f"\nno-op workflow: failed: {noop.get('error')}")
    if report.get("warning"):
        print(f"\nWARNING: {report['warning']}")
    print("\ntargets:")
    for t in report["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:.1f}{t['unit']}"
        print(f"  {t['status']:<5} {t['target']:<40} {value}")


async def orchestrate(a: argparse.Namespace) -> int:
    designs = [d.strip() for d in a.designs.split(",") if d.strip()]
    unknown = [d for d in designs if d not in DESIGNS]
    if unknown:
        raise SystemExit(f"unknown design(s) {unknown}; choose from {','.join(DESIGNS)}")
    server_kind = "given dsn"
    dsn = a.dsn or os.environ.get("PGFLOW_DSN")
    embedded_app = None
    if not dsn:
        import pgflow

        embedded_app = pgflow.App()  # keeps the embedded server alive (registered) while we run
        dsn = await asyncio.to_thread(lambda: embedded_app.dsn)
        server_kind = "embedded"
    info = await asyncio.to_thread(server_info, dsn)
    measured = versions(STREAM_PACKAGES)
    logdir = Path(tempfile.mkdtemp(prefix="pgflow-bench-"))
    orch = Orchestrator(a, dsn, logdir, info.get("postmaster_pid"))
    print(f"server: PostgreSQL {info['server_version']} ({server_kind}); logs in {logdir}", flush=True)
    runs: list[dict[str, Any]] = []
    noop = None
    try:
        for repeat in range(a.repeats):
            for design in designs:
                record = await orch.stream_run(design, repeat)
                runs.append(record)
                if record.get("ok"):
                    print(f"  [{repeat + 1}/{a.repeats}] {design:<14} {record['chunks_per_s']:>9,.0f} chunks/s"
                          f"  p50 {record['p50_ms']:7.1f} ms  p99 {record['p99_ms']:7.1f} ms"
                          f"  total {record['completion_s']:6.2f} s  (load {record['loadavg_before']:.1f})",
                          flush=True)
                else:
                    print(f"  [{repeat + 1}/{a.repeats}] {design:<14} FAILED: {record.get('error')}", flush=True)
        if a.noop_runs > 0:
            noop = await orch.noop_run()
    finally:
        if embedded_app is not None:
            embedded_app.close()
    summary = summarize(runs, designs)
    report = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "server": info, "server_kind": server_kind, "versions": measured, "streams": a.streams,
        "repeats": a.repeats,
        "settings": {"naive_pool": NAIVE_POOL, "dbos_pool": DBOS_POOL, "dbos_threads": DBOS_THREADS,
                     "pgflow_off_poll_interval": OFF_POLL, "chunks_override": a.chunks},
        "summary": summary, "noop": noop, "runs": runs,
    }
    report["targets"] = targets(runs, summary, noop)
    if commit() != measured.get("pgflow_commit"):
        report["warning"] = (f"the pgflow checkout changed during the run (from {measured.get('pgflow_commit')} "
                             f"to {commit()}): the runs did not all measure the same code")
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    major = str(info.get("server_version") or "").split(".")[0].split()[0]
    name = f"streams-{dt.date.today().isoformat()}" + (f"-pg{major}" if major.isdigit() else "") + ".json"
    out = Path(a.output) if a.output else results / name
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print_report(report)
    print(f"\nwrote {out}")
    return 0 if all(r.get("ok") for r in runs) else 1


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--designs", default=",".join(DESIGNS), help=f"comma list from {','.join(DESIGNS)}")
    p.add_argument("--streams", type=int, default=256, help="concurrent streams (default 256)")
    p.add_argument("--chunks", type=int, default=None,
                   help="chunks per stream for every design (default per design: "
                   + ", ".join(f"{k} {v}" for k, v in DEFAULT_CHUNKS.items()) + ")")
    p.add_argument("--repeats", type=int, default=3, help="repeats of every design; medians are reported")
    p.add_argument("--dsn", default=None, help="server to use (default $PGFLOW_DSN, else the embedded PG18)")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline of one design run, seconds")
    p.add_argument("--noop-runs", type=int, default=200, help="sequential no-op workflows timed (0: skip)")
    p.add_argument("--noop-warmup", type=int, default=20, help=argparse.SUPPRESS)
    p.add_argument("--output", default=None,
                   help="results file (default benchmarks/results/streams-<date>-pg<major>.json)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="record every writer/reader with py-spy (raw collapsed stacks) into DIR")
    # Internal: how the orchestrator starts its subprocesses.
    p.add_argument("--role", default=None, help=argparse.SUPPRESS)
    p.add_argument("--design", default=None, help=argparse.SUPPRESS)
    p.add_argument("--schema", default=None, help=argparse.SUPPRESS)
    p.add_argument("--run", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.role is None:
        return asyncio.run(orchestrate(a))
    role = ROLES.get((a.role, a.design))
    if role is None:
        raise SystemExit(f"no role {a.role!r} for design {a.design!r}")
    watch_orchestrator(a.timeout + 30)
    asyncio.run(role(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
