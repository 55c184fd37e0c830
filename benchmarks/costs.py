"""What one PostgreSQL pays per unit of pgflow's work, for docs/scaling.md: WAL per workflow and per
stream chunk, commits per second with and without NOTIFY, connections per worker process.

    python -m benchmarks.costs                 # on a private embedded PostgreSQL 18 (make costs)
    python -m benchmarks.costs --dsn DSN       # on another server (WAL deltas then count its other traffic too)

WAL is cluster-wide, so by default this starts a PostgreSQL 18 of its own (tests/servers.py's
EmbeddedServer: fsync off, synchronous_commit on, default WAL settings, full_page_writes on): nothing
else writes to it. Each figure is a delta of ``pg_current_wal_lsn()`` around one piece of work,
after a CHECKPOINT, so it includes the
full-page images the first change of each page after a checkpoint writes (as production pays them,
once per page per checkpoint_timeout):

  starts      N workflows started (start_many, batches of 100), nothing claimed;
  runs        then those N run by an in-process worker (concurrency 64): a claim, one step recorded,
              the end, per workflow;
  chunks      one workflow writing M chunks of 16 bytes to one stream, then 64 workflows writing M/64
              each (group commit shares commits among concurrent writers);
  notify      8 connections committing as fast as they can for 3 s: a transaction that writes one
              row, with and without a NOTIFY in it. PostgreSQL serialises the commits of notifying
              transactions on one lock (the notification queue's), cluster-wide;
  sessions    the server sessions of one worker process while it runs (pg_stat_activity, by pid).

Results: benchmarks/results/costs-<time>-pg<major>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg

import pgflow

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def log(*parts: Any) -> None:
    print(*parts, file=sys.stderr, flush=True)


@contextlib.contextmanager
def server(dsn: str | None) -> Iterator[str]:
    if dsn:
        yield dsn
        return
    sys.path.insert(0, str(ROOT))
    from tests.servers import EmbeddedServer

    base = Path(tempfile.mkdtemp(prefix="pgflow-costs-"))
    embedded = EmbeddedServer()
    embedded.start(base)
    try:
        yield embedded.dsn
    finally:
        embedded.stop()


class Wal:
    """WAL written between ``mark()`` and ``since()``, from ``pg_current_wal_lsn()``. (Not from
    pg_stat_wal's counters: a backend flushes those at most once a second, later when it goes idle.)"""

    def __init__(self, dsn: str) -> None:
        self._conn = psycopg.connect(dsn, autocommit=True)
        self._start: object = None

    def _lsn(self) -> object:
        row = self._conn.execute("SELECT pg_current_wal_lsn()").fetchone()
        assert row is not None
        return row[0]

    def mark(self, checkpoint: bool = True) -> None:
        if checkpoint:
            self._conn.execute("CHECKPOINT")
        self._start = self._lsn()

    def since(self, units: int) -> dict[str, float]:
        row = self._conn.execute("SELECT pg_wal_lsn_diff(%s, %s)", (self._lsn(), self._start)).fetchone()
        assert row is not None
        total = float(row[0])
        return {"units": units, "wal_bytes": int(total), "wal_bytes_per_unit": round(total / units, 1)}


def build(app: pgflow.App) -> tuple[pgflow.Workflow[[int], int], pgflow.Workflow[[int], int]]:
    @app.step(name="costs.step")
    async def step(i: int) -> int:
        return i + 1

    @app.workflow(name="costs.flow")
    async def flow(i: int) -> int:
        return await step(i)

    @app.workflow(name="costs.chunks")
    async def chunks(n: int) -> int:
        for k in range(n):
            await pgflow.write_stream_async("out", f"chunk-{k:010d}")  # 16 bytes
        await pgflow.close_stream_async("out")
        return n

    return flow, chunks


async def measure(dsn: str, workflows: int, chunk_count: int) -> dict[str, Any]:
    schema = f"costs_{uuid.uuid4().hex[:8]}"
    wal = Wal(dsn)
    out: dict[str, Any] = {}
    async with pgflow.App(dsn, schema=schema) as app:
        flow, chunks = build(app)
        await app.migrate_async()
        wal.mark()
        handles = []
        for first in range(0, workflows, 100):
            handles += await flow.start_many_async([(i,) for i in range(first, min(workflows, first + 100))])
        out["starts"] = wal.since(workflows)
        log("starts", out["starts"])
        wal.mark()
        sessions: dict[str, int] = {}
        async with app.worker(concurrency=64):
            for handle in handles:
                await handle.result_async(timeout=600)
            with psycopg.connect(dsn, autocommit=True) as conn:
                for name, count in conn.execute(
                        "SELECT regexp_replace(application_name, '-[0-9]+$', ''), count(*) FROM pg_stat_activity"
                        " WHERE application_name LIKE 'pgflow-%' GROUP BY 1").fetchall():
                    sessions[name] = count
        out["runs"] = wal.since(workflows)
        log("runs", out["runs"])
        out["sessions"] = sessions
        log("sessions of one in-process worker and its caller", sessions)
        async with app.worker(concurrency=64):
            wal.mark()
            await (await chunks.start_async(chunk_count)).result_async(timeout=600)
            out["chunks_one_writer"] = wal.since(chunk_count)
            log("chunks, one writer", out["chunks_one_writer"])
            wal.mark()
            many = await chunks.start_many_async([(chunk_count // 64,)] * 64)
            for handle in many:
                await handle.result_async(timeout=600)
            out["chunks_64_writers"] = wal.since(chunk_count // 64 * 64)
            log("chunks, 64 writers", out["chunks_64_writers"])
    out["notify"] = await commits(dsn, schema)
    log("notify", out["notify"])
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        out["server"] = conn.execute("SELECT version()").fetchone()[0]  # type: ignore[index]
    return out


async def commits(dsn: str, schema: str, clients: int = 8, seconds: float = 3.0) -> dict[str, float]:
    """Commits per second of 8 clients: a one-row insert, with and without a NOTIFY beside it."""
    table = f'"{schema}".notify_probe'
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE UNLOGGED TABLE {table} (n int)")

    async def client(notify: bool, until: float) -> int:
        done = 0
        statement = (f"WITH w AS (INSERT INTO {table} VALUES (1)) SELECT pg_notify('pgflow_costs', 'x')" if notify
                     else f"INSERT INTO {table} VALUES (1)")
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            while time.monotonic() < until:
                await conn.execute(statement)
                done += 1
        return done

    result = {}
    for notify in (False, True):
        until = time.monotonic() + seconds
        counts = await asyncio.gather(*(client(notify, until) for _ in range(clients)))
        result["with_notify_per_s" if notify else "without_notify_per_s"] = round(sum(counts) / seconds)
    result["ratio"] = round(result["with_notify_per_s"] / result["without_notify_per_s"], 3)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.costs", description=__doc__.split("\n\n")[0])
    p.add_argument("--dsn", default=None, help="a server (default: a private embedded PostgreSQL 18)")
    p.add_argument("--workflows", type=int, default=5000)
    p.add_argument("--chunks", type=int, default=6400)
    a = p.parse_args(argv)
    with server(a.dsn) as dsn:
        report = asyncio.run(measure(dsn, a.workflows, a.chunks))
        major = psycopg.connect(dsn).info.server_version // 10000
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H%M")
    out = HERE / "results" / f"costs-{stamp}-pg{major}.json"
    out.write_text(json.dumps(report, indent=1))
    log(f"results in {out}")


if __name__ == "__main__":
    main()
