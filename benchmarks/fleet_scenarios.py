"""fleet.py's throughput and latency scenarios (the failover one is fleet_failover.py): each returns one
run's record, ``ok`` or with its error."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from benchmarks import harness
from benchmarks.fleet_bench import Bench, Cpu, Run
from benchmarks.fleet_workers import Worker
from benchmarks.harness import RunFailed, median, percentile

COUNTS = ("SELECT count(*) FILTER (WHERE status = 'succeeded'), count(*) FILTER (WHERE status = 'running'),"
          " count(*) FILTER (WHERE status IN ('failed', 'cancelled')), count(DISTINCT lease_owner)"
          ' FROM "{schema}".workflows')


# -- 1. claim throughput ---------------------------------------------------------------------------------


def throughput(bench: Bench, processes: int, repeat: int) -> dict[str, Any]:
    """N no-op workflows queued first, then drained by one worker process or a supervisor of several."""
    a = bench.a
    with bench.run("throughput", f"tp{processes}r{repeat}", processes=processes, repeat=repeat,
                   workflows=a.workflows, concurrency=a.concurrency) as run:
        enqueue(run)
        with bench.probe() as conn:
            args = ["--concurrency", str(a.concurrency), "--grace", "0"]
            t_spawn = time.time()
            worker = run.worker("worker", args + (["--processes", str(processes)] if processes > 1 else []),
                                profile=True)
            seen = drain(run, conn, worker)
            first, last, retried = conn.execute(
                "SELECT extract(epoch FROM min(started_at)), extract(epoch FROM max(finished_at)),"
                f' count(*) FILTER (WHERE attempt > 1) FROM "{run.schema}".workflows').fetchone()
        window, wall, span = float(last) - float(first), seen["t1"] - t_spawn, seen["t1"] - seen["t0"]
        cpu0, cpu1 = seen["cpu0"], seen["cpu1"]
        counted = max(1, a.workflows - seen["started_seen"])  # workflows claimed after the counters started
        pg = None if cpu0.server is None or cpu1.server is None else cpu1.server - cpu0.server
        run.record.update(
            ok=seen["bad"] == 0, succeeded=seen["done"], failed=seen["bad"], reclaimed=retried,
            workflows_per_s=a.workflows / window, claim_to_finish_s=window, startup_s=float(first) - t_spawn,
            wall_s=wall, wall_per_s=a.workflows / wall, running_median=median(seen["running"]),
            lease_owners_seen=seen["owners_max"], cpu_window_s=span, **cpu1.shares(cpu0, span),
            worker_cpu_ms_per_workflow=(cpu1.workers - cpu0.workers) / counted * 1000,
            postgres_cpu_ms_per_workflow=None if pg is None else pg / counted * 1000)
        if seen["bad"]:
            run.record["error"] = f"{seen['bad']} workflows failed or were cancelled"
    return run.record


def enqueue(run: Run) -> None:
    """Start every workflow from this process (start_async, --enqueue-concurrency at once), then close its
    App: it neither listens nor polls through pgflow while the workers run."""
    a = run.bench.a
    run.app.migrate()
    noop = run.app.workflows["fleet.noop"]

    async def enqueue_all() -> None:
        gate = asyncio.Semaphore(a.enqueue_concurrency)

        async def one(i: int) -> None:
            async with gate:
                await noop.with_options(id=f"noop-{i:06d}").start_async()

        await asyncio.gather(*(one(i) for i in range(a.workflows)))

    t0 = time.perf_counter()
    asyncio.run(enqueue_all())
    run.record["enqueue_s"] = time.perf_counter() - t0
    run.record["enqueue_per_s"] = a.workflows / run.record["enqueue_s"]
    run.app.close()
    with run.bench.probe() as conn:
        queued = conn.execute(f"SELECT count(*) FROM \"{run.schema}\".workflows WHERE status = 'queued'").fetchone()
    if queued[0] != a.workflows:
        raise RunFailed(f"{queued[0]} workflows queued, expected {a.workflows}")


def drain(run: Run, conn: Any, worker: Worker) -> dict[str, Any]:
    """Poll the table every 50 ms until every workflow has ended. The CPU counters start at the first claim
    seen: the processes' start-up (imports, connecting) is not counted against the workflows."""
    n, started_seen, owners_max, running_samples = run.bench.a.workflows, 0, 0, []
    cpu0: Cpu | None = None
    t0 = 0.0
    while True:
        done, running, bad, owners = conn.execute(COUNTS.format(schema=run.schema)).fetchone()
        if cpu0 is None and done + running + bad > 0:
            t0, cpu0, started_seen = time.time(), run.bench.cpu(worker), done + running + bad
        if done + bad >= n:
            break
        if running:
            running_samples.append(running)
            owners_max = max(owners_max, owners)
        worker.check(f"{n} workflows to finish ({done} done)")
        if time.monotonic() > run.deadline:
            raise RunFailed(f"timed out with {done}/{n} workflows succeeded")
        time.sleep(0.05)
    assert cpu0 is not None
    return {"t0": t0, "cpu0": cpu0, "t1": time.time(), "cpu1": run.bench.cpu(worker), "done": done, "bad": bad,
            "started_seen": started_seen, "owners_max": owners_max, "running": running_samples}


# -- 3. no-op start -> result ----------------------------------------------------------------------------


def latency(bench: Bench, repeat: int) -> dict[str, Any]:
    """Sequential no-op workflows, started here and awaited with handle.result(), an idle worker elsewhere."""
    a = bench.a
    with bench.run("latency", f"lat{repeat}", repeat=repeat, runs=a.latency_runs, warmup=a.latency_warmup) as run:
        run.app.migrate()
        worker = run.worker("worker", ["--concurrency", str(a.concurrency), "--grace", "0"])
        with bench.probe() as conn:
            run.wait_registered(conn, worker)
        time.sleep(0.5)  # the worker's claim loop is parked on its wait
        noop = run.app.workflows["fleet.noop"]
        latencies: list[float] = []
        marks: dict[str, tuple[float, float]] = {}
        cpu0, t_begin = bench.cpu(worker), time.time()
        for n in range(a.latency_warmup + a.latency_runs):
            if time.monotonic() > run.deadline:
                raise RunFailed(f"timed out after {n} runs")
            id = f"noop-{n:05d}"
            t0, w0 = time.perf_counter(), time.time()
            noop.with_options(id=id).start().result(timeout=10)
            if n >= a.latency_warmup:
                latencies.append(time.perf_counter() - t0)
                marks[id] = (w0, time.time())
            if a.latency_gap:
                time.sleep(a.latency_gap)  # (a pause between runs, not a wait for anything)
        cpu = bench.cpu(worker).shares(cpu0, time.time() - t_begin)
        run.record.update(ok=True, **harness.latency_summary(latencies), **cpu)
        worker.check("the end of the runs")
        run.record["stages_ms"] = stages(bench, run.schema, marks)
    return run.record


def stages(bench: Bench, schema: str, marks: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """Where a no-op's start-to-result time goes (medians, ms), from the row's server timestamps (now() of
    the enqueue, claim and finish statements) and this process's clock (the server is on this machine)."""
    with bench.probe() as conn:
        rows = conn.execute(
            "SELECT id, extract(epoch FROM created_at), extract(epoch FROM started_at),"
            f" extract(epoch FROM finished_at) FROM \"{schema}\".workflows WHERE id = ANY(%s)",
            (list(marks),)).fetchall()
    parts: dict[str, list[float]] = {"start_to_enqueue": [], "enqueue_to_claim": [],
                                     "claim_to_finish": [], "finish_to_result": []}
    for id, created, started, finished in rows:
        t0, t1 = marks[id]
        created, started, finished = float(created), float(started), float(finished)
        parts["start_to_enqueue"].append((created - t0) * 1000)
        parts["enqueue_to_claim"].append((started - created) * 1000)
        parts["claim_to_finish"].append((finished - started) * 1000)
        parts["finish_to_result"].append((t1 - finished) * 1000)
    out: dict[str, Any] = {}
    for k, v in parts.items():
        out[k] = median(v)
        out[k + "_p99"] = percentile(v, 0.99) if v else None
    out["per_run"] = {k: [round(x, 2) for x in v] for k, v in parts.items()}
    return out
