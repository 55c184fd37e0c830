"""Queue tables under long transactions: a steady load, then three overlapping 120 s REPEATABLE READ
transactions elsewhere on the server, which hold back vacuum's horizon for 200 s.

    python -m benchmarks.long_transaction                       # PG15 on 127.0.0.1:5432, 500 workflows/s
    python -m benchmarks.long_transaction --rate 800 --dsn ...   # (make longtx BENCH_ARGS='--rate 800')
    python -m benchmarks.long_transaction --quick                # 30 s transactions, shorter phases

The load: this process starts no-op workflows of one step at ``--rate`` per second (``start_many``
every 100 ms); a ``pgflow worker`` process (--concurrency 64) claims, runs and ends them. After
``--before`` seconds of steady load, three connections each open a REPEATABLE READ transaction, read
the workflows table (the snapshot is taken) and sit in ``pg_sleep`` for ``--hold`` seconds, started
``--hold / 3`` apart; then ``--after`` seconds more. Every ``--sample`` seconds a monitor connection
records:

- throughput: workflows finished in the interval (their ``finished_at``), per second;
- claim latency: p50 / p99 of ``started_at - created_at`` of those (enqueue to claim);
- backlog: the queued rows (a count; "started so far minus finished so far" is logged beside it
  as in flight, but drifts: a row whose end commits after the sample's snapshot, with a finished_at
  before it, is counted in no interval);
- dead tuples of the workflows table (``pg_stat_user_tables.n_dead_tup``, the statistics' estimate);
- the queued index (``workflows_queued``): its entries (every heap pointer on its leaf pages, from
  ``pageinspect``), minus the live queued rows, is the dead entries a claim walks over; its size in
  pages; and the claim's two scans (due queued rows, expired leases) run by themselves under
  ``EXPLAIN (ANALYZE, BUFFERS)``: their time and the buffers they touch.

Each phase (before, during, after) is summarised; "recovered" is the seconds from the last long
transaction's end until the throughput of a sample is back to >= 90% of before's and the backlog to
at most twice before's largest (or 50). The target: during >= 90% of before, recovered within 60 s.

Results: benchmarks/results/long-transaction-<time>-pg<major>.json (every sample, and the summary).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

import pgflow

try:
    from pgflow._core.engine.claims import FLOOR_MARGIN, FLOORS
except ImportError:  # a pgflow from before the bounded claims (an A/B run against an older checkout)
    FLOORS, FLOOR_MARGIN = "", 0.0

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"

def build(target: pgflow.App) -> pgflow.Workflow[[int], int]:
    """The workload's one workflow (a step, then its end), registered on ``target``: the worker
    process's App and this process's register it under the same names."""

    @target.step(name="longtx.step")
    async def step(i: int) -> int:
        return i + 1

    @target.workflow(name="longtx.flow")
    async def flow(i: int) -> int:
        return await step(i)

    return flow


app = pgflow.App()  # the worker process's: PGFLOW_DSN and PGFLOW_SCHEMA say where
build(app)


def log(*parts: Any) -> None:
    print(*parts, file=sys.stderr, flush=True)


async def produce(flow: pgflow.Workflow[[int], int], rate: float, stop: asyncio.Event, counts: dict[str, int]) -> None:
    """``rate`` starts a second, in a batch every 100 ms, on a fixed schedule (a late batch is not
    made up by a bigger one: the offered load stays what it was)."""
    tick = 0.1
    per_batch = max(1, round(rate * tick))
    next_at = time.monotonic()
    while not stop.is_set():
        base = counts["started"]
        await flow.start_many_async([(base + k,) for k in range(per_batch)])
        counts["started"] += per_batch
        next_at += tick
        delay = next_at - time.monotonic()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
        else:
            next_at = time.monotonic()


async def hold(dsn: str, schema: str, seconds: float, marks: list[dict[str, float]], t0: float) -> None:
    """One long REPEATABLE READ transaction: a read of the workflows table takes the snapshot, then
    it stays open (active, in pg_sleep) for ``seconds``."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True,
                                                     application_name="longtx-analytics") as conn:
        began = time.monotonic() - t0
        async with conn.transaction():
            await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            await conn.execute(f'SELECT count(*) FROM "{schema}".workflows')
            await conn.execute("SELECT pg_sleep(%s)", (seconds,))
        marks.append({"began": began, "ended": time.monotonic() - t0})


SAMPLE = """
WITH done AS (SELECT extract(epoch FROM started_at - created_at) AS wait FROM {s}.workflows
              WHERE status IN ('succeeded', 'failed', 'cancelled') AND finished_at > %(since)s
              AND finished_at <= %(until)s)
SELECT (SELECT count(*) FROM done),
       (SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY wait) FROM done),
       (SELECT percentile_cont(0.99) WITHIN GROUP (ORDER BY wait) FROM done),
       (SELECT n_dead_tup FROM pg_stat_user_tables WHERE schemaname = %(schema)s AND relname = 'workflows'),
       (SELECT count(*) FROM {s}.workflows WHERE status = 'queued'),
       pg_relation_size(%(index)s::regclass) / current_setting('block_size')::int,
       (SELECT count(*) FROM pg_stat_activity WHERE application_name = 'longtx-analytics'
                                                AND state = 'active')
"""

# Every heap pointer of the index's leaf pages (a deduplicated posting list holds many; the high key
# of a page that has a right sibling holds none): live entries and entries of dead row versions.
ENTRIES = """
SELECT coalesce(sum(coalesce(array_length(i.tids, 1), 1)), 0)
FROM generate_series(1, (pg_relation_size(%(index)s::regclass) / current_setting('block_size')::int)::int - 1) b,
     bt_page_stats(%(index)s::text, b) p, bt_page_items(%(index)s::text, b) i
WHERE p.type = 'l' AND NOT (p.btpo_next <> 0 AND i.itemoffset = 1)
"""

# The scans of the claim statement (pgflow/_core/engine/claims.py), without their locks: what one
# claim walks (buffers) and how long that takes, as the dead entries pile up.
PROBES = {
    "queued": "SELECT id FROM {s}.workflows WHERE status = 'queued' AND queue = 'default' AND due_at <= now()"
              " ORDER BY priority DESC, due_at LIMIT 64",
    # A bounded claim's scan (most claims, since the floors): from the floor a full claim computes.
    "bounded": "SELECT id FROM {s}.workflows WHERE status = 'queued' AND queue = 'default' AND due_at <= now()"
               " AND due_at >= '{floor}'::timestamptz ORDER BY priority DESC, due_at LIMIT 64",
    "expired": "SELECT id FROM {s}.workflows WHERE status = 'running' AND lease_expires_at < now()"
               " AND queue = ANY(ARRAY['default']) ORDER BY lease_expires_at LIMIT 64",
}


async def monitor(dsn: str, schema: str, every: float, stop: asyncio.Event, counts: dict[str, int],
                  samples: list[dict[str, Any]], t0: float) -> None:
    s = f'"{schema}"'
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True, application_name="longtx-monitor") as conn:
        await conn.execute("CREATE EXTENSION IF NOT EXISTS pageinspect")
        since = (await (await conn.execute("SELECT now()")).fetchone())[0]  # type: ignore[index]
        finished = 0
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every)
            until = (await (await conn.execute("SELECT now()")).fetchone())[0]  # type: ignore[index]
            row = await (await conn.execute(SAMPLE.format(s=s), {
                "since": since, "until": until, "schema": schema, "index": f"{s}.workflows_queued"})).fetchone()
            assert row is not None
            n, p50, p99, dead, queued, pages, holding = row
            entries = (await (await conn.execute(ENTRIES, {"index": f"{s}.workflows_queued"})).fetchone())[0]  # type: ignore[index]
            probes = {}
            floor = None
            if FLOORS:
                floor = (await (await conn.execute(FLOORS.replace("{s}", s), {
                    "queues": ["default"], "names": ["longtx.flow"], "margin": FLOOR_MARGIN})).fetchone())[1]  # type: ignore[index]
            for name, probe in PROBES.items():
                if floor is None and name == "bounded":
                    continue
                plan = (await (await conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "
                                                  + probe.format(s=s, floor=floor))).fetchone())[0][0]  # type: ignore[index]
                probes[f"{name}_scan_ms"] = round(plan["Execution Time"], 3)
                probes[f"{name}_scan_buffers"] = plan["Plan"].get("Shared Hit Blocks", 0) + plan["Plan"].get(
                    "Shared Read Blocks", 0)
            finished += n
            seconds = (until - since).total_seconds()
            samples.append({
                "t": round(time.monotonic() - t0, 2), "per_s": round(n / seconds, 1),
                "p50_ms": None if p50 is None else round(p50 * 1000, 2),
                "p99_ms": None if p99 is None else round(p99 * 1000, 2),
                "backlog": counts["started"] - finished, "dead_tuples": dead, "queued": queued,
                "index_entries": entries, "index_dead": max(0, entries - queued), "index_pages": pages,
                **probes, "long_transactions": holding})
            last = samples[-1]
            log(f"t={last['t']:7.1f}s {last['per_s']:7.1f}/s p50 {last['p50_ms']} p99 {last['p99_ms']} ms"
                f" queued {queued:6d} in flight {last['backlog']:6d} dead {dead:7d} index dead {last['index_dead']:7d}"
                f" pages {pages:5d} scans {probes['queued_scan_ms']}/{probes['expired_scan_ms']} ms"
                f" (bounded {probes.get('bounded_scan_ms')} ms)"
                f" long tx {holding}")
            since = until


async def watching(seconds: float, tasks: list[asyncio.Task[None]]) -> None:
    """Wait ``seconds``, or fail at once when one of the ``tasks`` (the load, the monitor) did."""
    done, _ = await asyncio.wait(tasks, timeout=seconds, return_when=asyncio.FIRST_EXCEPTION)
    for task in done:
        task.result()


def summarise(samples: list[dict[str, Any]], marks: list[dict[str, float]], before_from: float,
              during: tuple[float, float]) -> dict[str, Any]:
    def phase(rows: list[dict[str, Any]]) -> dict[str, Any]:
        if not rows:
            return {}
        p50s = [r["p50_ms"] for r in rows if r["p50_ms"] is not None]
        p99s = [r["p99_ms"] for r in rows if r["p99_ms"] is not None]
        return {"per_s": round(statistics.mean(r["per_s"] for r in rows), 1),
                "p50_ms": round(statistics.median(p50s), 2) if p50s else None,
                "p99_ms": round(max(p99s), 2) if p99s else None,
                "backlog_max": max(r["queued"] for r in rows),
                "dead_tuples_max": max(r["dead_tuples"] or 0 for r in rows),
                "index_dead_max": max(r["index_dead"] for r in rows),
                "index_pages_max": max(r["index_pages"] for r in rows),
                "queued_scan_ms_max": max(r["queued_scan_ms"] for r in rows),
                "expired_scan_ms_max": max(r["expired_scan_ms"] for r in rows),
                **({"bounded_scan_ms_max": max(r["bounded_scan_ms"] for r in rows)} if "bounded_scan_ms" in rows[0]
                   else {})}

    start, end = during
    before = phase([r for r in samples if before_from <= r["t"] <= start])
    inside = phase([r for r in samples if start < r["t"] <= end])
    after_rows = [r for r in samples if r["t"] > end]
    after = phase(after_rows)
    recovered = None
    if before:
        for r in after_rows:
            if r["per_s"] >= 0.9 * before["per_s"] and r["queued"] <= max(2 * before["backlog_max"], 50):
                recovered = round(r["t"] - end, 1)
                break
    ratio = round(inside["per_s"] / before["per_s"], 3) if before and inside and before["per_s"] else None
    return {"before": before, "during": inside, "after": after, "during_over_before": ratio,
            "recovered_after_s": recovered, "long_transactions": marks,
            "target_met": ratio is not None and ratio >= 0.9 and recovered is not None and recovered <= 60}


async def run(a: argparse.Namespace) -> dict[str, Any]:
    schema = f"longtx_{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PGFLOW_DSN": a.dsn, "PGFLOW_SCHEMA": schema, "PGFLOW_LOG_LEVEL": "WARNING",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("PGFLOW_LISTEN_DSN", None)
    client = pgflow.App(a.dsn, schema=schema)
    flow = build(client)
    worker: subprocess.Popen[bytes] | None = None
    tasks: list[asyncio.Task[None]] = []
    try:
        await client.migrate_async()
        worker = subprocess.Popen([sys.executable, "-m", "pgflow", "worker", "benchmarks.long_transaction:app",
                                   "--concurrency", str(a.concurrency)], env=env, cwd=ROOT,
                                  stdin=subprocess.DEVNULL)
        counts = {"started": 0}
        samples: list[dict[str, Any]] = []
        marks: list[dict[str, float]] = []
        stop = asyncio.Event()
        t0 = time.monotonic()
        tasks += [asyncio.create_task(produce(flow, a.rate, stop, counts)),
                 asyncio.create_task(monitor(a.dsn, schema, a.sample, stop, counts, samples, t0))]
        await watching(a.warmup + a.before, tasks)
        during_start = time.monotonic() - t0
        holders = []
        for k in range(3):
            holders.append(asyncio.create_task(hold(a.dsn, schema, a.hold, marks, t0)))
            if k < 2:
                await watching(a.hold / 3, tasks)
        while not all(holder.done() for holder in holders):
            await watching(1.0, tasks + [holder for holder in holders if holder.done()])
        await asyncio.gather(*holders)
        during_end = time.monotonic() - t0
        await watching(a.after, tasks)
        stop.set()
        await asyncio.gather(*tasks)
        summary = summarise(samples, marks, a.warmup, (during_start, during_end))
        return {"settings": {k: v for k, v in vars(a).items() if k != "dsn"}, "schema": schema,
                "summary": summary, "samples": samples}
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if worker is not None:
            worker.terminate()
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        await client.close_async()
        with psycopg.connect(a.dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.long_transaction", description=__doc__.split("\n\n")[0])
    p.add_argument("--dsn", default=os.environ.get("PGFLOW_DSN") or DEFAULT_DSN)
    p.add_argument("--rate", type=float, default=500.0, help="workflows started per second")
    p.add_argument("--concurrency", type=int, default=64, help="the worker's --concurrency")
    p.add_argument("--warmup", type=float, default=20.0, help="seconds of load left out of every phase")
    p.add_argument("--before", type=float, default=60.0, help="seconds of steady load before the transactions")
    p.add_argument("--hold", type=float, default=120.0, help="seconds each long transaction stays open")
    p.add_argument("--after", type=float, default=120.0, help="seconds of load after the last one ends")
    p.add_argument("--sample", type=float, default=2.0, help="seconds between samples")
    p.add_argument("--quick", action="store_true", help="30 s transactions, 30 s before and 60 s after")
    p.add_argument("--label", default="", help="a word for the results file name")
    p.add_argument("--output", default=None, help="results file")
    p.add_argument("--summarize", default=None, metavar="FILE",
                   help="print a results file's summary again, its phases taken from the transactions' marks")
    a = p.parse_args(argv)
    if a.summarize:
        report = json.loads(Path(a.summarize).read_text())
        marks = report["summary"]["long_transactions"]
        report["summary"] = summarise(report["samples"], marks, report["settings"]["warmup"],
                                      (min(m["began"] for m in marks), max(m["ended"] for m in marks)))
        Path(a.summarize).write_text(json.dumps(report, indent=1, default=str))
        print_summary(report["summary"])
        return
    if a.quick:
        a.warmup, a.before, a.hold, a.after = 10.0, 30.0, 30.0, 60.0
    report = asyncio.run(run(a))
    with psycopg.connect(a.dsn) as conn:
        major = conn.info.server_version // 10000
    report["server"] = f"PostgreSQL {major}"
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H%M")
    out = Path(a.output) if a.output else HERE / "results" / (
        f"long-transaction-{stamp}{'-' + a.label if a.label else ''}-pg{major}.json")
    out.write_text(json.dumps(report, indent=1, default=str))
    log(f"results in {out}")
    print_summary(report["summary"])


def print_summary(s: dict[str, Any]) -> None:
    for name in ("before", "during", "after"):
        log(f"{name:7s} {json.dumps(s[name])}")
    log(f"during/before {s['during_over_before']}, recovered {s['recovered_after_s']} s after,"
        f" target {'met' if s['target_met'] else 'MISSED'}")


if __name__ == "__main__":
    main()
