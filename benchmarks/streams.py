"""Streams benchmark: 256 streams written flat out by one process and read to the end by another.

    python benchmarks/streams.py                       # every design, 3 repeats, medians
    python benchmarks/streams.py --designs pgflow,naive --repeats 1 --chunks 200
    python benchmarks/streams.py --dsn postgresql://postgres@127.0.0.1:5432/test

The orchestrator (this file run without --role; streams_orchestrator.py) starts, for each design and
repeat, a writer process and a reader process (this same file with --role writer / --role reader; what
they share is streams_roles.py), each on its own schema (or, for DBOS, its own database) on the same
server, dropped afterwards. The writer makes all 256 producers ready and parked; the reader attaches to
all 256 streams; then the orchestrator says "go" and the writer writes every chunk flat out. Every chunk
carries ``time.time()`` taken just before its write call, so the reader computes write-to-read latency
of every chunk. Subprocesses talk to the orchestrator in ``@@ {json}`` lines on stdout and are always
terminated in ``finally`` blocks; every design run has a deadline (--timeout) after which it is reported
as timed out, not waited for.

Designs (streams_sql.py: raw and naive; streams_frameworks.py: pgflow and DBOS):
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
is printed at the end (streams_report.py). --profile DIR also records every writer and reader with
py-spy (raw collapsed stacks). BENCH_DBOS_POOL / BENCH_DBOS_THREADS (default 32 / 64) size DBOS's
system-database pool and executor threads.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import platform
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

from benchmarks import harness, streams_frameworks, streams_report, streams_sql  # noqa: E402
from benchmarks.streams_orchestrator import DEFAULT_CHUNKS, Orchestrator  # noqa: E402
from benchmarks.streams_roles import watch_orchestrator  # noqa: E402

DESIGNS = ["raw", "naive", "pgflow", "pgflow-off", "dbos"]
STREAM_PACKAGES = ("pgflow-durable", "dbos", "psycopg", "anyio")

ROLES: dict[tuple[str, str], Callable[[argparse.Namespace], Any]] = {
    ("writer", "raw"): streams_sql.raw_writer, ("reader", "raw"): streams_sql.raw_reader,
    ("writer", "naive"): streams_sql.naive_writer, ("reader", "naive"): streams_sql.naive_reader,
    ("writer", "dbos"): streams_frameworks.dbos_writer, ("reader", "dbos"): streams_frameworks.dbos_reader,
    **{("writer", d): streams_frameworks.pgflow_writer for d in ("pgflow", "pgflow-off")},
    **{("reader", d): streams_frameworks.pgflow_reader for d in ("pgflow", "pgflow-off")},
    ("noop-worker", "pgflow"): streams_frameworks.noop_worker,
    ("noop-caller", "pgflow"): streams_frameworks.noop_caller,
}


async def run_all(orch: Orchestrator, designs: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Every design once per repeat, interleaved, then the no-op scenario; a line of progress per run."""
    a = orch.a
    runs: list[dict[str, Any]] = []
    for repeat in range(a.repeats):
        for design in designs:
            record = await orch.stream_run(design, repeat)
            runs.append(record)
            if record.get("ok"):
                print(f"  [{repeat + 1}/{a.repeats}] {design:<14} {record['chunks_per_s']:>9,.0f} chunks/s"
                      f"  p50 {record['p50_ms']:7.1f} ms  p99 {record['p99_ms']:7.1f} ms"
                      f"  total {record['completion_s']:6.2f} s  (load {record['loadavg_before']:.1f})", flush=True)
            else:
                print(f"  [{repeat + 1}/{a.repeats}] {design:<14} FAILED: {record.get('error')}", flush=True)
    return runs, (await orch.noop_run() if a.noop_runs > 0 else None)


def orchestrate(a: argparse.Namespace, dsn: str, server_kind: str) -> int:
    designs = [d.strip() for d in a.designs.split(",") if d.strip()]
    unknown = [d for d in designs if d not in DESIGNS]
    if unknown:
        raise SystemExit(f"unknown design(s) {unknown}; choose from {','.join(DESIGNS)}")
    info = harness.server_info(dsn)
    measured = harness.versions(STREAM_PACKAGES)
    logdir = Path(tempfile.mkdtemp(prefix="pgflow-bench-"))
    print(f"server: PostgreSQL {info['server_version']} ({server_kind}); logs in {logdir}", flush=True)
    runs, noop = asyncio.run(run_all(Orchestrator(a, dsn, logdir, info.get("postmaster_pid")), designs))
    summary = streams_report.summarize(runs, designs)
    report = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "server": info, "server_kind": server_kind, "versions": measured, "streams": a.streams,
        "repeats": a.repeats,
        "settings": {"naive_pool": streams_sql.NAIVE_POOL, "dbos_pool": streams_frameworks.DBOS_POOL,
                     "dbos_threads": streams_frameworks.DBOS_THREADS,
                     "pgflow_off_poll_interval": streams_frameworks.OFF_POLL, "chunks_override": a.chunks},
        "summary": summary, "noop": noop, "runs": runs,
        "targets": streams_report.targets(runs, summary, noop),
    }
    if harness.commit() != measured.get("pgflow_commit"):
        report["warning"] = (f"the pgflow checkout changed during the run (from {measured.get('pgflow_commit')} "
                             f"to {harness.commit()}): the runs did not all measure the same code")
    out = harness.write_report(report, a.output, f"streams-{dt.date.today().isoformat()}-{harness.pg_major(info)}.json")
    streams_report.print_report(report)
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
    for internal in ("--role", "--design", "--schema", "--run"):
        p.add_argument(internal, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.role is None:
        with harness.serving(a.dsn) as (dsn, server_kind):
            return orchestrate(a, dsn, server_kind)
    role = ROLES.get((a.role, a.design))
    if role is None:
        raise SystemExit(f"no role {a.role!r} for design {a.design!r}")
    watch_orchestrator(a.timeout + 30)
    asyncio.run(role(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
