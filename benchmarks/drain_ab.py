"""Two checkouts' CLI workers side by side: the worker CPU per no-op workflow while draining a backlog.

``python -m benchmarks.drain_ab --checkout before=/tmp/old --checkout after=. [--rounds 5]``

On this 2-core machine a benchmark's figures drift by a quarter within an hour, and whichever run comes
second in a pair of runs may gain from the one before: so the checkouts take turns on one server
(the order reversed every round), each on a database of its own that its own migrations made, each
drain starting from the same state (the backlog queued with ``start_many``, the table vacuumed, a
checkpoint taken), and the medians over the rounds are compared.
Each drain is a ``pgflow worker`` process of its checkout at its default INFO level, as a user runs
it; its CPU (``/proc``) is counted from its first finished workflow, so its start-up is left out.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

from benchmarks import harness

APP = "benchmarks.peers.pgflow_peer:app"
QUEUE_BACKLOG = "import os, benchmarks.peers.pgflow_peer as p; p.noop.start_many([()] * int(os.environ['BENCH_TASKS']))"
SETUP = "import asyncio, benchmarks.peers.pgflow_peer as p; asyncio.run(p.setup())"
DONE = "SELECT count(*) FROM pgflow.workflows WHERE status = 'succeeded'"


def drain(checkout: Path, dsn: str, concurrency: int, tasks: int, log_path: Path) -> dict[str, float]:
    """One drain of ``tasks`` queued no-ops by ``checkout``'s CLI worker: its CPU per workflow and rate."""
    env = {**os.environ, "BENCH_DSN": dsn, "PGFLOW_DSN": dsn, "PYTHONPATH": str(checkout), "BENCH_TASKS": str(tasks)}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE pgflow.workflows CASCADE")
        subprocess.run([sys.executable, "-c", QUEUE_BACKLOG], cwd=checkout, env=env, check=True)
        conn.execute("VACUUM ANALYZE pgflow.workflows")
        conn.execute("CHECKPOINT")
        with log_path.open("ab") as out:
            worker = subprocess.Popen([sys.executable, "-m", "pgflow", "--log-level", "INFO", "worker", APP,
                                       "--concurrency", str(concurrency), "--grace", "0"],
                                      cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=out)
        try:
            mark: tuple[int, float, float] | None = None
            while (done := conn.execute(DONE).fetchone()[0]) < tasks:  # type: ignore[index]
                if mark is None and done:
                    mark = done, harness.process_cpu(worker.pid), time.monotonic()
                if worker.poll() is not None:
                    raise harness.RunFailed(f"the worker of {checkout} exited; see {log_path}")
                time.sleep(0.02)
            cpu, at = harness.process_cpu(worker.pid), time.monotonic()
        finally:
            worker.terminate()
            worker.wait(30)
    if mark is None:
        raise harness.RunFailed("the backlog was drained before the first look: use more --tasks")
    counted = tasks - mark[0]
    return {"cpu_us_per_workflow": (cpu - mark[1]) / counted * 1e6, "per_s": counted / (at - mark[2])}


def database(checkout: str) -> str:
    return "pgflow_bench_drain_ab_" + "".join(c if c.isalnum() else "_" for c in checkout.lower())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.drain_ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkout", action="append", required=True, metavar="NAME=DIR",
                   help="a checkout to run (twice or more)")
    p.add_argument("--concurrency", default="16,64", help="worker concurrencies, comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tasks", type=int, default=20000)
    p.add_argument("--dsn", default=None)
    a = p.parse_args(argv)
    checkouts = {name: Path(path).resolve() for name, _, path in (c.partition("=") for c in a.checkout)}
    admin = harness.resolve_dsn(a.dsn)
    info = harness.server_info(admin)
    # A database per checkout, migrated by that checkout: one whose migrations change the schema
    # (an index dropped, say) must not run the other on its schema.
    dsns = {name: harness.recreate_database(admin, database(name)) for name in checkouts}
    for name, checkout in checkouts.items():
        env = {**os.environ, "BENCH_DSN": dsns[name], "PYTHONPATH": str(checkout)}
        subprocess.run([sys.executable, "-c", SETUP], cwd=checkout, env=env, check=True)
    runs: list[dict[str, Any]] = []
    try:
        for round_ in range(a.rounds):
            order = list(checkouts.items())[:: 1 if round_ % 2 == 0 else -1]
            for concurrency in (int(c) for c in a.concurrency.split(",")):
                for name, checkout in order:
                    figures = drain(checkout, dsns[name], concurrency, a.tasks, Path(f"/tmp/drain-ab-{name}.log"))
                    runs.append({"checkout": name, "concurrency": concurrency, "round": round_, **figures})
                    harness.log(f"round {round_} {name:>10} c{concurrency}: {figures['cpu_us_per_workflow']:6.1f} us"
                                f" per workflow, {figures['per_s']:7,.0f}/s")
    finally:
        for name in checkouts:
            harness.drop_database(admin, database(name))
    medians = {f"{name} c{c}": {k: harness.median([r[k] for r in runs if r["checkout"] == name
                                                    and r["concurrency"] == c])
                                for k in ("cpu_us_per_workflow", "per_s")}
               for c in sorted({r["concurrency"] for r in runs}) for name in checkouts}
    for key, m in medians.items():
        harness.log(f"{key}: median {m['cpu_us_per_workflow']:.1f} us per workflow, {m['per_s']:,.0f}/s")
    report = {"benchmark": "drain_ab", "checkouts": {k: str(v) for k, v in checkouts.items()},
              "tasks": a.tasks, "rounds": a.rounds, "medians": medians, "runs": runs, "server": info}
    return report


if __name__ == "__main__":
    out = main()
    path = harness.save("drain-ab", out["server"], out, out["medians"])
    harness.log(f"wrote {path}")
