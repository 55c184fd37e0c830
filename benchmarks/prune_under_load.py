"""Stream throughput while a prune of a million chunks runs, against the same load without it.

    python benchmarks/prune_under_load.py --dsn postgresql://postgres@127.0.0.1:5432/test
    python benchmarks/prune_under_load.py --repeats 1 --old-workflows 2000     # a quick look

For each repeat, in a schema of its own (dropped at the end):

1. fill: ``--old-workflows`` workflows that finished 30 days ago, each with one step and
   ``--old-chunks`` stream chunks (10,000 x 100 = 1M chunks by default), generated in SQL with
   ``generate_series`` (not through the API), then VACUUM ANALYZE;
2. prune run: the streaming load (below), and ``app.prune(older_than=7 days)`` started ``--warm``
   seconds into it, from this process; the rate is taken over the prune's run;
3. fill again, and the baseline: the same load alone, the old rows present, its rate taken over the
   same window (offsets from the load's start) as the prune run's.

At the end, one more fill and the prune alone, for scale (its time and the WAL it wrote).

``--mode`` says which prune: ``partitions`` (pgflow's: the workflows and their stream names are
deleted in paced batches, then the partition the old streams began in is dropped whole; the schema's
clock is moved two days on after each fill, so that partition's day is over, as it is for chunks kept
a week), or ``rows`` (the version before partitioning: the same batches delete every chunk row by row,
the statement being that version's). ``--mode both`` runs the two one after the other.

The streaming load: a writer process runs ``app.worker(concurrency=N)`` and ``--streams`` workflows
that each write chunks flat out (``await pgflow.write_stream_async``) until ``--duration`` seconds
are over, then close their stream; a reader process follows every stream with ``stream_async``. The
writer samples how many chunks have committed every 0.1 s; chunks/s is taken over a window: the
prune's run (clipped to the load) in a prune run, the same offsets in the baseline after it. Prune
and baseline runs alternate, and the medians and the median of the per-repeat ratios are printed
and written to benchmarks/results/prune-under-load-<date>-pg<major>-share<S>-batch<B>.json. ``--share`` sets
the pruner's pacing (the share of the time it spends in its statements; 1 is no pause at all).
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
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

import pgflow  # noqa: E402
from benchmarks.costs import Wal  # noqa: E402
from pgflow._core import pruning  # noqa: E402

KEY = "tokens"
COMMITTED = [0]  # chunks whose write returned, in the writer process


def build(app: pgflow.App) -> Any:
    """The load's workflow: chunks flat out until ``until`` (a wall-clock time), then the close."""

    @app.workflow(name="bench.prune_load")
    async def load(until: float) -> int:
        n = 0
        while time.time() < until:
            await pgflow.write_stream_async(KEY, [time.time(), n])
            n += 1
            COMMITTED[0] += 1
        await pgflow.close_stream_async(KEY)
        return n

    return load


def say(kind: str, **data: Any) -> None:
    print("@@ " + json.dumps({"kind": kind, **data}), flush=True)


# -- the writer and reader processes ----------------------------------------------------------------


async def writer(dsn: str, schema: str, concurrency: int) -> None:
    # No retention service: the prune under test is the only one (the worker's own would delete the
    # old rows during the baseline).
    app = pgflow.App(dsn, schema=schema, retention=None)
    build(app)
    samples: list[tuple[float, int]] = []
    async with app.worker(concurrency=concurrency):
        say("ready")
        stop = asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        while not stop.done():
            samples.append((time.time(), COMMITTED[0]))
            await asyncio.sleep(0.1)
    samples.append((time.time(), COMMITTED[0]))
    say("samples", samples=samples)
    await app.close_async()


async def reader(dsn: str, schema: str, ids_file: str) -> None:
    app = pgflow.App(dsn, schema=schema)
    ids = Path(ids_file).read_text().split()
    latencies: list[float] = []

    async def follow(id: str) -> int:
        n = 0
        async for chunk in app.handle(id).stream_async(KEY):
            latencies.append(time.time() - chunk[0])
            n += 1
        return n

    say("ready")
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # "go"
    counts = await asyncio.gather(*(follow(id) for id in ids))
    latencies.sort()
    say("read", chunks=sum(counts), p50=latencies[len(latencies) // 2] if latencies else None,
        p99=latencies[int(len(latencies) * 0.99)] if latencies else None)
    await app.close_async()


# -- the orchestrator --------------------------------------------------------------------------------


class Child:
    """A role of this script in a process of its own, talking in ``@@ {json}`` lines."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT)

    def expect(self, kind: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                message: dict[str, Any] = json.loads(line[3:])
                if message["kind"] == kind:
                    return message
        raise RuntimeError(f"{self.proc.args} ended before saying {kind!r} (exit {self.proc.wait()})")

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def fill(dsn: str, schema: str, workflows: int, chunks: int) -> float:
    """Old finished workflows with a step and ``chunks`` chunks each, in four statements; seconds."""
    began = time.monotonic()
    s = f'"{schema}"'
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO {s}.workflows (id, name, queue, status, inputs, output, attempt, created_at,"
            "  started_at, finished_at)"
            " SELECT 'old-' || g, 'bench.old', 'default', 'succeeded', '\\x90'::bytea, '\\xc0'::bytea, 1,"
            "  now() - interval '30 days', now() - interval '30 days',"
            "  now() - interval '30 days' + g * interval '1 ms'"
            " FROM generate_series(1, %s) g", (workflows,))
        conn.execute(
            f"INSERT INTO {s}.steps (workflow_id, position, name, output, attempts, attempt)"
            " SELECT 'old-' || g, 0, 'bench.step', '\\xc0'::bytea, 1, 1 FROM generate_series(1, %s) g",
            (workflows,))
        conn.execute(
            f"INSERT INTO {s}.stream_ids (workflow_id, key) SELECT 'old-' || g, 'tokens'"
            " FROM generate_series(1, %s) g", (workflows,))
        conn.execute(
            f"INSERT INTO {s}.chunks (stream_id, position, value)"
            " SELECT i.id, p, '\\x92cb41d9b0a3c4000000cd0400'::bytea"
            f" FROM {s}.stream_ids i, generate_series(0, %s) p WHERE i.workflow_id LIKE 'old-%%'", (chunks - 1,))
        for table in ("workflows", "steps", "stream_ids", "chunks"):
            conn.execute(f"VACUUM ANALYZE {s}.{table}")
    return time.monotonic() - began


# The prune of the version before partitioned chunks: the chunks deleted with their workflows, row by row.
ROW_BY_ROW_PRUNE = (
    "WITH doomed AS (SELECT id FROM {s}.workflows"
    "   WHERE status IN ('succeeded', 'failed', 'cancelled')"
    "   AND finished_at < {s}.clock_now() - make_interval(secs => %s)"
    "   ORDER BY finished_at LIMIT %s FOR UPDATE SKIP LOCKED),"
    " named AS (DELETE FROM {s}.stream_ids WHERE workflow_id = ANY(ARRAY(SELECT id FROM doomed)) RETURNING id),"
    " chunks AS (DELETE FROM {s}.chunks WHERE stream_id = ANY(ARRAY(SELECT id FROM named))),"
    " tries AS (DELETE FROM {s}.step_attempts WHERE workflow_id = ANY(ARRAY(SELECT id FROM doomed))),"
    " errors AS (DELETE FROM {s}.step_errors WHERE workflow_id = ANY(ARRAY(SELECT id FROM doomed))),"
    " gone AS (DELETE FROM {s}.workflows WHERE id = ANY(ARRAY(SELECT id FROM doomed)) RETURNING 1)"
    " SELECT count(*) FROM gone")


async def run_prune(app: pgflow.App, args: argparse.Namespace) -> int:
    """The prune under test (``--mode``), of the workflows older than 7 days."""
    batch = args.batch or pruning.PRUNE_BATCH
    if args.current_mode == "partitions":
        return await app.prune_async(dt.timedelta(days=7), batch=batch)
    statement = ROW_BY_ROW_PRUNE.replace("{s}", f'"{app.schema}"')

    async def one_batch() -> int:
        async with await psycopg.AsyncConnection.connect(args.dsn, autocommit=True) as conn:
            row = await (await conn.execute(statement, (7 * 86400.0, batch))).fetchone()
            return int(row[0]) if row else 0

    return await pruning.prune_paced(one_batch, batch)


CLOCK = [0.0]  # the schema clock's offset, seconds


async def fill_apart(app: pgflow.App, args: argparse.Namespace) -> float:
    """``fill``; in partitions mode on a day of its own: the schema's clock is moved two days on
    before (so no stream of a load began in the fill's partition) and after (so its day is over, as
    it is for streams kept a week, and the load's streams begin in the next)."""
    if args.current_mode == "partitions":
        await two_days_on(app)
    took = fill(args.dsn, app.schema, args.old_workflows, args.old_chunks)
    if args.current_mode == "partitions":
        await two_days_on(app)
    return took


async def two_days_on(app: pgflow.App) -> None:
    CLOCK[0] += 2 * 86400.0
    store = await app._client.runtime().store()
    await store.testing.set_clock(CLOCK[0])
    await store.partitions.add_chunk_partitions()


def rate(samples: list[list[float]], start: float, end: float) -> float:
    """Chunks/s between two wall-clock times, from the writer's (time, committed) samples."""
    def at(t: float) -> float:
        before = [s for s in samples if s[0] <= t]
        after = [s for s in samples if s[0] >= t]
        if not before or not after:
            raise ValueError(f"no samples around {t}")
        (t0, c0), (t1, c1) = before[-1], after[0]
        return c0 if t1 == t0 else c0 + (c1 - c0) * (t - t0) / (t1 - t0)
    return (at(end) - at(start)) / (end - start)


async def one_load(app: pgflow.App, wf: Any, args: argparse.Namespace, schema: str, label: str,
                   window: tuple[float, float] | None, prune: bool) -> dict[str, Any]:
    """One run of the load; ``window`` (offsets from the load's start) for the baseline, the prune's
    own run for a prune run."""
    writer_proc = Child("--role", "writer", "--dsn", args.dsn, "--schema", schema,
                        "--concurrency", str(args.streams))
    ids = [f"load-{label}-{i}-{uuid.uuid4().hex[:6]}" for i in range(args.streams)]
    with tempfile.NamedTemporaryFile("w", suffix=".ids", delete=False) as f:
        f.write("\n".join(ids))
    reader_proc = Child("--role", "reader", "--dsn", args.dsn, "--schema", schema, "--ids", f.name)
    try:
        writer_proc.expect("ready")
        reader_proc.expect("ready")
        began = time.time()
        until = began + args.duration
        await wf.start_many_async([(until,) for _ in ids], ids=ids)
        reader_proc.send("go")
        result: dict[str, Any] = {"label": label, "prune": prune}
        if prune:
            await asyncio.sleep(args.warm)
            p0 = time.time()
            deleted = await run_prune(app, args)
            p1 = time.time()
            result.update(prune_s=p1 - p0, deleted=deleted, window=(p0 - began, min(p1, until) - began),
                          prune_outlasted_load=p1 > until)
        else:
            assert window is not None
            result["window"] = window
        for id in ids:
            await app.handle(id).result_async(timeout=args.duration + 120)
        writer_proc.send("stop")
        samples = writer_proc.expect("samples")["samples"]
        read = reader_proc.expect("read")
        w0, w1 = result["window"]
        # The rest of the same run (its first second and last half second left out), for a
        # comparison that the machine's drift between runs cannot blur.
        quiet = [(began + 1.0, began + w0), (began + w1, until - 0.5)]
        quiet = [(a, b) for a, b in quiet if b - a > 0.5]
        result.update(chunks_per_s=rate(samples, began + w0, began + w1),
                      rest_of_run_chunks_per_s=sum(rate(samples, a, b) * (b - a) for a, b in quiet)
                      / sum(b - a for a, b in quiet) if quiet else None,
                      whole_run_chunks_per_s=rate(samples, began + 1.0, until - 0.5),
                      read_p50_ms=1000 * read["p50"], read_p99_ms=1000 * read["p99"], chunks_read=read["chunks"])
        return result
    finally:
        writer_proc.stop()
        reader_proc.stop()
        os.unlink(f.name)


async def orchestrate(args: argparse.Namespace) -> None:
    for mode in (["rows", "partitions"] if args.mode == "both" else [args.mode]):
        args.current_mode = mode
        CLOCK[0] = 0.0
        await orchestrate_mode(args)


async def orchestrate_mode(args: argparse.Namespace) -> None:
    schema = f"bench_prune_{uuid.uuid4().hex[:8]}"
    app = pgflow.App(args.dsn, schema=schema)
    wf = build(app)
    runs: list[dict[str, Any]] = []
    alone, alone_wal, empty = 0.0, 0, {}
    try:
        await app.migrate_async()
        with psycopg.connect(args.dsn) as conn:
            server = str(conn.execute("SHOW server_version").fetchone()[0])  # type: ignore[index]
        # The load with no old chunks at all, to set beside the baselines (with them present).
        empty = await one_load(app, wf, args, schema, "empty", (1.0, args.duration - 0.5), prune=False)
        print(f"{args.current_mode}: the load alone on an empty schema: {empty['chunks_per_s']:,.0f} chunks/s"
              f" (read p50 {empty['read_p50_ms']:.0f} ms, p99 {empty['read_p99_ms']:.0f} ms)", flush=True)
        for repeat in range(args.repeats):
            # Each run right after a fill of its own, so both find the same rows and the fill's
            # checkpoint pressure alike; the baseline is measured over the prune run's window.
            took = await fill_apart(app, args)
            print(f"{args.current_mode}, repeat {repeat + 1}: filled {args.old_workflows * args.old_chunks:,}"
                  f" old chunks in {took:.1f}s", flush=True)
            pruned = await one_load(app, wf, args, schema, f"p{repeat}", None, prune=True)
            print(f"  prune:    {pruned['chunks_per_s']:,.0f} chunks/s (rest of the run"
                  f" {pruned['rest_of_run_chunks_per_s']:,.0f}) over {pruned['window'][0]:.1f}-"
                  f"{pruned['window'][1]:.1f}s; the prune deleted {pruned['deleted']:,} workflows in"
                  f" {pruned['prune_s']:.1f}s{' (outlasting the load)' if pruned['prune_outlasted_load'] else ''}"
                  f" (read p50 {pruned['read_p50_ms']:.0f} ms)", flush=True)
            await fill_apart(app, args)
            base = await one_load(app, wf, args, schema, f"b{repeat}", tuple(pruned["window"]), prune=False)
            print(f"  baseline: {base['chunks_per_s']:,.0f} chunks/s over the same window"
                  f" (read p50 {base['read_p50_ms']:.0f} ms)", flush=True)
            runs += [pruned, base]
            await run_prune(app, args)  # the baseline's old rows, before the next fill
        # The prune alone, for scale.
        await fill_apart(app, args)
        wal = Wal(args.dsn)
        wal.mark(checkpoint=False)
        began = time.monotonic()
        await run_prune(app, args)
        alone, alone_wal = time.monotonic() - began, wal.since(1)["wal_bytes"]
        print(f"the prune alone: {alone:.1f}s, {alone_wal / 1e6:,.0f} MB of WAL", flush=True)
    finally:
        await app.close_async()
        with psycopg.connect(args.dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    bases = [r["chunks_per_s"] for r in runs if not r["prune"]]
    prunes = [r["chunks_per_s"] for r in runs if r["prune"]]
    ratios = [p / b for b, p in zip(bases, prunes, strict=True)]
    in_run = [r["chunks_per_s"] / r["rest_of_run_chunks_per_s"] for r in runs if r["prune"]]
    summary = {"baseline_median": statistics.median(bases), "prune_median": statistics.median(prunes),
               "ratio_median": statistics.median(ratios), "ratios": ratios,
               "in_run_ratio_median": statistics.median(in_run), "in_run_ratios": in_run,
               "prune_s_median": statistics.median(r["prune_s"] for r in runs if r["prune"]),
               "prune_alone_s": alone, "prune_alone_wal_bytes": alone_wal, "empty": empty}
    print(f"median: baseline {summary['baseline_median']:,.0f} chunks/s, during the prune "
          f"{summary['prune_median']:,.0f} chunks/s; ratio per repeat {', '.join(f'{r:.2f}' for r in ratios)}"
          f" (median {summary['ratio_median']:.2f}); against the rest of the same run "
          f"{', '.join(f'{r:.2f}' for r in in_run)} (median {summary['in_run_ratio_median']:.2f});"
          f" prune {summary['prune_s_median']:.1f}s", flush=True)
    out = args.output or HERE / "results" / (
        f"prune-under-load-{dt.date.today().isoformat()}-pg{server.split('.')[0]}-{args.current_mode}"
        f"-{args.old_workflows * args.old_chunks // 1_000_000}M-share{pruning.SHARE:g}"
        f"-batch{args.batch or pruning.PRUNE_BATCH}.json")
    Path(out).write_text(json.dumps({
        "server": server, "share": pruning.SHARE, "mode": args.current_mode,
        "args": {k: v for k, v in vars(args).items() if k not in ("role", "current_mode")},
        "loadavg": os.getloadavg(), "runs": runs, "summary": summary}, indent=1) + "\n")
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["orchestrator", "writer", "reader"], default="orchestrator")
    parser.add_argument("--dsn", default=os.environ.get("PGFLOW_DSN", "postgresql://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--schema")
    parser.add_argument("--ids")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--streams", type=int, default=64, help="concurrent workflows writing (64)")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds each load runs (15)")
    parser.add_argument("--warm", type=float, default=4.0, help="seconds into the load the prune starts (4)")
    parser.add_argument("--old-workflows", type=int, default=10_000)
    parser.add_argument("--old-chunks", type=int, default=100, help="chunks per old workflow (100)")
    parser.add_argument("--batch", type=int, default=0, help="app.prune's batch of workflows (0: its default)")
    parser.add_argument("--share", type=float, default=None,
                        help="the pruner's busy share (default: pgflow's; 1.0: no pause between batches)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mode", choices=["partitions", "rows", "both"], default="partitions",
                        help="the prune: partitions (pgflow's), rows (the version before: chunks deleted row by"
                             " row), or both, one after the other")
    parser.add_argument("--output")
    args = parser.parse_args()
    if args.role == "writer":
        asyncio.run(writer(args.dsn, args.schema, args.concurrency))
    elif args.role == "reader":
        asyncio.run(reader(args.dsn, args.schema, args.ids))
    else:
        if args.share is not None:
            pruning.SHARE = args.share
        asyncio.run(orchestrate(args))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
