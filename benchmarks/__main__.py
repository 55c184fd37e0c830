"""``python -m benchmarks NAME``: every benchmark behind one entry point.

  tasks     plain no-op tasks against the peers (pgqueuer, procrastinate, Celery, DBOS): drain at
            concurrency 16 and 64, enqueue/s from 1 and 16 callers, start-to-result p50/p99 (tasks.py)
  streams   256 concurrent streams, pgflow against raw, naive LISTEN/NOTIFY and DBOS (streams.py);
            with --shape user, as an application runs them: the CLI worker as a process of its own, and
            a caller that starts the workflows (one by one, and with start_many) and reads them
            (streams_user.py)
  latency   an idle pgflow worker's no-op start-to-result latency, with where the time goes (fleet.py)
  recovery  crash takeover: a worker SIGKILLed mid-workflow, time until another carries on (fleet.py)
  flat      pgflow's drain and streams with 1M finished workflows, or 100K queued, in its tables (flat.py)
  fleet     N worker processes x concurrency 64, direct and through pgbouncer: throughput, server
            sessions and CPU per 1,000 workflows (fleet_pooled.py; its own flags are passed on)

Common flags: --quick (each benchmark under 3 minutes: smaller runs, 1 repeat unless --repeats says),
--json (one object {"benchmark": NAME, "systems": {SYSTEM: {figures}}} on stdout, everything else on
stderr), --dsn (default: the PostgreSQL 15 at postgresql://postgres@127.0.0.1:5432/test when it answers,
else $PGFLOW_DSN), --repeats (3; medians, systems interleaved), --systems (comma list). Every result is
saved under benchmarks/results/ as JSON with a PNG plot beside it. Flags this entry point does not know
are passed on to streams.py and fleet.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import harness, tasks

NAMES = ["tasks", "streams", "latency", "recovery", "flat", "fleet"]


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("name", choices=NAMES)
    p.add_argument("--quick", action="store_true", help="each benchmark under 3 minutes")
    p.add_argument("--json", action="store_true", help="print one JSON object of the medians on stdout")
    p.add_argument("--dsn", default=None, help="server (default: local PG15 if it answers, else $PGFLOW_DSN)")
    p.add_argument("--repeats", type=int, default=None, help="repeats, medians reported (default 3; --quick 1)")
    p.add_argument("--systems", default=None, help="comma list of systems (tasks) or designs (streams)")
    p.add_argument("--output", default=None, help="results file (default benchmarks/results/NAME-<time>-pg<N>.json)")
    p.add_argument("--shape", choices=["parked", "user"], default="parked",
                   help="streams: the benchmark's own shape (parked behind a go), or the user's")
    tasks.add_arguments(p)
    a, rest = p.parse_known_args(argv)
    if a.repeats is None:
        a.repeats = 1 if a.quick else 3
    if rest and a.name in ("tasks", "flat"):
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    return a, rest


def delegated(a: argparse.Namespace, rest: list[str]) -> dict[str, Any]:
    """streams, latency and recovery: run the existing script's main, then read the file it wrote."""
    dsn = harness.resolve_dsn(a.dsn)
    out = Path(tempfile.mkdtemp(prefix="bench-")) / "report.json"
    argv = ["--dsn", dsn, "--repeats", str(a.repeats), "--output", str(out)]
    name = a.name
    if a.name == "streams" and a.shape == "user":
        from benchmarks import streams_user

        name = "streams-user"
        streams_user.main(argv + (["--designs", a.systems] if a.systems else []) + rest)
        report = json.loads(out.read_text())
        figures = {system: {k: f[k] for k in ("chunks_per_s", "p50_ms", "p99_ms", "worker_cpu_us_per_chunk") if k in f}
                   for system, f in streams_user.figures(report["summary"]).items()}
    elif a.name == "streams":
        from benchmarks import streams

        if a.systems:
            argv += ["--designs", a.systems]
        if a.quick:
            argv += ["--noop-runs", "50"]
        streams.main(argv + rest)
        report = json.loads(out.read_text())
        figures = {d: {k: s[k] for k in ("chunks_per_s", "p50_ms", "p99_ms") if s.get(k) is not None}
                   for d, s in report["summary"].items()}
    else:
        from benchmarks import fleet

        argv += ["--scenarios", "latency" if a.name == "latency" else "failover"]
        if a.quick:
            argv += ["--quiet-wait", "5", "--tries", "1", "--latency-runs", "100", "--leases", "2"]
        fleet.main(argv + rest)
        report = json.loads(out.read_text())
        summary = report["summary"]
        if a.name == "latency":
            lat = summary.get("latency") or {}
            figures = {"pgflow": {k: lat[k] for k in ("p50_ms", "p90_ms", "p99_ms", "max_ms")
                                  if lat.get(k) is not None}}
        else:
            figures = {f"pgflow lease {lease}s": {k: v for k, v in f.items() if k.endswith("_s") and v is not None}
                       for lease, f in summary["failover"].items()}
    report = {"benchmark": name, "systems": figures, **report}
    info = report.get("server") or {}
    saved = harness.save(name, info, report, figures, a.output)
    harness.log(f"wrote {saved} and {saved.with_suffix('.png').name}")
    return report


def main(argv: list[str] | None = None) -> int:
    a, rest = parse(argv)
    # A SIGTERM unwinds like Ctrl-C, through the finally blocks that stop every process and drop the databases.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    stdout = sys.stdout
    if a.name == "fleet":
        from benchmarks import fleet_pooled

        fleet_pooled.main([*([] if a.dsn is None else ["--dsn", a.dsn]), "--repeats", str(a.repeats),
                           *([] if a.output is None else ["--output", a.output]), *rest])
        return 0
    with contextlib.redirect_stdout(sys.stderr if a.json else sys.stdout):
        if a.name == "tasks":
            report = tasks.main(a)
        elif a.name == "flat":
            from benchmarks import flat

            report = flat.main(a)
        else:
            report = delegated(a, rest)
    if a.json:
        stdout.write(json.dumps({"benchmark": a.name, "systems": report["systems"]}) + "\n")
    failed = [r for r in report.get("runs", []) if not r.get("ok", True)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
