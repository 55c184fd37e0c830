"""Streams the way an application runs them: a worker process of its own, and a caller process that
starts the workflows and follows each stream as soon as it has started it. No go barrier: the clock
runs from the first start to the last chunk read.

    python -m benchmarks streams --shape user            # both designs, both ways of starting, 3 repeats
    python -m benchmarks.streams_user --designs pgflow --starts many --repeats 1
    python -m benchmarks.streams_user --worker-processes 2   # pgflow's worker as `--processes 2`

Designs:
  pgflow  ``pgflow worker benchmarks.streams_user:app --concurrency N`` at its default log level (INFO),
          and a caller that starts N ``bench.user_stream`` workflows (one by one with ``start_async``,
          or all at once with ``start_many_async``) and reads each with ``stream_async``.
  raw     the hand-written minimum of the same design: the caller inserts a job row per stream (one
          statement per start, or one for all), with a NOTIFY in the statement; a worker process
          LISTENs, claims new jobs (FOR UPDATE SKIP LOCKED) and runs a producer per job whose chunks
          are group-committed (one multi-row INSERT per batch, two in flight, one NOTIFY naming the
          batch's streams); the caller reads with one LISTEN connection and one shared query per wake.
          No fencing, no journal, no framework.

Each chunk carries its write time, so the caller measures write-to-read latency. Reported: chunks/s,
p50/p99, and the CPU per chunk of both processes (from their own CPU times).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec

from benchmarks import harness

DESIGNS = ["raw", "pgflow"]
STARTS = ["one", "many"]

try:
    import pgflow

    app = pgflow.App(os.environ.get("PGFLOW_DSN"), schema=os.environ.get("PGFLOW_SCHEMA") or None,
                     pool_size=int(os.environ.get("BENCH_POOL", "10")))

    @app.workflow(name="bench.user_stream")
    async def user_stream(chunks: int) -> int:
        for n in range(chunks):
            await pgflow.write_stream_async("tokens", [time.time(), n])
        await pgflow.close_stream_async("tokens")
        return chunks
except ImportError:  # (the raw design needs no pgflow)
    pass


def cpu() -> float:
    return time.process_time()


class Collections:
    """The caller's garbage collections: a full one stops its loop for as long as it takes, and every
    chunk that arrives meanwhile waits for it, so their count and length explain a p99."""

    def __init__(self) -> None:
        self.full: list[tuple[float, float]] = []  # (when it ended, time.time(); how long it took)
        self.young: list[float] = []
        self._began = 0.0
        gc.callbacks.append(self.observe)

    def observe(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif info["generation"] == 2:
            self.full.append((time.time(), time.perf_counter() - self._began))
        else:
            self.young.append(time.time())

    def figures(self, since: float) -> dict[str, Any]:
        full = [took for when, took in self.full if when >= since]
        return {"caller_full_gcs": len(full), "caller_full_gc_max_ms": max(full, default=0.0) * 1000,
                "caller_full_gc_ms": sum(full) * 1000,
                "caller_young_gcs": sum(1 for when in self.young if when >= since)}


class Reads:
    """The caller's record: every chunk's latency, and each stream whole and in order."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self.first = 0.0
        self.last = 0.0

    def chunk(self, stream: int, expected: int, value: Any) -> None:
        now = time.time()
        self.latencies.append(now - value[0])
        self.last = now
        if not self.first:
            self.first = now
        if value[1] != expected and len(self.errors) < 10:
            self.errors.append(f"stream {stream}: chunk {value[1]} at position {expected}")


COLLECTIONS: Collections | None = None


def result(reads: Reads, first_start: float, starts_done: float, cpu0: float, chunks: int) -> dict[str, Any]:
    lat = sorted(reads.latencies)
    window = reads.last - first_start
    return {"chunks": len(lat), "expected": chunks, "errors": reads.errors, "window_s": window,
            "chunks_per_s": len(lat) / window if window > 0 else None, "starts_s": starts_done - first_start,
            "first_chunk_ms": (reads.first - first_start) * 1000 if reads.first else None,
            "p50_ms": harness.percentile(lat, 0.5) * 1000, "p99_ms": harness.percentile(lat, 0.99) * 1000,
            "caller_cpu_s": cpu() - cpu0} | (COLLECTIONS.figures(first_start) if COLLECTIONS else {})


# == pgflow ============================================================================================


async def pgflow_caller(a: argparse.Namespace) -> dict[str, Any]:
    reads = Reads()
    await app.migrate_async()

    async def follow(i: int, handle: Any) -> None:
        n = 0
        async for value in handle.stream_async("tokens"):
            reads.chunk(i, n, value)
            n += 1

    cpu0, t0 = cpu(), time.time()
    tasks: list[asyncio.Task[None]] = []
    if a.starts == "many":
        handles = await user_stream.start_many_async([(a.chunks,)] * a.streams)
        tasks = [asyncio.create_task(follow(i, h)) for i, h in enumerate(handles)]
    else:
        for i in range(a.streams):
            tasks.append(asyncio.create_task(follow(i, await user_stream.start_async(a.chunks))))
    started = time.time()
    await asyncio.gather(*tasks)
    out = result(reads, t0, started, cpu0, a.streams * a.chunks)
    await app.close_async()
    return out


# == raw ===============================================================================================


def raw_sql(schema: str) -> dict[str, str]:
    s = f'"{schema}"'
    return {
        "setup": f"CREATE SCHEMA {s}; CREATE TABLE {s}.jobs (id bigserial PRIMARY KEY, chunks int NOT NULL,"
                 f" claimed boolean NOT NULL DEFAULT false);"
                 f" CREATE INDEX ON {s}.jobs (id) WHERE NOT claimed;"
                 f" CREATE TABLE {s}.chunks (stream_id bigint, position int, value bytea,"
                 f" PRIMARY KEY (stream_id, position))",
        "start": f"WITH j AS (INSERT INTO {s}.jobs (chunks) SELECT %s FROM generate_series(1, %s) RETURNING id)"
                 f" SELECT id FROM j UNION ALL SELECT NULL FROM (SELECT count(pg_notify('{schema}_jobs', ''))"
                 " AS n) pinged WHERE pinged.n < 0",
        "claim": f"UPDATE {s}.jobs SET claimed = true WHERE id IN (SELECT id FROM {s}.jobs WHERE NOT claimed"
                 " ORDER BY id LIMIT 1000 FOR UPDATE SKIP LOCKED) RETURNING id, chunks",
        "write": f"WITH w AS (INSERT INTO {s}.chunks (stream_id, position, value)"
                 " SELECT * FROM unnest(%b::int8[], %b::int[], %b::bytea[]) RETURNING 1)"
                 f" SELECT pg_notify('{schema}_chunks', p) FROM unnest(%s::text[]) AS p"
                 " WHERE (SELECT count(*) FROM w) > 0",
        "fetch": f"SELECT r.i, c.position, c.value FROM unnest(%b::int8[], %b::int[]) WITH ORDINALITY"
                 f" AS r(sid, start, i) JOIN LATERAL (SELECT position, value FROM {s}.chunks"
                 " WHERE stream_id = r.sid AND position >= r.start ORDER BY position LIMIT 1000) c ON true"
                 " ORDER BY r.i, c.position",
    }


async def raw_worker(a: argparse.Namespace) -> None:
    """Claims jobs as they are pinged and group-commits their producers' chunks."""
    import psycopg
    from psycopg_pool import AsyncConnectionPool

    from benchmarks.raw_design import GroupWriter

    sql = raw_sql(a.schema)
    jobs_pinged = asyncio.Event()
    producers: set[asyncio.Task[None]] = set()

    async with AsyncConnectionPool(a.dsn, min_size=3, max_size=3, open=False, kwargs={"autocommit": True}) as pool:
        await pool.open(wait=True)
        writer = GroupWriter(pool, sql["write"], per_payload=500)
        write = writer.write

        async def produce(sid: int, chunks: int) -> None:
            for n in range(chunks):
                await write(sid, n, msgspec.msgpack.encode([time.time(), n]))
            await write(sid, chunks, None)

        async def listen() -> None:
            async with await psycopg.AsyncConnection.connect(a.dsn, autocommit=True) as conn:
                await conn.execute(f'LISTEN "{a.schema}_jobs"')
                print("@@ready", flush=True)
                async for _ in conn.notifies():
                    jobs_pinged.set()

        tasks = [asyncio.create_task(writer.run()), asyncio.create_task(listen())]
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(jobs_pinged.wait(), 1.0)
            jobs_pinged.clear()
            async with pool.connection() as conn:
                claimed = await (await conn.execute(sql["claim"])).fetchall()
            for sid, chunks in claimed:
                task = asyncio.create_task(produce(sid, chunks))
                producers.add(task)
                task.add_done_callback(producers.discard)
        del tasks


async def raw_caller(a: argparse.Namespace) -> dict[str, Any]:
    import psycopg

    sql = raw_sql(a.schema)
    reads = Reads()
    offsets: dict[int, int] = {}
    index: dict[int, int] = {}
    dirty: set[int] = set()
    wake = asyncio.Event()
    async with await psycopg.AsyncConnection.connect(a.dsn, autocommit=True) as listen, \
            await psycopg.AsyncConnection.connect(a.dsn, autocommit=True) as query, \
            await psycopg.AsyncConnection.connect(a.dsn, autocommit=True) as starter:
        await listen.execute(f'LISTEN "{a.schema}_chunks"')

        async def listener() -> None:
            async for note in listen.notifies():
                dirty.update(sid for sid in json.loads(note.payload) if sid in offsets)
                wake.set()

        all_started = False

        async def fetcher() -> None:
            while offsets or not all_started:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), 1.0)
                wake.clear()
                asked = sorted(dirty & offsets.keys()) or sorted(offsets)
                dirty.clear()
                if not asked:
                    continue
                cur = await query.execute(sql["fetch"], (asked, [offsets[s] for s in asked]), binary=True)
                got = dict.fromkeys(asked, 0)
                for ordinal, position, value in await cur.fetchall():
                    sid = asked[ordinal - 1]
                    got[sid] += 1
                    if value is None:
                        del offsets[sid]
                        continue
                    reads.chunk(index[sid], position, msgspec.msgpack.decode(value))
                    offsets[sid] = position + 1
                again = [sid for sid, n in got.items() if n == 1000 and sid in offsets]
                if again:
                    dirty.update(again)
                    wake.set()

        listening = asyncio.create_task(listener())
        fetching: asyncio.Task[None] | None = None
        cpu0, t0 = cpu(), time.time()
        for batch in ([a.streams] if a.starts == "many" else [1] * a.streams):
            for (sid,) in await (await starter.execute(sql["start"], (a.chunks, batch))).fetchall():
                index[sid], offsets[sid] = len(index), 0
                dirty.add(sid)
            wake.set()
            if fetching is None:
                fetching = asyncio.create_task(fetcher())
        started, all_started = time.time(), True
        assert fetching is not None
        await fetching
        listening.cancel()
    return result(reads, t0, started, cpu0, a.streams * a.chunks)


# == the orchestrator =================================================================================


def one_run(design: str, starts: str, a: argparse.Namespace, logdir: Path, postmaster: int | None
            ) -> dict[str, Any]:
    import psycopg

    schema = f"user_{design}_{uuid.uuid4().hex[:8]}"
    env = harness.child_env(PGFLOW_DSN=a.dsn, PGFLOW_SCHEMA=schema, BENCH_DSN=a.dsn)
    py = sys.executable
    record: dict[str, Any] = {"design": design, "starts": starts, "streams": a.streams, "chunks": a.chunks,
                              "worker_processes": a.worker_processes if design == "pgflow" else 1}
    try:
        if design == "raw":
            with psycopg.connect(a.dsn, autocommit=True) as conn:
                conn.execute(raw_sql(schema)["setup"])
            argv = [py, "-m", "benchmarks.streams_user", "--role", "raw-worker", "--schema", schema, "--dsn", a.dsn]
        else:
            setup = "import asyncio, benchmarks.streams_user as u; asyncio.run(u.app.migrate_async())"
            harness.run_json([py, "-c", setup + "; print('{}')"], env, 60, logdir / "setup.log")
            argv = [py, "-m", "pgflow", "worker", "benchmarks.streams_user:app", "--concurrency",
                    str(-(-a.streams // a.worker_processes)), "--grace", "0",
                    *(["--processes", str(a.worker_processes)] if a.worker_processes > 1 else [])]
        with harness.Proc(f"{design} worker", argv, env, logdir / f"{design}-worker.log") as worker:
            deadline = time.monotonic() + 30
            while not (("@@ready" in worker.tail(50)) if design == "raw" else ("started:" in worker.tail(50))):
                worker.check("the worker to start")
                if time.monotonic() > deadline:
                    raise harness.RunFailed("the worker did not start")
                time.sleep(0.05)
            cpu0, server0 = harness.family_cpu(worker.pid), harness.postgres_cpu(postmaster)
            machine0 = harness.machine_cpu()
            out = harness.run_json([py, "-m", "benchmarks.streams_user", "--role", "caller", "--design", design,
                                    "--starts", starts, "--schema", schema, "--dsn", a.dsn, "--streams",
                                    str(a.streams), "--chunks", str(a.chunks)], env, a.timeout,
                                   logdir / f"{design}-caller.log")
            worker_cpu, server1 = harness.family_cpu(worker.pid) - cpu0, harness.postgres_cpu(postmaster)
            machine1 = harness.machine_cpu()
        total = a.streams * a.chunks
        record.update(out, worker_cpu_us_per_chunk=worker_cpu / total * 1e6,
                      caller_cpu_us_per_chunk=out["caller_cpu_s"] / total * 1e6,
                      server_cpu_us_per_chunk=None if server0 is None or server1 is None
                      else (server1 - server0) / total * 1e6,
                      # (machine_cpu: busy, idle, stolen)
                      machine_idle=(machine1[1] - machine0[1]) / max(sum(machine1) - sum(machine0), 1e-9),
                      ok=out["chunks"] == total and not out["errors"])
    except harness.RunFailed as exc:
        record.update(ok=False, error=str(exc))
    finally:
        with psycopg.connect(a.dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    return record


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per way of starting: medians of each design, and pgflow against raw (medians of per-repeat
    ratios: both ran side by side in each repeat)."""
    out: dict[str, Any] = {}
    for starts in STARTS:
        mine = [r for r in runs if r["starts"] == starts and r.get("ok")]
        if not mine:
            continue
        entry: dict[str, Any] = {}
        for design in DESIGNS:
            rs = [r for r in mine if r["design"] == design]
            if rs:
                entry[design] = {k: harness.median([r[k] for r in rs]) for k in
                                 ("chunks_per_s", "p50_ms", "p99_ms", "worker_cpu_us_per_chunk",
                                  "caller_cpu_us_per_chunk", "server_cpu_us_per_chunk", "machine_idle",
                                  "starts_s", "first_chunk_ms") if rs[0].get(k) is not None}
        pairs = [(p, r) for p in mine if p["design"] == "pgflow" for r in mine
                 if r["design"] == "raw" and r["repeat"] == p["repeat"]]
        if pairs:
            entry["pgflow_over_raw"] = {
                "chunks_per_s": harness.median([p["chunks_per_s"] / r["chunks_per_s"] for p, r in pairs]),
                "p99": harness.median([p["p99_ms"] / r["p99_ms"] for p, r in pairs])}
        out[starts] = entry
    return out


def figures(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The medians of each design and way of starting ("pgflow many", ...), as the plot shows them."""
    return {f"{d} {s}": e[d] for s, e in summary.items() for d in DESIGNS if d in e}


def orchestrate(a: argparse.Namespace) -> dict[str, Any]:
    logdir = Path(tempfile.mkdtemp(prefix="bench-user-"))
    harness.log(f"streams, user shape: logs in {logdir}")
    runs = []
    postmaster = harness.server_info(a.dsn)["postmaster_pid"]
    for repeat in range(a.repeats):
        for starts in a.starts.split(","):
            order = a.designs.split(",")
            for design in order if repeat % 2 == 0 else order[::-1]:  # alternated: neither always first
                record = one_run(design, starts, a, logdir, postmaster) | {"repeat": repeat}
                runs.append(record)
                harness.log(f"  [{repeat + 1}/{a.repeats}] {design:6} {starts:4} "
                            + (f"{record['chunks_per_s']:9,.0f} chunks/s  p50 {record['p50_ms']:6.1f} ms  p99"
                               f" {record['p99_ms']:6.1f} ms  worker {record['worker_cpu_us_per_chunk']:5.1f} us/chunk"
                               f"  caller {record['caller_cpu_us_per_chunk']:5.1f} us/chunk  server"
                               f" {record['server_cpu_us_per_chunk'] or 0:5.1f} us/chunk"
                               f"  idle {record['machine_idle']:4.0%}  full gcs {record.get('caller_full_gcs')}"
                               f" (max {record.get('caller_full_gc_max_ms', 0):.0f} ms)  starts"
                               f" {record['starts_s']:.2f} s  first chunk {record['first_chunk_ms']:.0f} ms"
                               if record.get("ok") else f"FAILED {record.get('error')}"))
    summary = summarize(runs)
    for starts, entry in summary.items():
        ratio = entry.get("pgflow_over_raw") or {}
        harness.log(f"  starts={starts}: pgflow/raw chunks/s {ratio.get('chunks_per_s', float('nan')):.2f},"
                    f" p99 {ratio.get('p99', float('nan')):.2f}x")
    return {"benchmark": "streams-user", "server": harness.server_info(a.dsn), "commit": harness.commit(),
            "streams": a.streams, "chunks": a.chunks, "runs": runs, "summary": summary}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--designs", default=",".join(DESIGNS))
    p.add_argument("--starts", default=",".join(STARTS), help="one (start_async each) and/or many (start_many)")
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--chunks", type=int, default=400)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--dsn", default=None)
    p.add_argument("--output", default=None)
    p.add_argument("--worker-processes", type=int, default=1,
                   help="pgflow's worker as `pgflow worker --processes N`, the streams shared among them")
    p.add_argument("--role", default=None, help=argparse.SUPPRESS)
    p.add_argument("--design", default=None, help=argparse.SUPPRESS)
    p.add_argument("--schema", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    a.dsn = harness.resolve_dsn(a.dsn)
    if a.role == "raw-worker":
        asyncio.run(raw_worker(a))
        return 0
    if a.role == "caller":
        global COLLECTIONS
        COLLECTIONS = Collections()
        out = asyncio.run(pgflow_caller(a) if a.design == "pgflow" else raw_caller(a))
        print(json.dumps(out), flush=True)
        return 0
    report = orchestrate(a)
    saved = harness.save("streams-user", report["server"], report, figures(report["summary"]), a.output)
    harness.log(f"wrote {saved}")
    return 0 if all(r.get("ok") for r in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
