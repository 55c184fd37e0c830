"""Plain tasks against the peers: drain, enqueue and start-to-result latency of no-op tasks, side by side.

For each system (pgflow from this checkout, pgqueuer, procrastinate, Celery with Redis, DBOS Transact),
its idiomatic API and worker, each in a database of its own on the same server (``bench_<system>``,
dropped and created again for every run; Celery's is a Redis database), one worker process:

  drain     N no-op tasks are enqueued while no worker runs (the enqueue figures below are taken then),
            then the worker (concurrency 16, and in a second run 64) starts and the run is timed from the
            first task's start to the last one's finish, from the system's own timestamps: pgflow
            started_at/finished_at, pgqueuer's log ('picked' -> 'successful'), procrastinate's events
            ('started' -> 'succeeded'), DBOS started_at_epoch_ms/updated_at. Celery records only when a
            task finished (the result's date_done): its window is first finish -> last finish, over N-1.
  enqueue   enqueue/s of the idiomatic single-enqueue call from 1 caller (sequential) and from 16
            concurrent callers (asyncio tasks; threads for Celery, whose client blocks), in a client
            process of its own.
  latency   with the c16 worker idle after its drain, another process starts a no-op task and waits for
            its result, one after another: p50/p99 after a warm-up.

Every worker and client is a real process in its own process group, stopped in a ``finally``; every run
has a deadline (--timeout). Systems are interleaved: repeat 1 of every system, then repeat 2, ...
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import Proc, RunFailed, log

SYSTEMS = ["pgflow", "pgqueuer", "procrastinate", "celery", "dbos"]
FIGURES = ["tasks_per_s", "tasks64_per_s", "enqueue_per_s", "enqueue16_per_s", "p50_ms", "p99_ms"]
CLIENT_POOL = 16  # connections of each client that has a pool: one per concurrent caller
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/11")
DB_PREFIX = os.environ.get("BENCH_DB_PREFIX", "bench_")  # tests use a prefix of their own
PACKAGES = {"pgflow": "pgflow-durable", "pgqueuer": "pgqueuer", "procrastinate": "procrastinate", "celery": "celery",
            "dbos": "dbos"}

# (done, first start, last finish), epoch seconds, from the system's own tables.
PROGRESS_SQL = {
    "pgflow": "SELECT count(*) FILTER (WHERE status = 'succeeded'), extract(epoch FROM min(started_at)),"
              " extract(epoch FROM max(finished_at)) FROM pgflow.workflows",
    "pgqueuer": "SELECT count(*) FILTER (WHERE status = 'successful'),"
                " extract(epoch FROM min(created) FILTER (WHERE status = 'picked')),"
                " extract(epoch FROM max(created) FILTER (WHERE status = 'successful')) FROM pgqueuer_log",
    "procrastinate": "SELECT (SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'),"
                     " extract(epoch FROM min(at) FILTER (WHERE type = 'started')),"
                     " extract(epoch FROM max(at) FILTER (WHERE type = 'succeeded')) FROM procrastinate_events",
    "dbos": "SELECT count(*) FILTER (WHERE status = 'SUCCESS'), min(started_at_epoch_ms) / 1000.0,"
            " max(updated_at) FILTER (WHERE status = 'SUCCESS') / 1000.0 FROM dbos.workflow_status",
}


@dataclass
class Sizes:
    tasks: int
    single: int  # of which enqueued by the one sequential caller
    runs: int
    warmup: int


def sizes(a: argparse.Namespace) -> Sizes:
    tasks = a.tasks or (2000 if a.quick else 20000)
    return Sizes(tasks=tasks, single=tasks // 5, runs=a.runs or (100 if a.quick else 200), warmup=20)


def redis_skip_reason() -> str | None:
    try:
        import redis
    except ImportError:
        return "the redis client is not installed (pip install -e '.[bench]')"
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except redis.RedisError as exc:
        return f"Redis at {REDIS_URL} does not answer ({exc}): Celery skipped"
    return None


def skip_reason(system: str) -> str | None:
    try:
        metadata.version(PACKAGES[system])
    except metadata.PackageNotFoundError:
        return f"{PACKAGES[system]} is not installed (pip install -e '.[bench]')"
    return redis_skip_reason() if system == "celery" else None


class Tasks:
    def __init__(self, a: argparse.Namespace, dsn: str, logdir: Path) -> None:
        self.a, self.dsn, self.logdir, self.sizes = a, dsn, logdir, sizes(a)

    # -- per-system plumbing -----------------------------------------------------------------------------

    def reset(self, system: str) -> str:
        """A fresh database for the run; the DSN its processes get."""
        if system == "celery":
            import redis

            redis.Redis.from_url(REDIS_URL).flushdb()
            return self.dsn
        return harness.recreate_database(self.dsn, f"{DB_PREFIX}{system}")

    def progress(self, system: str, db: str, conn: Any) -> tuple[int, float | None, float | None]:
        if system == "celery":
            return self.celery_progress()
        try:
            row = conn.execute(PROGRESS_SQL[system]).fetchone()
        except Exception:  # noqa: BLE001 - the system's tables may not exist yet while its worker starts
            conn.rollback()
            return 0, None, None
        return int(row[0]), None if row[1] is None else float(row[1]), None if row[2] is None else float(row[2])

    def celery_progress(self) -> tuple[int, float | None, float | None]:
        import redis

        r = redis.Redis.from_url(REDIS_URL)
        keys = list(r.scan_iter(match="celery-task-meta-*", count=5000))
        if len(keys) < self.expected:
            return len(keys), None, None
        done = [json.loads(v)["date_done"] for v in r.mget(keys) if v is not None]
        stamps = sorted(dt.datetime.fromisoformat(d).replace(tzinfo=dt.UTC).timestamp() for d in done)
        return len(stamps), stamps[0], stamps[-1]

    def env(self, system: str, db: str, concurrency: int) -> dict[str, str]:
        return harness.child_env(BENCH_DSN=db, BENCH_CONCURRENCY=str(concurrency), BENCH_REDIS_URL=REDIS_URL,
                                 BENCH_LOG_LEVEL=self.level(system), PGFLOW_DSN=db)

    def level(self, system: str) -> str:
        """--worker-log-level, or by default: pgflow at its CLI's default (INFO, a line per workflow's
        end, as a user runs it), the peers at WARNING (no line per task: the peers' advantage)."""
        return self.a.worker_log_level or ("INFO" if system == "pgflow" else "WARNING")

    def worker_argv(self, system: str, concurrency: int) -> list[str]:
        """Each system's own worker command, logging at ``level``."""
        py, level = sys.executable, self.level(system)
        return {
            "pgflow": [py, "-m", "pgflow", "--log-level", level, "worker", "benchmarks.peers.pgflow_peer:app",
                       "--concurrency", str(concurrency), "--grace", "0"],
            "pgqueuer": [py, "-m", "benchmarks.peers.pgqueuer_peer"],
            "procrastinate": [py, "-m", "procrastinate", "--log-level", level.lower(),
                              "--app=benchmarks.peers.procrastinate_peer.app", "worker", "--concurrency",
                              str(concurrency)],
            "celery": [py, "-m", "celery", "-A", "benchmarks.peers.celery_peer", "worker", "--pool", "threads",
                       "--concurrency", str(concurrency), "--loglevel", level],
            "dbos": [py, "-m", "benchmarks.peers.dbos_peer"],
        }[system]

    def client(self, system: str, db: str, role: str, *args: str, timeout: float) -> dict[str, Any]:
        argv = [sys.executable, "-m", "benchmarks.client", system, role, *args, "--deadline", str(timeout + 5)]
        env = self.env(system, db, 16) | {"BENCH_POOL": str(CLIENT_POOL)}
        return harness.run_json(argv, env, timeout, self.logdir / f"{system}-client.log")

    # -- one run -----------------------------------------------------------------------------------------

    def run(self, system: str, concurrency: int, repeat: int, measure: bool) -> dict[str, Any]:
        """Enqueue N tasks (timed when ``measure``), drain them with one worker at ``concurrency``, then
        (when ``measure``) time start-to-result with the worker idle."""
        import psycopg

        s, a = self.sizes, self.a
        record: dict[str, Any] = {"system": system, "concurrency": concurrency, "repeat": repeat, "tasks": s.tasks,
                                  "loadavg_before": os.getloadavg()[0], "started": time.time()}
        deadline = time.monotonic() + a.timeout
        worker: Proc | None = None
        profiler: subprocess.Popen[bytes] | None = None
        self.expected = s.tasks
        try:
            db = self.reset(system)
            plan = f"1:{s.single},16:{s.tasks - s.single}" if measure else f"16:{s.tasks}"
            enq = self.client(system, db, "enqueue", "--plan", plan, timeout=deadline - time.monotonic())
            if measure:
                record["enqueue_per_s"] = enq["enqueue"][0]["per_s"]
                record["enqueue16_per_s"] = enq["enqueue"][1]["per_s"]
            else:
                record["backlog_enqueue16_per_s"] = enq["enqueue"][0]["per_s"]
            with psycopg.connect(db, autocommit=True) as conn:
                done, _, _ = self.progress(system, db, conn)
                if done:
                    raise RunFailed(f"{done} tasks finished before any worker ran")
                commits0 = commits(conn)
                polls = 0
                t_spawn = time.time()
                worker = Proc(f"{system} worker", self.worker_argv(system, concurrency),
                              self.env(system, db, concurrency), self.logdir / f"{system}-c{concurrency}-worker.log")
                if a.profile and system in a.profile_systems:
                    profiler = start_profiler(worker.pid, Path(a.profile) / f"{system}-c{concurrency}-r{repeat}.txt")
                cpu_mark: tuple[int, float] | None = None
                while True:
                    done, first, last = self.progress(system, db, conn)
                    polls += 1
                    if cpu_mark is None and (done or first is not None):
                        cpu_mark = done, harness.process_cpu(worker.pid)  # start-up is not counted
                    if done >= s.tasks and first is not None and last is not None:
                        break
                    worker.check(f"{s.tasks} tasks to finish ({done} done)")
                    if time.monotonic() > deadline:
                        raise RunFailed(f"deadline: {done}/{s.tasks} tasks done after {a.timeout:.0f} s")
                    time.sleep(0.05)
                t_done = time.time()
                if cpu_mark is not None and s.tasks > cpu_mark[0]:
                    record["worker_cpu_ms_per_task"] = ((harness.process_cpu(worker.pid) - cpu_mark[1])
                                                        / (s.tasks - cpu_mark[0]) * 1000)
                stop_profiler(profiler)
                profiler = None
                if not measure and system != "celery":
                    # Transactions committed in the system's database per task: the worker's own, start-up
                    # included, this loop's polls left out. A backend's counts reach pg_stat_database
                    # when it exits (or within a second): read once the worker is gone.
                    worker.stop()
                    record["commits_per_task"] = (settled_commits(conn) - commits0 - polls - 1) / s.tasks
            counted = s.tasks - 1 if system == "celery" else s.tasks
            record.update(window_s=last - first, tasks_per_s=counted / (last - first), startup_s=first - t_spawn,
                          wall_s=t_done - t_spawn, window_from="first finish" if system == "celery" else "first start")
            if measure:
                lat = self.client(system, db, "latency", "--runs", str(s.runs), "--warmup", str(s.warmup),
                                  timeout=max(5.0, deadline - time.monotonic()))["latencies_ms"]
                record.update(p50_ms=harness.percentile(lat, 0.5), p99_ms=harness.percentile(lat, 0.99),
                              max_ms=max(lat), latency_runs=len(lat))
            record["ok"] = True
        except Exception as exc:  # noqa: BLE001 - one failed run is reported, the others still run
            record.update(ok=False, error=str(exc) if isinstance(exc, RunFailed) else f"{type(exc).__name__}: {exc}")
        finally:
            stop_profiler(profiler)
            if worker is not None:
                worker.stop()
            record["loadavg_after"] = os.getloadavg()[0]
        return record


def commits(conn: Any) -> int:
    row = conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()").fetchone()
    return int(row[0])


def settled_commits(conn: Any, patience: float = 5.0) -> int:
    """pg_stat_database's commit count once it stops moving (each read is itself one commit)."""
    end = time.monotonic() + patience
    last = commits(conn)
    while time.monotonic() < end:
        time.sleep(0.3)
        now = commits(conn)
        if now - last <= 1:
            return last
        last = now
    return last


def start_profiler(pid: int, out: Path) -> subprocess.Popen[bytes]:
    """py-spy on the worker, raw collapsed stacks, without --idle: where its CPU goes."""
    out.parent.mkdir(parents=True, exist_ok=True)
    beside = Path(sys.executable).parent / "py-spy"
    return subprocess.Popen([str(beside) if beside.exists() else "py-spy", "record", "--pid", str(pid),
                             "--format", "raw", "--rate", "250", "--nonblocking", "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def stop_profiler(profiler: subprocess.Popen[bytes] | None) -> None:
    """SIGINT makes py-spy write its file and exit."""
    if profiler is None or profiler.poll() is not None:
        return
    profiler.send_signal(signal.SIGINT)
    try:
        profiler.wait(30)
    except subprocess.TimeoutExpired:
        profiler.kill()
        profiler.wait()


def describe(r: dict[str, Any]) -> str:
    head = f"  [{r['repeat'] + 1}] {r['system']:<13} c{r['concurrency']:<3}"
    if not r.get("ok"):
        return f"{head} FAILED: {str(r.get('error')).splitlines()[0][:300]}"
    parts = [f"drain {r['tasks_per_s']:8,.0f}/s", f"worker cpu {r.get('worker_cpu_ms_per_task', 0):5.2f} ms/task"]
    if "commits_per_task" in r:
        parts.append(f"{r['commits_per_task']:.2f} commits/task")
    if "enqueue_per_s" in r:
        parts += [f"enqueue {r['enqueue_per_s']:6,.0f}/s", f"x16 {r['enqueue16_per_s']:6,.0f}/s",
                  f"p50 {r['p50_ms']:7.1f} ms", f"p99 {r['p99_ms']:7.1f} ms"]
    return f"{head} " + "  ".join(parts) + f"  (load {r['loadavg_before']:.1f} -> {r['loadavg_after']:.1f})"


def summarize(runs: list[dict[str, Any]], systems: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for system in systems:
        mine = [r for r in runs if r["system"] == system and r.get("ok")]
        c16 = [r for r in mine if r["concurrency"] == 16]
        c64 = [r for r in mine if r["concurrency"] == 64]
        figures = {
            "tasks_per_s": harness.median([r["tasks_per_s"] for r in c16]),
            "tasks64_per_s": harness.median([r["tasks_per_s"] for r in c64]),
            "enqueue_per_s": harness.median([r.get("enqueue_per_s") for r in c16]),
            "enqueue16_per_s": harness.median([r.get("enqueue16_per_s") for r in c16]),
            "p50_ms": harness.median([r.get("p50_ms") for r in c16]),
            "p99_ms": harness.median([r.get("p99_ms") for r in c16]),
            "worker_cpu_ms_per_task": harness.median([r.get("worker_cpu_ms_per_task") for r in c16]),
            "commits_per_task": harness.median([r.get("commits_per_task") for r in c64]),
        }
        out[system] = {k: v for k, v in figures.items() if v is not None}
    return out


def side_by_side(runs: list[dict[str, Any]], systems: list[str]) -> dict[str, Any]:
    """pgflow against the best peer of the same repeat, per figure (rates: pgflow / best peer; latencies:
    best peer / pgflow; above 1 means pgflow is ahead), and the median of those per-repeat ratios."""
    if "pgflow" not in systems or len(systems) < 2:
        return {}
    out: dict[str, Any] = {}
    for figure, conc, key in [("tasks_per_s", 16, "tasks_per_s"), ("tasks64_per_s", 64, "tasks_per_s"),
                              ("enqueue_per_s", 16, "enqueue_per_s"), ("enqueue16_per_s", 16, "enqueue16_per_s"),
                              ("p50_ms", 16, "p50_ms"), ("p99_ms", 16, "p99_ms")]:
        per_repeat = []
        for repeat in sorted({r["repeat"] for r in runs}):
            vals = {r["system"]: r[key] for r in runs if r["repeat"] == repeat and r["concurrency"] == conc
                    and r.get("ok") and key in r}
            if "pgflow" not in vals or len(vals) < 2:
                continue
            peers = {s: v for s, v in vals.items() if s != "pgflow"}
            if figure.endswith("_ms"):
                best = min(peers, key=lambda s: peers[s])
                per_repeat.append({"best_peer": best, "ratio": peers[best] / vals["pgflow"]})
            else:
                best = max(peers, key=lambda s: peers[s])
                per_repeat.append({"best_peer": best, "ratio": vals["pgflow"] / peers[best]})
        if per_repeat:
            out[figure] = {"per_repeat": per_repeat, "median": harness.median([p["ratio"] for p in per_repeat])}
    return out


def versions(systems: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"pgflow_commit": harness.commit()}
    for s in systems:
        try:
            out[PACKAGES[s]] = metadata.version(PACKAGES[s])
        except metadata.PackageNotFoundError:
            out[PACKAGES[s]] = None
    return out


def print_table(report: dict[str, Any]) -> None:
    log("\n| system | drain/s c16 | drain/s c64 | enqueue/s 1 | enqueue/s 16 | p50 ms | p99 ms |")
    log("|---|---:|---:|---:|---:|---:|---:|")
    for system, f in report["systems"].items():
        if "skipped" in f:
            log(f"| {system} | skipped: {f['skipped']} | | | | | |")
            continue

        def cell(k: str, spec: str, f: dict[str, Any] = f) -> str:
            return format(f[k], spec) if k in f else "-"
        log(f"| {system} | {cell('tasks_per_s', ',.0f')} | {cell('tasks64_per_s', ',.0f')} | "
            f"{cell('enqueue_per_s', ',.0f')} | {cell('enqueue16_per_s', ',.0f')} | {cell('p50_ms', '.1f')} | "
            f"{cell('p99_ms', '.1f')} |")
    for figure, r in report.get("side_by_side", {}).items():
        per = ", ".join(f"{p['ratio']:.2f} ({p['best_peer']})" for p in r["per_repeat"])
        log(f"  pgflow vs best peer, {figure}: median {r['median']:.2f}x  [per repeat: {per}]")


def main(a: argparse.Namespace) -> dict[str, Any]:
    systems = [s.strip() for s in a.systems.split(",") if s.strip()] if a.systems else list(SYSTEMS)
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown system(s) {unknown}; choose from {','.join(SYSTEMS)}")
    dsn = harness.resolve_dsn(a.dsn)
    info = harness.server_info(dsn)
    skipped = {s: why for s in systems if (why := skip_reason(s))}
    for s, why in skipped.items():
        log(f"skipping {s}: {why}")
    live = [s for s in systems if s not in skipped]
    a.profile_systems = {"pgflow"}
    logdir = Path(tempfile.mkdtemp(prefix="bench-tasks-"))
    bench = Tasks(a, dsn, logdir)
    s = bench.sizes
    log(f"tasks: PostgreSQL {info['server_version']} at {dsn}; {s.tasks} tasks per drain, latency {s.runs} runs "
        f"after {s.warmup}; {a.repeats} repeat(s) of {', '.join(live)}; logs in {logdir}")
    start_versions = versions(systems)
    runs: list[dict[str, Any]] = []
    try:
        for repeat in range(a.repeats):
            for concurrency, measure in [(16, True), (64, False)]:
                for system in live:
                    record = bench.run(system, concurrency, repeat, measure)
                    runs.append(record)
                    log(describe(record))
    finally:
        for system in live:
            if system != "celery":
                harness.drop_database(dsn, f"{DB_PREFIX}{system}")
    figures: dict[str, dict[str, Any]] = summarize(runs, live)
    for system, why in skipped.items():
        figures[system] = {"skipped": why}
    report: dict[str, Any] = {
        "benchmark": "tasks", "systems": figures,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_end": os.getloadavg()},
        "server": info, "dsn": dsn, "versions": start_versions, "repeats": a.repeats, "quick": a.quick,
        "settings": {"tasks": s.tasks, "single_caller_tasks": s.single, "latency_runs": s.runs,
                     "latency_warmup": s.warmup, "client_pool": CLIENT_POOL, "redis": REDIS_URL,
                     "timeout_s": a.timeout, "worker_log_level": a.worker_log_level},
        "side_by_side": side_by_side(runs, live), "runs": runs,
    }
    if versions(systems)["pgflow_commit"] != start_versions["pgflow_commit"]:
        report["warning"] = "the pgflow checkout changed during the run"
    print_table(report)
    out = harness.save("tasks", info, report, {k: v for k, v in figures.items() if "skipped" not in v}, a.output)
    log(f"wrote {out} and {out.with_suffix('.png').name}")
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tasks", type=int, default=None, help="tasks per drain (default 20000; --quick 2000)")
    p.add_argument("--runs", type=int, default=None, help="latency runs after 20 warm-up (default 200; --quick 100)")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline of one run, seconds")
    p.add_argument("--worker-log-level", default=None, type=str.upper,
                   help="log level of every system's worker (default WARNING: no line per task)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="record pgflow's worker during each drain with py-spy (raw collapsed stacks) into DIR")
