"""Fleet benchmark: claim throughput across worker processes, crash takeover time, and no-op latency.

    python -m benchmarks.fleet                         # every scenario, 3 repeats, medians
    python -m benchmarks.fleet --dsn postgresql://postgres@127.0.0.1:5432/test --repeats 3
    python -m benchmarks.fleet --scenarios throughput --workflows 2000 --repeats 1
    python -m benchmarks latency | recovery [--quick]  # the latency or failover scenario alone

Every worker is a real ``python -m pgflow worker benchmarks.fleet_app:app`` process (PYTHONPATH is the
checkout, PGFLOW_DSN and PGFLOW_SCHEMA say where); the orchestrator (this module) has an App of its own
with the same workflows. Every scenario run gets a fresh schema, dropped afterwards; every subprocess is
terminated (then killed) in a ``finally``; every run has a deadline (--timeout) (fleet_bench.py).

Scenarios (fleet_scenarios.py, fleet_failover.py), each run once per repeat, in the same order, so
ratios compare runs made side by side:

  throughput  N no-op workflows are enqueued from this process (start_async, many at once) before any
              worker runs; then 1 worker process (--concurrency 64) starts, and the table is polled every
              50 ms until all N have succeeded. The same again with --processes 4 (the supervisor and
              its 4 children). workflows/s = N / (first claim -> last finish), both taken from the
              server's started_at/finished_at; "wall" also counts process start-up and the 50 ms poll.
  failover    worker A (lease 10 s, and again with --lease 2) runs a workflow that never stops: a
              20 ms step, then a stream chunk, in a loop. Worker B is started and left idle; A is
              SIGKILLed at a random point of its heartbeat cycle. Measured from the kill: B's claim (a
              10 ms poll of the row's attempt), B's first new step record (now() of its insert) and B's
              first new chunk (the time.time() it carries). A dead worker's lease runs out between
              lease*2/3 and lease after the kill (leases are renewed every lease/3), and an idle worker
              looks for expired leases on its slow poll (poll_interval, 1 s): so the takeover takes at
              most lease + 1 s, plus a step.
  latency     one idle worker process; this process starts a no-op workflow and waits for it with
              handle.result(), sequentially (--latency-gap seconds apart), --latency-runs times after a
              warm-up: p50/p99, and where the time goes, from each row's created_at/started_at/
              finished_at (now() of the enqueue, claim and finish statements) against this process's
              clock (the server is on this machine).

On a small shared machine other processes (a test suite, another benchmark) skew every figure, so each
run first waits (up to --quiet-wait s) for the machine to be nearly idle, and the CPU used during the
run is accounted: the worker processes, the server (its postmaster and every backend), this process,
and "other" (everything else on the machine, from /proc/stat). A run during which others used more than
--max-other of a core is redone, up to --tries times; medians leave out the noisy runs that remain when
clean ones exist (the table marks them with '*'), and the discarded runs are kept in the results file.

Results go to benchmarks/results/fleet-<date>-pg<major>[-embedded].json (one file per server and day); a
table is printed at the end (fleet_report.py). ``--summarize FILE`` prints a results file's table again.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import platform
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import fleet_report, harness
from benchmarks.fleet_app import DEFAULT_POLL, STEP_SLEEP
from benchmarks.fleet_bench import Bench
from benchmarks.fleet_failover import failover
from benchmarks.fleet_scenarios import latency, throughput

SCENARIOS = ["throughput", "failover", "latency"]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dsn", default=None, help="server to use (default $PGFLOW_DSN, else the embedded PG18)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of every scenario; medians are reported")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma list from {','.join(SCENARIOS)}")
    p.add_argument("--workflows", type=int, default=5000, help="no-op workflows per throughput run")
    p.add_argument("--concurrency", type=int, default=64, help="--concurrency of each worker process")
    p.add_argument("--processes", default="1,4", help="worker process counts compared for throughput")
    p.add_argument("--leases", default="10,2", help="worker leases (s) of the failover runs")
    p.add_argument("--latency-runs", type=int, default=300, help="sequential no-op workflows timed")
    p.add_argument("--latency-warmup", type=int, default=20, help=argparse.SUPPRESS)
    p.add_argument("--latency-gap", type=float, default=0.0, metavar="S",
                   help="seconds between two latency runs: an application's sporadic starts (default 0, back to back)")
    p.add_argument("--quiet-wait", type=float, default=60.0,
                   help="seconds each run waits for the machine to be idle (<25%% busy) before it starts")
    p.add_argument("--max-other", type=float, default=0.3,
                   help="redo a run during which other processes used more than this share of a core")
    p.add_argument("--tries", type=int, default=3, help="runs of a scenario tried before keeping a noisy one")
    p.add_argument("--summarize", default=None, metavar="FILE",
                   help="print the report of an earlier results file again (recomputing its summary)")
    p.add_argument("--pool-size", type=int, default=10, help="pool_size of the workers' App (pgflow's default: 10)")
    p.add_argument("--enqueue-concurrency", type=int, default=200, help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=180.0, help="deadline of one scenario run, seconds")
    p.add_argument("--output", default=None,
                   help="results file (default benchmarks/results/fleet-<date>-pg<major>[-embedded].json)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="record the throughput runs' worker processes with py-spy (raw collapsed stacks) into DIR")
    a = p.parse_args(argv)
    a.process_counts = [int(x) for x in a.processes.split(",") if x.strip()]
    a.leases = [float(x) for x in a.leases.split(",") if x.strip()]
    a.scenarios_run = [s.strip() for s in a.scenarios.split(",") if s.strip()]
    unknown = [s for s in a.scenarios_run if s not in SCENARIOS]
    if unknown and not a.summarize:
        p.error(f"unknown scenario(s) {unknown}; choose from {','.join(SCENARIOS)}")
    return a


def resummarize(a: argparse.Namespace) -> int:
    """--summarize FILE: an earlier results file's report again, its summary recomputed."""
    report = json.loads(Path(a.summarize).read_text())
    settings = report["settings"]
    a.process_counts, a.leases, a.repeats = settings["processes"], settings["leases"], report["repeats"]
    a.max_other = settings.get("max_other", a.max_other)
    report["summary"] = fleet_report.summarize(report["runs"], a)
    report["targets"] = fleet_report.targets(report["summary"])
    fleet_report.print_report(report)
    return 0


def run_all(bench: Bench) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every scenario once per repeat, in the same order. A run during which other processes held the
    CPUs (a shared machine) is redone, up to --tries times; the discarded ones are returned apart."""
    a = bench.a
    runs: list[dict[str, Any]] = []
    discarded: list[dict[str, Any]] = []

    def measured(run: Callable[[], dict[str, Any]]) -> None:
        for attempt in range(a.tries):
            r = run()
            other = r.get("other_cpu_share")
            if r.get("ok") and other is not None and other > a.max_other and attempt + 1 < a.tries:
                r["discarded_because"] = f"other processes used {other:.0%} of a core during the run"
                discarded.append(r)
                print(f"  [{r['repeat'] + 1}/{a.repeats}] redone, {r['discarded_because']}: "
                      f"{fleet_report.describe(r)}", flush=True)
                continue
            runs.append(r)
            status = (fleet_report.describe(r) if r.get("ok")
                      else f"FAILED: {str(r.get('error')).splitlines()[0][:200]}")
            print(f"  [{r['repeat'] + 1}/{a.repeats}] {status}", flush=True)
            return

    for repeat in range(a.repeats):
        for processes in a.process_counts if "throughput" in a.scenarios_run else []:
            measured(functools.partial(throughput, bench, processes, repeat))
        for lease in a.leases if "failover" in a.scenarios_run else []:
            measured(functools.partial(failover, bench, lease, repeat))
        if "latency" in a.scenarios_run:
            measured(functools.partial(latency, bench, repeat))
    return runs, discarded


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.summarize:
        return resummarize(a)
    # A SIGTERM unwinds like Ctrl-C, through the finally blocks that stop every worker process.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with harness.serving(a.dsn) as (dsn, server_kind):
        info = harness.server_info(dsn)
        logdir = Path(tempfile.mkdtemp(prefix="pgflow-fleet-"))
        print(f"server: PostgreSQL {info['server_version']} ({server_kind}); logs in {logdir}", flush=True)
        runs, discarded = run_all(Bench(a, dsn, logdir, info.get("postmaster_pid")))
    summary = fleet_report.summarize(runs, a)
    report = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "server": info, "server_kind": server_kind, "versions": harness.versions(), "repeats": a.repeats,
        "settings": {"workflows": a.workflows, "concurrency": a.concurrency, "pool_size": a.pool_size,
                     "processes": a.process_counts, "leases": a.leases, "poll_interval": DEFAULT_POLL,
                     "step_s": STEP_SLEEP, "latency_runs": a.latency_runs, "latency_warmup": a.latency_warmup,
                     "latency_gap": a.latency_gap,
                     "scenarios": a.scenarios_run, "max_other": a.max_other, "tries": a.tries},
        "summary": summary, "runs": runs, "discarded": discarded, "targets": fleet_report.targets(summary),
    }
    # One file per server and day, so the runs against two servers do not overwrite each other.
    tag = harness.pg_major(info) + ("-embedded" if server_kind == "embedded" else "")
    out = harness.write_report(report, a.output, f"fleet-{dt.date.today().isoformat()}-{tag}.json")
    fleet_report.print_report(report)
    print(f"\nwrote {out}")
    return 0 if all(r.get("ok") for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
