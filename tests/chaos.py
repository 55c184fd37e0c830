"""The fault suite's harness: a mixed load on worker processes while faults are injected, then the
invariants checked over everything that was started.

The load (tests/apps/chaos.py): multi-step workflows that stream as they go, a step that fails once
and is retried, a third of the workflows read live by a reader in this process, a tenth cancelled
midway. The faults, one every few seconds, drawn at random from those asked for:

- ``kill``: SIGKILL of a worker (a new one is started in its place);
- ``stop``: SIGSTOP of a worker for 2.5 leases, then SIGCONT (it comes back a zombie: fencing must hold);
- ``terminate``: pg_terminate_backend of every pgflow session (pools, listeners, maintenance);
- ``cancel``: pg_cancel_backend of pgflow's running statements (what a statement_timeout raises);
- ``restart``: a fast or immediate restart of the server (only with a server this harness can restart);
- ``freeze``: the proxy stops forwarding on every open link, with neither RST nor FIN;
- ``reset``: the proxy resets every open link;
- ``refuse``: every free connection slot of the server taken for 3 s (new connections are refused).

Checked at the end: every started workflow ended within ``recovery_bound`` of the last fault (and its
output is right, or it was cancelled); no step ran again after its output was recorded; every stream
is dense and ordered (chunk n holds n), and every live reader saw exactly what a replay sees; no
workflow was ended twice; this process's threads, tasks and connections are back where they were;
the memory of the workers that lived through the run stayed flat.

``make soak`` runs it for 5 minutes on a PostgreSQL 18 of its own (``python -m tests.chaos --help``);
tests/test_chaos.py runs short cases of each fault in ``make test``, and the mixed case in ``make chaos``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import psutil
import psycopg

import pgflow

from .processes import Proc, Processes
from .proxy import Proxy
from .servers import EmbeddedServer

ROOT = Path(__file__).resolve().parent.parent
FAULTS = ("kill", "stop", "terminate", "cancel", "restart", "freeze", "reset", "refuse")
_END_LINE = re.compile(r"workflow \S+ (chaos-\S+) (succeeded|failed|cancelled) in")


@dataclass
class Settings:
    seconds: float = 20.0  # of load and faults
    faults: tuple[str, ...] = FAULTS
    every: float = 3.0  # seconds between faults
    workers: int = 3
    concurrency: int = 8
    lease: float = 2.0
    query_timeout: float = 2.0
    rate: float = 15.0  # workflows started per second
    steps: int = 4
    chunks_per_step: int = 5
    recovery_bound: float = 45.0  # seconds after the last fault by which every workflow has ended
    seed: int = 0


@dataclass
class Report:
    settings: Settings
    injected: collections.Counter[str] = field(default_factory=collections.Counter)
    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    violations: list[str] = field(default_factory=list)
    recovery: float = 0.0  # seconds from the end of the last fault until every workflow had ended
    start_errors: list[str] = field(default_factory=list)  # starts that raised (each looked up at the end)
    statements_cancelled: int = 0
    live_reads: int = 0
    # seconds, the longest wait of a live reader between two chunks, by the fault that came last before
    longest_stall: dict[str, float] = field(default_factory=dict)
    chunks_checked: int = 0
    step_runs_checked: int = 0
    worker_rss_mb: dict[int, tuple[float, float]] = field(default_factory=dict)

    def summary(self) -> str:
        lines = [
            f"chaos: {self.settings.seconds:.0f}s of load, a fault every {self.settings.every:.1f}s,"
            f" {self.settings.workers} workers x {self.settings.concurrency}, lease {self.settings.lease}s",
            "injected: " + ", ".join(f"{kind} x{n}" for kind, n in sorted(self.injected.items())),
            "workflows: " + ", ".join(f"{status} {n}" for status, n in sorted(self.statuses.items())),
            f"starts that raised (then looked up): {len(self.start_errors)};"
            f" running statements cancelled: {self.statements_cancelled}",
            f"checked: {self.step_runs_checked} step runs, {self.chunks_checked} chunks,"
            f" {self.live_reads} live readers",
            f"every workflow ended {self.recovery:.1f}s after the last fault"
            f" (bound {self.settings.recovery_bound:.0f}s)",
            "the longest wait of a live reader between two chunks, after: " + ", ".join(
                f"{kind} {seconds:.1f}s" for kind, seconds in sorted(self.longest_stall.items())),
        ]
        if self.worker_rss_mb:
            lines.append("worker memory (MB, a third in -> end): " + ", ".join(
                f"{a:.0f}->{b:.0f}" for a, b in self.worker_rss_mb.values()))
        lines.append(f"violations: {len(self.violations)}")
        lines += [f"  - {v}" for v in self.violations[:50]]
        return "\n".join(lines)


class Chaos:
    def __init__(self, dsn: str, schema: str, workdir: Path, settings: Settings,
                 server: EmbeddedServer | None) -> None:
        self.dsn, self.schema, self.workdir, self.settings, self.server = dsn, schema, workdir, settings, server
        self.rng = random.Random(settings.seed)
        self.report = Report(settings)
        self.procs = Processes(workdir)
        self.proxy = Proxy(*_target(dsn)) if {"freeze", "reset"} & set(settings.faults) else None
        self.link = self.proxy.dsn(dsn) if self.proxy else dsn
        self.log = workdir / "steps.log"
        self.workers: list[Proc] = []
        self.started: list[str] = []
        self.live: dict[str, list[Any]] = {}
        self.fault_ended = 0.0
        self.fault_times: list[tuple[float, str]] = []
        self._reading: set[str] = set()
        self._read_so_far: dict[str, int] = {}
        self._all_read = anyio.Event()  # set whenever no live reader is left (only awaited at the end)
        self.rss_mid: dict[int, float] = {}
        self._serial = 0

    # -- workers ---------------------------------------------------------------------------------------

    def _start_worker(self) -> Proc:
        self._serial += 1
        env = {**os.environ, "PGFLOW_DSN": self.link, "PGFLOW_SCHEMA": self.schema, "CHAOS_LOG": str(self.log),
               "CHAOS_QUERY_TIMEOUT": str(self.settings.query_timeout),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        proc = self.procs.worker(f"worker-{self._serial}", "tests.apps.chaos:app", env,
                                 concurrency=self.settings.concurrency, lease=self.settings.lease, grace=5.0)
        self.workers.append(proc)
        return proc

    async def _await_the_workers(self) -> None:
        """Until every first worker has registered, so that the load and the faults meet a running
        fleet: a worker that cannot reach the server as it starts up exits (the CLI's answer to a bad
        DSN), and a restart in a loaded machine's first seconds would otherwise leave no worker at all."""
        pids = {proc.pid for proc in self.workers}
        with anyio.fail_after(60):
            while True:
                dead = [proc for proc in self.workers if not proc.alive()]
                if dead:
                    raise RuntimeError("a worker exited as it started:\n" + "\n".join(p.describe() for p in dead))
                try:
                    rows = await _query(self.dsn, f'SELECT pid FROM "{self.schema}".workers')
                except psycopg.errors.UndefinedTable:
                    rows = []  # not migrated yet
                if pids <= {int(pid) for (pid,) in rows}:
                    return
                await anyio.sleep(0.05)

    # -- the run ---------------------------------------------------------------------------------------

    async def run(self) -> Report:
        from .apps import chaos

        await anyio.to_thread.run_sync(lambda: None)  # this harness's own worker thread, in the baseline
        threads = threading.active_count()
        tasks = len(asyncio.all_tasks())
        connections = await self._connections_of_this_process()
        app = pgflow.App(self.link, schema=self.schema, poll_interval=0.5,
                         query_timeout=self.settings.query_timeout)
        mixed = chaos.build(app)
        try:
            for _ in range(self.settings.workers):
                self._start_worker()
            await self._await_the_workers()
            async with anyio.create_task_group() as readers:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._load, app, mixed, readers)
                    tg.start_soon(self._faults)
                    tg.start_soon(self._sample_memory)
                await self._await_the_end(app)
                # The readers of ended workflows finish at once; any other is a finding, not a hang.
                self._all_read = anyio.Event()  # (a fresh one: the last was set whenever no reader was left)
                with anyio.move_on_after(30):
                    if self._reading:
                        await self._all_read.wait()
                if self._reading:
                    self.report.violations.append("live readers still waiting: " + ", ".join(
                        f"{id} (after {self._read_so_far.get(id, 0)} chunks)" for id in sorted(self._reading)))
                    readers.cancel_scope.cancel()
            await self._check(app)
        finally:
            await app.close_async()
            for proc in self.workers:
                if proc.alive():
                    proc.signal(signal.SIGCONT)
                    proc.signal(signal.SIGTERM)
            for proc in self.workers:
                if proc.alive():
                    await anyio.to_thread.run_sync(proc.wait_exit)
            self.procs.stop_all()
            if self.proxy is not None:
                self.proxy.close()
        await anyio.sleep(0)  # let the closed runtime's tasks finish unwinding
        await self._check_leaks(threads, tasks, connections)
        return self.report

    async def _load(self, app: pgflow.App, mixed: Any, readers: anyio.abc.TaskGroup) -> None:
        s = self.settings
        end = time.monotonic() + s.seconds
        n = 0
        while time.monotonic() < end:
            id = f"chaos-{n}"
            try:
                handle = await mixed.with_options(id=id).start_async(n, s.steps, s.chunks_per_step)
            except (psycopg.Error, OSError) as exc:  # noqa: PERF203
                # The start may or may not have been written; the end of the run looks it up.
                self.report.start_errors.append(f"{type(exc).__name__}: {exc}")
                handle = app.handle(id)
            self.started.append(id)
            if n % 3 == 0:
                readers.start_soon(self._read_live, handle)
            if n % 10 == 7:
                readers.start_soon(self._cancel_later, handle)
            n += 1
            await anyio.sleep(1 / s.rate)

    async def _read_live(self, handle: pgflow.WorkflowHandle[Any]) -> None:
        from .apps.chaos import STREAM

        values: list[Any] = []
        last = time.monotonic()
        self._reading.add(handle.id)
        try:
            async for value in handle.stream_async(STREAM):
                values.append(value)
                self._read_so_far[handle.id] = len(values)
                now = time.monotonic()
                # A wait is put down to the last fault injected before it ended ("none" before any).
                kind = next((k for began, k in reversed(self.fault_times) if began <= now), "none")
                self.report.longest_stall[kind] = max(self.report.longest_stall.get(kind, 0.0), now - last)
                last = now
        except pgflow.UnknownWorkflow:
            return  # its start failed before anything was written
        except Exception as exc:  # noqa: BLE001 - every failure of a reader is a finding
            self.report.violations.append(f"live reader of {handle.id} failed: {type(exc).__name__}: {exc}")
            return
        finally:
            self._reading.discard(handle.id)
            if not self._reading:
                self._all_read.set()
        self.live[handle.id] = values

    async def _cancel_later(self, handle: pgflow.WorkflowHandle[Any]) -> None:
        await anyio.sleep(self.rng.uniform(0.0, 1.5))
        for _ in range(20):
            try:
                await handle.cancel_async()
                return
            except pgflow.UnknownWorkflow:
                return
            except (psycopg.Error, OSError):
                await anyio.sleep(0.5)
        self.report.violations.append(f"could not cancel {handle.id} in 20 tries")

    async def _faults(self) -> None:
        s = self.settings
        kinds = [k for k in s.faults if k != "restart" or self.server is not None]
        end = time.monotonic() + s.seconds
        order = self.rng.sample(kinds, len(kinds))  # each kind in turn, in an order of the seed's
        turn = 0
        while time.monotonic() + s.every < end:
            await anyio.sleep(s.every)
            kind = order[turn % len(order)]
            turn += 1
            self.fault_times.append((time.monotonic(), kind))
            await getattr(self, f"_inject_{kind}")()
            self.report.injected[kind] += 1
            self.fault_ended = time.monotonic()

    def _victim(self) -> Proc:
        """A live worker other than the first, which lives through the run so its memory can be
        compared from a third of the way in to the end."""
        return self.rng.choice([p for p in self.workers[1:] if p.alive()])

    async def _inject_kill(self) -> None:
        victim = self._victim()
        await anyio.to_thread.run_sync(victim.stop)
        self._start_worker()

    async def _inject_stop(self) -> None:
        victim = self._victim()
        victim.signal(signal.SIGSTOP)
        await anyio.sleep(2.5 * self.settings.lease)
        victim.signal(signal.SIGCONT)

    async def _inject_terminate(self) -> None:
        await _query(self.dsn, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                               " WHERE application_name LIKE 'pgflow-%%' AND pid <> pg_backend_pid()")

    async def _inject_cancel(self) -> None:
        """For a second, cancel every statement of pgflow's that is running (pgflow's statements are
        short: aim again and again to hit some)."""
        end = time.monotonic() + 1.0
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            while time.monotonic() < end:
                cur = await conn.execute("SELECT count(*) FILTER (WHERE pg_cancel_backend(pid))"
                                         " FROM pg_stat_activity WHERE application_name LIKE 'pgflow-%%'"
                                         " AND state = 'active' AND pid <> pg_backend_pid()")
                row = await cur.fetchone()
                self.report.statements_cancelled += int(row[0]) if row else 0

    async def _inject_restart(self) -> None:
        assert self.server is not None
        mode = self.rng.choice(["fast", "immediate"])
        await anyio.to_thread.run_sync(self.server.restart, mode)

    async def _inject_freeze(self) -> None:
        assert self.proxy is not None
        self.proxy.freeze()

    async def _inject_reset(self) -> None:
        assert self.proxy is not None
        self.proxy.reset()

    async def _inject_refuse(self) -> None:
        def hog() -> None:
            held: list[psycopg.Connection[Any]] = []
            try:
                for _ in range(500):
                    try:
                        held.append(psycopg.connect(self.dsn, autocommit=True, connect_timeout=5))
                    except psycopg.OperationalError:
                        break  # no slot left: every new connection is refused now
                time.sleep(3.0)
            finally:
                for conn in held:
                    conn.close()
        await anyio.to_thread.run_sync(hog)

    async def _sample_memory(self) -> None:
        await anyio.sleep(self.settings.seconds / 3)
        self.rss_mid = {p.pid: _rss_mb(p.pid) for p in self.workers if p.alive()}

    # -- the end ---------------------------------------------------------------------------------------

    async def _await_the_end(self, app: pgflow.App) -> None:
        """Poll the table (this observes the outcome; it synchronises nothing) until every started
        workflow has ended, or the bound after the last fault has passed."""
        for proc in self.workers:
            if proc.alive():
                proc.signal(signal.SIGCONT)  # a stop fault in flight when the load ended
        ids = list(self.started)
        deadline = max(self.fault_ended, time.monotonic()) + self.settings.recovery_bound
        while True:
            rows = await _query(self.dsn, f'SELECT count(*) FROM "{self.schema}".workflows'
                                          " WHERE id = ANY(%s) AND status IN ('queued', 'running')", ids)
            if rows[0][0] == 0 or time.monotonic() > deadline:
                break
            await anyio.sleep(0.25)
        self.report.recovery = max(0.0, time.monotonic() - self.fault_ended)
        self.rss_end = {p.pid: _rss_mb(p.pid) for p in self.workers if p.alive()}

    async def _check(self, app: pgflow.App) -> None:
        from .apps import chaos

        s, found = self.settings, self.report.violations
        rows = await _query(self.dsn, f'SELECT id, status FROM "{self.schema}".workflows WHERE id = ANY(%s)',
                            self.started)
        status = {str(id): str(st) for id, st in rows}
        self.report.statuses.update(status.values())
        for id, st in status.items():
            if st in ("queued", "running"):
                found.append(f"{id} still {st} {s.recovery_bound:.0f}s after the last fault")
            elif st == "failed":
                try:
                    await app.handle(id).result_async()
                except pgflow.WorkflowFailed as failure:
                    found.append(f"{id} failed: {failure}")
            elif st == "succeeded":
                output = await app.handle(id).result_async()
                if output != chaos.expected(int(id.split("-")[1]), s.steps):
                    found.append(f"{id} succeeded with a wrong output: {output!r}")
        self._check_steps(await _query(self.dsn, f'SELECT workflow_id, position, attempt FROM "{self.schema}".steps'
                                                 " WHERE workflow_id = ANY(%s)", self.started))
        for id, st in status.items():
            if st in ("queued", "running"):
                continue  # reported above; its stream is not over
            with anyio.fail_after(60):
                replay = [v async for v in app.handle(id).stream_async(chaos.STREAM)]
            self.report.chunks_checked += len(replay)
            total = s.steps * s.chunks_per_step
            if replay != list(range(len(replay))) or (st == "succeeded" and len(replay) != total):
                found.append(f"{id} ({st}): stream not dense and ordered: {replay[:20]}...")
            if id in self.live:
                self.report.live_reads += 1
                if self.live[id] != replay:
                    found.append(f"{id}: the live reader saw {len(self.live[id])} chunks, a replay {len(replay)}")
        ends = collections.Counter(m.group(1) for proc in self.workers for m in _END_LINE.finditer(proc.output()))
        found.extend(f"{id} was ended {n} times" for id, n in ends.items() if n > 1)
        for pid, mid in self.rss_mid.items():
            end = self.rss_end.get(pid)
            if end is None:
                continue
            self.report.worker_rss_mb[pid] = (mid, end)
            if s.seconds >= 120 and end > max(1.25 * mid, mid + 32):
                found.append(f"worker {pid} grew from {mid:.0f} MB to {end:.0f} MB")

    def _check_steps(self, recorded: list[tuple[Any, ...]]) -> None:
        """No step ran under a later attempt than the one its output was recorded under."""
        recorded_by = {(str(w), int(p)): int(a) for w, p, a in recorded}
        for line in self.log.read_text().splitlines() if self.log.exists() else []:
            workflow_id, position, attempt = line.split()
            self.report.step_runs_checked += 1
            when = recorded_by.get((workflow_id, int(position)))
            if when is not None and int(attempt) > when:
                self.report.violations.append(
                    f"step {position} of {workflow_id} ran under attempt {attempt}, after attempt {when} recorded it")

    async def _connections_of_this_process(self) -> int:
        rows = await _query(self.dsn, "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s",
                            f"pgflow-%{os.getpid()}")
        return int(rows[0][0])

    async def _check_leaks(self, threads: int, tasks: int, connections: int) -> None:
        found = self.report.violations
        if threading.active_count() > threads:
            found.append(f"threads: {threads} before, {threading.active_count()} after: "
                         f"{[t.name for t in threading.enumerate()]}")
        if len(asyncio.all_tasks()) > tasks:
            found.append(f"tasks: {tasks} before, {len(asyncio.all_tasks())} after: {asyncio.all_tasks()}")
        # A backend ends a moment after its client hung up (and one behind the proxy only once the
        # proxy let go): give the server a bounded while to notice.
        with anyio.move_on_after(15):
            while (left := await self._connections_of_this_process()) > connections:
                await anyio.sleep(0.1)
        if left > connections:
            found.append(f"connections of this process: {connections} before, {left} 15 s after close")


async def _query(dsn: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    """One statement on a connection of its own, riding out the faults (a restart, no free slot)."""
    deadline = time.monotonic() + 60.0
    while True:
        try:
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True, connect_timeout=5) as conn:
                cur = await conn.execute(sql, params or None)
                return await cur.fetchall() if cur.description is not None else []
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            await anyio.sleep(0.2)


def _target(dsn: str) -> tuple[str, int]:
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    return str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432)


def _rss_mb(pid: int) -> float:
    try:
        return float(psutil.Process(pid).memory_info().rss) / 2**20
    except psutil.Error:
        return 0.0


async def run_chaos(dsn: str, workdir: Path, settings: Settings, server: EmbeddedServer | None = None,
                    on_report: Callable[[Report], None] | None = None) -> Report:
    """One run on a fresh schema of ``dsn``, dropped afterwards."""
    schema = f"chaos_{uuid.uuid4().hex[:10]}"
    try:
        report = await Chaos(dsn, schema, workdir, settings, server).run()
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    if on_report is not None:
        on_report(report)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="of load and faults (default: 5)")
    parser.add_argument("--faults", default=",".join(FAULTS), help="a comma-separated subset of: " + ", ".join(FAULTS))
    parser.add_argument("--every", type=float, default=3.0, help="seconds between faults (default: 3)")
    parser.add_argument("--dsn", help="a server to use instead of a PostgreSQL 18 of its own (no restarts then)")
    parser.add_argument("--seed", type=int, default=int(time.time()))
    args = parser.parse_args()
    faults = tuple(f for f in args.faults.split(",") if f)
    unknown = set(faults) - set(FAULTS)
    if unknown:
        parser.error(f"unknown faults {sorted(unknown)}; choose from {', '.join(FAULTS)}")
    for noisy in ("pgflow", "psycopg"):  # this process's own App rides out every fault: keep its retries quiet
        logging.getLogger(noisy).setLevel(logging.ERROR)
    settings = Settings(seconds=args.minutes * 60, faults=faults, every=args.every, seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="pgflow-soak-") as tmp:
        server = None
        if args.dsn is None:
            server = EmbeddedServer()
            server.start(Path(tmp) / "server")
        try:
            report = anyio.run(run_chaos, args.dsn or server.dsn, Path(tmp), settings, server)  # type: ignore[union-attr]
        finally:
            if server is not None:
                server.stop()
    print(report.summary())
    print(f"(seed {args.seed})")
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
