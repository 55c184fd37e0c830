"""A fleet of worker processes on one server, direct and through a transaction-mode pgbouncer: the
throughput beside what the server pays for it (its sessions and its CPU), so that the cost of each
worker process is visible.

    python -m benchmarks fleet                          # 4 processes x concurrency 64, a private PostgreSQL 18
    python -m benchmarks.fleet_pooled --processes 8 --workflows 20000 --dsn postgresql://...

For each mode (direct: PGFLOW_DSN is the server; pgbouncer: PGFLOW_DSN is a pgbouncer of this
benchmark's own, tests/pgbouncer.py, transaction mode, 20 server sessions, and PGFLOW_LISTEN_DSN the
server), in a fresh schema: ``--workflows`` no-op workflows of one step are enqueued, then
``--processes`` ``pgflow worker`` processes (``--concurrency`` each) start and drain them. Measured:

- workflows/s from the first claim to the last end (the rows' started_at and finished_at);
- the server's client sessions, their peak while the fleet ran (pg_stat_activity, every 0.2 s), and
  that peak less the sessions open before the fleet started (pgbouncer's idle server sessions);
- CPU seconds of the server (the postmaster's children; only with the private server, whose
  postmaster this process knows), of the worker processes and of pgbouncer, per 1,000 workflows.

Modes alternate per repeat. Results: benchmarks/results/fleet-pooled-<time>-pg<major>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg

import pgflow
from benchmarks.fleet_workers import descendants
from benchmarks.harness import RESULTS, ROOT, child_env, log, postgres_cpu, process_cpu


def build(target: pgflow.App) -> pgflow.Workflow[[int], int]:
    @target.step(name="fleetpooled.step")
    async def step(i: int) -> int:
        return i

    @target.workflow(name="fleetpooled.flow")
    async def flow(i: int) -> int:
        return await step(i)

    return flow


app = pgflow.App()  # the worker processes': PGFLOW_DSN, PGFLOW_LISTEN_DSN and PGFLOW_SCHEMA say where
build(app)


@contextlib.contextmanager
def server(dsn: str | None) -> Iterator[tuple[str, int | None]]:
    """The server's DSN and its postmaster's pid (None for a server of somebody else's)."""
    if dsn:
        yield dsn, None
        return
    from tests.servers import EmbeddedServer

    embedded = EmbeddedServer("max_connections = 400")
    embedded.start(Path(tempfile.mkdtemp(prefix="pgflow-fleet-pooled-")))
    try:
        with psycopg.connect(embedded.dsn) as conn:
            backend = conn.info.backend_pid
            parent = int(Path(f"/proc/{backend}/stat").read_text().rsplit(")", 1)[1].split()[1])
        yield embedded.dsn, parent
    finally:
        embedded.stop()


def sessions_peak(dsn: str, stop: threading.Event, found: list[int]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop.is_set():
            row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'"
                               " AND pid <> pg_backend_pid()").fetchone()
            found.append(int(row[0]) if row else 0)
            stop.wait(0.2)


def run(a: argparse.Namespace, dsn: str, postmaster: int | None, mode: str, bouncer: Any) -> dict[str, Any]:
    schema = f"fleetpooled_{uuid.uuid4().hex[:8]}"
    worker_dsn = bouncer.dsn(dsn) if mode == "pgbouncer" else dsn
    env = child_env(PGFLOW_DSN=worker_dsn, PGFLOW_SCHEMA=schema, PGFLOW_LOG_LEVEL="WARNING")
    env.pop("PGFLOW_LISTEN_DSN", None)
    if mode == "pgbouncer":
        env["PGFLOW_LISTEN_DSN"] = dsn
    with pgflow.App(dsn, schema=schema) as client:
        flow = build(client)
        client.migrate()
        for first in range(0, a.workflows, 500):
            flow.start_many([(i,) for i in range(first, min(a.workflows, first + 500))])
    workers: list[subprocess.Popen[bytes]] = []
    stop, peaks = threading.Event(), []  # type: ignore[var-annotated]
    sampler = threading.Thread(target=sessions_peak, args=(dsn, stop, peaks), daemon=True)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            before = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'"
                                  " AND pid <> pg_backend_pid()").fetchone()[0]  # type: ignore[index]
            pg0 = postgres_cpu(postmaster)
            bouncer0 = process_cpu(bouncer.pid) if mode == "pgbouncer" else 0.0
            sampler.start()
            for _ in range(a.processes):
                workers.append(subprocess.Popen(
                    [sys.executable, "-m", "pgflow", "worker", "benchmarks.fleet_pooled:app",
                     "--concurrency", str(a.concurrency)], env=env, cwd=ROOT, stdin=subprocess.DEVNULL))
            deadline = time.monotonic() + a.timeout
            done = 0
            worker_cpu = 0.0
            while done < a.workflows:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{mode}: {done} of {a.workflows} done after {a.timeout} s")
                if any(w.poll() is not None for w in workers):
                    raise RuntimeError(f"{mode}: a worker process exited")
                time.sleep(0.2)
                worker_cpu = max(worker_cpu, sum(process_cpu(p) for w in workers for p in descendants(w.pid)))
                done = conn.execute(f'SELECT count(*) FROM "{schema}".workflows WHERE status = %s',
                                    ("succeeded",)).fetchone()[0]  # type: ignore[index]
            pg1 = postgres_cpu(postmaster)
            bouncer1 = process_cpu(bouncer.pid) if mode == "pgbouncer" else 0.0
            span = conn.execute("SELECT extract(epoch FROM max(finished_at) - min(started_at))"
                                f' FROM "{schema}".workflows'
                                ).fetchone()[0]  # type: ignore[index]
    finally:
        stop.set()
        for w in workers:
            w.terminate()
        for w in workers:
            try:
                w.wait(timeout=30)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    per_k = 1000 / a.workflows
    result = {"mode": mode, "processes": a.processes, "concurrency": a.concurrency, "workflows": a.workflows,
              "per_s": round(a.workflows / float(span), 1), "sessions_before": before,
              "sessions_peak": max(peaks) if peaks else None,
              "fleet_sessions": max(peaks) - before if peaks else None,
              "server_cpu_s_per_1k": None if pg0 is None or pg1 is None else round((pg1 - pg0) * per_k, 3),
              "worker_cpu_s_per_1k": round(worker_cpu * per_k, 3),
              "pgbouncer_cpu_s_per_1k": round((bouncer1 - bouncer0) * per_k, 3)}
    log(json.dumps(result))
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks fleet", description=__doc__.split("\n\n")[0])
    p.add_argument("--dsn", default=None, help="a server (default: a private embedded PostgreSQL 18)")
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--workflows", type=int, default=10000)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--modes", default="direct,pgbouncer")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--output", default=None)
    a, _ = p.parse_known_args(argv)
    from tests.pgbouncer import Pgbouncer, binary

    modes = a.modes.split(",")
    if "pgbouncer" in modes and binary() is None:
        raise SystemExit("pgbouncer is not installed (apt-get install pgbouncer): run with --modes direct")
    runs = []
    with server(a.dsn) as (dsn, postmaster), Pgbouncer(dsn, pool_size=20, max_clients=2000) as bouncer:
        for _ in range(a.repeats):
            for mode in modes:
                runs.append(run(a, dsn, postmaster, mode, bouncer))
        major = psycopg.connect(dsn).info.server_version // 10000
    keys = ("per_s", "sessions_peak", "fleet_sessions", "server_cpu_s_per_1k", "worker_cpu_s_per_1k",
            "pgbouncer_cpu_s_per_1k")
    summary = {mode: {key: statistics.median(r[key] for r in runs if r["mode"] == mode)
                      for key in keys if all(r[key] is not None for r in runs)} for mode in modes}
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H%M")
    out = Path(a.output) if a.output else RESULTS / f"fleet-pooled-{stamp}-pg{major}.json"
    out.write_text(json.dumps({"settings": vars(a) | {"dsn": None}, "runs": runs, "summary": summary}, indent=1))
    log(f"results in {out}")
    for mode, figures in summary.items():
        log(f"{mode:10s} {json.dumps(figures)}")


if __name__ == "__main__":
    main()
