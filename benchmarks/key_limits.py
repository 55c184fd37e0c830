"""What per-key limits cost, and what their turns buy: ``python -m benchmarks.key_limits [--repeats 3]``.

1. **drain**: 20,000 queued no-op workflows drained by one ``pgflow worker`` process at concurrency 64,
   timed by the database (the first claim to the last end), in four queues:
   ``plain`` (no limits, no keys: the claim of every queue without limits), ``capped`` (a queue
   concurrency of 64, no keys: the limited queues' claim under the queue's row lock, which never binds
   here), ``keyed`` (key_concurrency=2 over 1,000 keys, 20 workflows each: the walk over the keys) and
   ``keyed_rate`` (the same with a per-key rate that never binds: each key's bucket read and written).
2. **lone**: a hot key's backlog of 10,000 no-ops drained at concurrency 64, and 200 workflows of other
   keys (one each) started while it drains, one every 10 ms: how long each waited to be claimed (the
   claim's time less its start's, both the database's clock). In ``fair`` (key_concurrency=1,000, so the
   hot key may take every slot) a lone key's workflow has its turn in the next claim round; in
   ``fifo`` (no limits, no keys) it waits behind the backlog.

The scenarios take turns within each repeat, on one database that this checkout's migrations made,
each run starting from the same state (the tables emptied, vacuumed, a checkpoint taken), and the
medians over the repeats are reported (this 2-core machine is shared, and its speed varies).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

import pgflow
from benchmarks import harness

DATABASE = "pgflow_bench_key_limits"
APP = "benchmarks.key_limits:app"
CONCURRENCY = 64
DRAIN_TASKS, KEYS = 20_000, 1_000
HOT_BACKLOG, LONE_STARTS, LONE_EVERY = 10_000, 200, 0.01

app = pgflow.App(os.environ.get("BENCH_DSN"))  # the worker's and the client's (lazy: nothing connects on import)
app.queue("capped", concurrency=CONCURRENCY)
app.queue("keyed", key_concurrency=2)
app.queue("keyed_rate", key_concurrency=2, key_rate_limit=1_000_000, per=1)
app.queue("fair", key_concurrency=1_000)


@app.workflow(name="bench.keys.noop", queue="plain")
async def noop(n: int) -> None:
    return None


@app.workflow(name="bench.keys.keyed_noop", queue="keyed", key=lambda n: f"tenant-{n % KEYS}")
async def keyed_noop(n: int) -> None:
    return None


def reset(conn: psycopg.Connection[Any]) -> None:
    conn.execute("TRUNCATE pgflow.workflows, pgflow.queue_keys CASCADE")
    conn.execute("UPDATE pgflow.queues SET key_cursor = NULL")


def settle(conn: psycopg.Connection[Any]) -> None:
    conn.execute("VACUUM ANALYZE pgflow.workflows")
    conn.execute("CHECKPOINT")


def worker(queue: str, env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "pgflow", "--log-level", "WARNING", "worker", APP,
                                 "--concurrency", str(CONCURRENCY), "--queues", queue, "--grace", "0"],
                                cwd=harness.ROOT, env=env, stdout=subprocess.DEVNULL, stderr=out)


def wait_done(conn: psycopg.Connection[Any], proc: subprocess.Popen[bytes], queue: str, count: int,
              log_path: Path) -> None:
    while conn.execute("SELECT count(*) FROM pgflow.workflows WHERE queue = %s AND status = 'succeeded'",
                       (queue,)).fetchone()[0] < count:  # type: ignore[index]
        if proc.poll() is not None:
            raise harness.RunFailed(f"the worker exited; see {log_path}")
        time.sleep(0.05)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def drain(queue: str, dsn: str, env: dict[str, str], log_path: Path) -> dict[str, float]:
    """One drain of DRAIN_TASKS no-ops in ``queue``: workflows per second, by the database's clock."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        reset(conn)
        if queue in ("keyed", "keyed_rate"):
            keyed_noop.with_options(queue=queue).start_many([(n,) for n in range(DRAIN_TASKS)])
        else:
            noop.with_options(queue=queue).start_many([(n,) for n in range(DRAIN_TASKS)])
        settle(conn)
        proc = worker(queue, env, log_path)
        try:
            wait_done(conn, proc, queue, DRAIN_TASKS, log_path)
        finally:
            stop(proc)
        seconds = conn.execute("SELECT extract(epoch FROM max(finished_at) - min(started_at))::float8"
                               " FROM pgflow.workflows").fetchone()[0]  # type: ignore[index]
    return {"per_s": DRAIN_TASKS / float(seconds), "seconds": float(seconds)}


async def lone_starts(queue: str) -> None:
    """LONE_STARTS workflows of keys of their own, one every LONE_EVERY seconds (fifo: no keys)."""
    for i in range(LONE_STARTS):
        began = time.monotonic()
        options: dict[str, Any] = {"key": f"lone-{i}"} if queue == "fair" else {}
        await noop.with_options(queue=queue, id=f"lone-{i}", **options).start_async(-1 - i)
        await asyncio.sleep(max(0.0, LONE_EVERY - (time.monotonic() - began)))


def lone(queue: str, dsn: str, env: dict[str, str], log_path: Path) -> dict[str, float]:
    """The waits of lone keys' workflows started while a hot key's backlog drains in ``queue``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        reset(conn)
        starter = noop.with_options(queue=queue, key="hot") if queue == "fair" else noop.with_options(queue=queue)
        starter.start_many([(n,) for n in range(HOT_BACKLOG)])
        settle(conn)
        proc = worker(queue, env, log_path)
        try:
            # Once the drain is under way (a few hundred done), the lone ones arrive.
            wait_done(conn, proc, queue, 300, log_path)
            app._client.call(lone_starts, queue)  # noqa: SLF001 - the sync App's loop runs the async starts
            wait_done(conn, proc, queue, HOT_BACKLOG + LONE_STARTS, log_path)
        finally:
            stop(proc)
        waits = [float(w) for (w,) in conn.execute(
            "SELECT extract(epoch FROM started_at - created_at)::float8 FROM pgflow.workflows WHERE id LIKE 'lone-%'"
        ).fetchall()]
        left = conn.execute(  # the hot backlog still queued when the last lone one was claimed
            "SELECT count(*) FROM pgflow.workflows WHERE id NOT LIKE 'lone-%' AND started_at >"
            " (SELECT max(started_at) FROM pgflow.workflows WHERE id LIKE 'lone-%')").fetchone()[0]  # type: ignore[index]
    return {"p50_ms": harness.percentile(waits, 0.5) * 1000, "p99_ms": harness.percentile(waits, 0.99) * 1000,
            "max_ms": max(waits) * 1000, "hot_left": float(left)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.key_limits", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--drains", default="plain,capped,keyed,keyed_rate", help="the drain's queues, comma-separated")
    p.add_argument("--lones", default="fair,fifo", help="the lone keys' queues, comma-separated")
    p.add_argument("--dsn", default=None)
    a = p.parse_args(argv)
    drains, lones = [q for q in a.drains.split(",") if q], [q for q in a.lones.split(",") if q]
    admin = harness.resolve_dsn(a.dsn)
    info = harness.server_info(admin)
    dsn = harness.recreate_database(admin, DATABASE)
    env = {**os.environ, "BENCH_DSN": dsn, "PGFLOW_DSN": dsn, "PYTHONPATH": str(harness.ROOT)}
    os.environ["BENCH_DSN"] = dsn
    app._dsn = dsn  # noqa: SLF001 - the module's App, made before the database was
    app.migrate()
    with psycopg.connect(dsn, autocommit=True) as conn:  # the queues' limits, as a worker declares them
        for queue, limits in app.queues.items():
            conn.execute("INSERT INTO pgflow.queues (name, concurrency, key_concurrency, key_rate_limit, rate_period)"
                         " VALUES (%s, %s, %s, %s, %s)",
                         (queue, limits.concurrency, limits.key_concurrency, limits.key_rate_limit, limits.per))
    runs: list[dict[str, Any]] = []
    log_path = Path("/tmp/bench-key-limits.log")
    try:
        for repeat in range(a.repeats):
            for queue in drains[:: 1 if repeat % 2 == 0 else -1]:
                figures = drain(queue, dsn, env, log_path)
                runs.append({"measure": "drain", "queue": queue, "repeat": repeat, **figures})
                harness.log(f"repeat {repeat} drain {queue:>10}: {figures['per_s']:7,.0f}/s")
            for queue in lones[:: 1 if repeat % 2 == 0 else -1]:
                figures = lone("fair" if queue == "fair" else "plain", dsn, env, log_path)
                runs.append({"measure": "lone", "queue": queue, "repeat": repeat, **figures})
                harness.log(f"repeat {repeat} lone {queue:>5}: p50 {figures['p50_ms']:8.1f} ms,"
                            f" p99 {figures['p99_ms']:8.1f} ms, max {figures['max_ms']:8.1f} ms")
    finally:
        app.close()
        harness.drop_database(admin, DATABASE)
    medians: dict[str, dict[str, Any]] = {}
    for measure, keys in (("drain", ("per_s", "seconds")), ("lone", ("p50_ms", "p99_ms", "max_ms", "hot_left"))):
        for queue in dict.fromkeys(r["queue"] for r in runs if r["measure"] == measure):
            medians[f"{measure} {queue}"] = {k: harness.median([r[k] for r in runs if r["measure"] == measure
                                                                 and r["queue"] == queue]) for k in keys}
    for name, m in medians.items():
        harness.log(f"{name}: " + ", ".join(f"{k} {v:,.1f}" for k, v in m.items() if v is not None))
    return {"benchmark": "key_limits", "repeats": a.repeats, "concurrency": CONCURRENCY, "medians": medians,
            "runs": runs, "server": info, "commit": harness.commit()}


if __name__ == "__main__":
    out = main()
    path = harness.save("key-limits", out["server"], out, out["medians"])
    harness.log(f"wrote {path}")
