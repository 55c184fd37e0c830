"""What an open dashboard costs the database, and a drain beside it.

    python benchmarks/dashboard_load.py                       # PostgreSQL 15 at 127.0.0.1:5432
    python benchmarks/dashboard_load.py --pages 10 --finished 1000000 --repeats 3

In a database of its own (``pgflow_dashboard_load`` on the server of ``--dsn``, created if missing, so
that its statistics count nobody else's sessions) and a fresh schema:

1. fill: ``--finished`` workflows that finished in the last day, in SQL (``generate_series``), then
   VACUUM ANALYZE;
2. a ``pgflow worker`` process (concurrency ``--concurrency`` plus one slot per watched workflow) runs
   ``--pages`` watched workflows that write a stream chunk every 0.25 s for as long as the benchmark
   runs, and the drains;
3. idle, dashboard off, then on: the database's committed transactions per second
   (``pg_stat_database.xact_commit``; each of the dashboard's statements is one) over ``--window``
   seconds each, the worker idle but for the watched workflows; the difference is noisy (the
   watched workflows' writes vary), so the dashboard's own count of what it sent (its ``/cost``:
   statements, and the stream reads of its live pages) is reported beside it. "On" is a
   ``pgflow dashboard`` process with ``--pages`` open pages: each one the overview's live
   connection, one watched workflow's live connection and its stream's;
4. drains, dashboard off and on in turn, ``--repeats`` times: ``--workflows`` no-op workflows queued
   with ``start_many``, timed from the start to the last one's end.

Medians are printed and written to benchmarks/results/dashboard-load-<time>-pg<major>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
import psycopg  # noqa: E402

import pgflow  # noqa: E402

app = pgflow.App()  # the worker process's: PGFLOW_DSN and PGFLOW_SCHEMA from the benchmark


@app.workflow(name="bench.noop")
async def noop(i: int) -> int:
    return i


@app.workflow(name="bench.watched")
async def watched(seconds: float) -> int:
    deadline = time.time() + seconds  # a benchmark's workload, not a replayed journal: wall time is fine
    n = 0
    while time.time() < deadline:
        await pgflow.write_stream_async("out", f"chunk {n}")
        n += 1
        await asyncio.sleep(0.25)
    return n


DATABASE = "pgflow_dashboard_load"


def bench_dsn(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)).fetchone() is None:
            conn.execute(f'CREATE DATABASE "{DATABASE}"')
    return psycopg.conninfo.make_conninfo(dsn, dbname=DATABASE)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def commits(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()").fetchone()
        assert row is not None
        return int(row[0])


def rate(dsn: str, seconds: float) -> float:
    """Committed transactions per second of this database over ``seconds`` (statistics are flushed
    by each backend about once a second: the window is long enough for that not to matter)."""
    first = commits(dsn)
    time.sleep(seconds)
    return (commits(dsn) - first - 2) / seconds  # the two reads of the counter are transactions too


class Page(threading.Thread):
    """An open page's live connection: an SSE response read until told to stop."""

    def __init__(self, port: int, target: str) -> None:
        super().__init__(daemon=True)
        self.port, self.target = port, target
        self.events = 0
        self.stopping = False
        self.conn: http.client.HTTPConnection | None = None

    def run(self) -> None:
        while not self.stopping:
            try:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
                self.conn.request("GET", self.target, headers={"Accept": "text/event-stream"})
                response = self.conn.getresponse()
                for line in response:
                    if line.startswith(b"data:"):
                        self.events += 1
                    if self.stopping:
                        return
            except OSError:
                if not self.stopping:
                    time.sleep(0.5)

    def stop(self) -> None:
        self.stopping = True
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.sock and self.conn.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[func-returns-value]


def fill(dsn: str, schema: str, n: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        conn.execute(
            f'INSERT INTO "{schema}".workflows (id, name, queue, inputs, status, created_at, started_at,'
            " finished_at, attempt)"
            " SELECT 'old-' || i, 'bench.old' || (i % 20), 'default', '\\x80'::bytea, 'succeeded',"
            f"  now() - interval '1 day' + make_interval(secs => i * 86000.0 / {max(n, 1)}),"
            f"  now() - interval '1 day' + make_interval(secs => i * 86000.0 / {max(n, 1)}),"
            f"  now() - interval '1 day' + make_interval(secs => i * 86000.0 / {max(n, 1)} + 0.01), 1"
            f" FROM generate_series(1, {n}) AS i")
        conn.execute(f'VACUUM ANALYZE "{schema}".workflows')


def drain(client: pgflow.App, dsn: str, schema: str, n: int) -> float:
    """Workflows per second: ``n`` no-ops started in one statement, until none is left queued or
    running (looked at every 0.1 s)."""
    started = time.perf_counter()
    noop_on(client).start_many([(i,) for i in range(n)])
    with psycopg.connect(dsn, autocommit=True) as conn:
        while conn.execute(f'SELECT count(*) FROM "{schema}".workflows WHERE status IN (\'queued\', \'running\')'
                           " AND name = 'bench.noop'").fetchone() != (0,):
            if time.perf_counter() - started > 600:
                raise TimeoutError("the drain did not end within 600 s")
            time.sleep(0.1)
    return n / (time.perf_counter() - started)


def cost(port: int) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/cost")
        return dict(json.loads(conn.getresponse().read()))
    finally:
        conn.close()


def noop_on(client: pgflow.App) -> Any:
    return client.workflows["bench.noop"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dsn", default=os.environ.get("PGFLOW_DSN") or "postgresql://postgres@127.0.0.1:5432/test")
    p.add_argument("--finished", type=int, default=1_000_000, help="finished workflows in the table")
    p.add_argument("--workflows", type=int, default=10_000, help="no-ops per drain")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--pages", type=int, default=5, help="open pages while the dashboard is on")
    p.add_argument("--window", type=float, default=30.0, help="seconds of each idle measurement")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--output", default=None)
    a = p.parse_args(argv)
    dsn = bench_dsn(a.dsn)
    schema = f"dashload_{uuid.uuid4().hex[:8]}"
    client = pgflow.App(dsn, schema=schema)
    client.workflow(name="bench.noop")(_noop)  # the caller's own registration: start_many needs one
    client.migrate()
    env = {**os.environ, "PGFLOW_DSN": dsn, "PGFLOW_SCHEMA": schema, "PGFLOW_LOG_LEVEL": "WARNING",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    procs: list[subprocess.Popen[bytes]] = []
    results: dict[str, Any] = {"finished_rows": a.finished, "pages": a.pages, "workflows": a.workflows,
                               "concurrency": a.concurrency}
    try:
        print(f"filling {a.finished:,} finished workflows into {schema} ...", file=sys.stderr)
        fill(dsn, schema, a.finished)
        worker = subprocess.Popen([sys.executable, "-m", "pgflow", "worker", "benchmarks.dashboard_load:app",
                                   "--concurrency", str(a.concurrency + a.pages), "--lease", "10"], env=env,
                                  cwd=ROOT, stdout=subprocess.DEVNULL)
        procs.append(worker)
        lasting = 3600.0
        watched_ids = [client.start_by_name("bench.watched", lasting).id for _ in range(a.pages)]
        drain(client, dsn, schema, 200)  # the worker is up and warm
        port = free_port()

        def dashboard_on() -> tuple[subprocess.Popen[bytes], list[Page]]:
            proc = subprocess.Popen([sys.executable, "-m", "pgflow", "dashboard", "--port", str(port)], env=env,
                                    cwd=ROOT, stdout=subprocess.DEVNULL)
            deadline = time.monotonic() + 30
            while True:
                with contextlib.suppress(OSError):
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("the dashboard did not start")
                time.sleep(0.1)
            pages = []
            for wid in watched_ids:
                for target in ("/live/overview", f"/live/workflow?id={wid}", f"/live/stream?id={wid}&key=out"):
                    page = Page(port, target)
                    page.start()
                    pages.append(page)
            return proc, pages

        def dashboard_off(proc: subprocess.Popen[bytes], pages: list[Page]) -> float:
            for page in pages:
                page.stop()
            cpu = psutil.Process(proc.pid).cpu_times()
            proc.terminate()
            proc.wait(30)
            return float(cpu.user + cpu.system)

        print("idle, dashboard off ...", file=sys.stderr)
        results["idle_commits_per_s_off"] = rate(dsn, a.window)
        proc, pages = dashboard_on()
        time.sleep(3)  # its first reads
        print("idle, dashboard on ...", file=sys.stderr)
        started = time.monotonic()
        before = cost(port)
        results["idle_commits_per_s_on"] = rate(dsn, a.window)
        after = cost(port)
        results["dashboard_counted_per_s"] = (after["statements"] + after["stream_fetches"] - before["statements"]
                                              - before["stream_fetches"]) / (after["uptime_s"] - before["uptime_s"])
        events = sum(p.events for p in pages)
        cpu = dashboard_off(proc, pages)
        results["dashboard_statements_per_s"] = results["idle_commits_per_s_on"] - results["idle_commits_per_s_off"]
        results["dashboard_cpu_s_per_s"] = cpu / (time.monotonic() - started + 3)
        results["sse_events_received"] = events

        off: list[float] = []
        on: list[float] = []
        during: list[float] = []
        for r in range(a.repeats):
            print(f"repeat {r + 1}: drain, dashboard off ...", file=sys.stderr)
            off.append(drain(client, dsn, schema, a.workflows))
            proc, pages = dashboard_on()
            time.sleep(3)
            print(f"repeat {r + 1}: drain, dashboard on ({a.pages} pages) ...", file=sys.stderr)
            before = cost(port)
            on.append(drain(client, dsn, schema, a.workflows))
            after = cost(port)
            during.append((after["statements"] + after["stream_fetches"] - before["statements"]
                           - before["stream_fetches"]) / (after["uptime_s"] - before["uptime_s"]))
            dashboard_off(proc, pages)
        results["drain_per_s_off"] = off
        results["drain_per_s_on"] = on
        results["dashboard_counted_per_s_during_drains"] = during
        results["drain_ratio_median"] = statistics.median(b / a_ for a_, b in zip(off, on, strict=True))
        for wid in watched_ids:
            client.handle(wid).cancel()
    finally:
        for proc in procs:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
        client.close()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    with psycopg.connect(dsn) as conn:
        major = conn.info.server_version // 10000
    out = Path(a.output) if a.output else HERE / "results" / (
        f"dashboard-load-{dt.datetime.now(dt.UTC).strftime('%Y-%m-%dT%H%M')}-pg{major}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    print(f"written to {out}", file=sys.stderr)
    return 0


async def _noop(i: int) -> int:
    return i


if __name__ == "__main__":
    sys.exit(main())
