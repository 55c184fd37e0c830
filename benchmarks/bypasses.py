"""What each of pgflow's library bypasses buys today: the bypass and the library's public way side by side.

    python -m benchmarks.bypasses [--quick] [--only SECTIONS] [--rounds N] [--dsn ...] [--json]

A bypass is code that steps around a library's public way for speed, and adds an invariant of its own
that someone must keep: each has to keep paying for it. Every section runs pgflow's code and the public
way in alternated rounds (the order reversed every round) and prints the median over the rounds of each,
and the ratio to the bypass (above 1 is what the bypass buys). This machine is shared and noisy: read the
ratios of one run, never absolute figures across runs. CPU is this thread's or process's own CPU time,
so the other processes of the machine count less than in wall time.

The micro-benchmarks (the default; 7 rounds, --quick 3 with smaller counts, about a minute):

  runs        a no-op run's task: ``Runs.start`` (plain asyncio tasks) against an anyio task group's
              ``start_soon``, started 64 at a time as a claim at concurrency 64 starts them (us per run)
  log_lines   a workflow's end line at INFO under the CLI's handler: ``log_lines.write`` against
              ``Logger.info`` (us per line, written to a file)
  checkout    one pool checkout and return: ``Pool.connection`` against psycopg_pool's ``connection()``
              with the same deadline and bookkeeping (us of CPU per checkout)
  pool_order  one checkout and ``SELECT 1`` every --gap seconds on a pool grown to 10 connections: the
              connection returned last first (``_NewestFirst``) against psycopg_pool's order, oldest first
              (us of latency, p50)
  listener    a sealed notification heard by the listener: its socket read in the loop's own callback
              against psycopg's ``notifies()``, on uvloop (a worker's loop) and on asyncio's own (an
              application's); four listener processes hear in turns from one sender, which sends one
              notification a transaction (us of the listener process's CPU each)

What they serve (``--only drain16,drain64,lone,sporadic``; 5 rounds, --quick 3): pgflow's own processes,
with the public way put in place of one bypass at a time (``use_public_ways``, by ``$BENCH_PUBLIC``):

  drain16/64  a ``pgflow worker`` draining a backlog of no-ops at concurrency 16 / 64 (its CPU per
              workflow, by ``drain_ab.drain``): public runs, log_lines, checkout
  lone        start-to-result of a no-op, back to back, by a caller process (asyncio, as an application)
              and a worker process: the caller's CPU per workflow first; public listener, checkout
  sporadic    the same, one every --sporadic-gap seconds after a burst of 16 (so the pools have grown):
              the p50; public pool_order
  (lone and sporadic run their ways at the same time, each on a database of its own: the machine's
  drift from one minute to the next falls on all of them alike)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import IO, Any

import anyio
import anyio.abc
import psycopg
from psycopg_pool import AsyncConnectionPool

from benchmarks import drain_ab, harness
from pgflow._core import log_lines, loops
from pgflow._core import pool as pool_module
from pgflow._core.engine.channel import SignalKey
from pgflow._core.outcomes import _END
from pgflow._core.registry import Config
from pgflow._core.runs import Runs
from pgflow._core.signals import News, Waiter, Waiters
from pgflow._core.signals import keys as signal_keys
from pgflow._core.signals.listener import Listener
from pgflow._core.signals.sealing import Keyring, sealed
from pgflow._core.status import Status

Measure = Callable[[str], Awaitable[float | dict[str, float]]]


# -- runs --------------------------------------------------------------------------------------------------------


class GroupRuns:
    """``Runs``'s contract on an anyio task group, the library's public way: each run hosted by
    ``start_soon`` in a shielded scope (a stop reaches a run's body through its own scope only, as
    with ``Runs``), its exception logged rather than let to stop the group, and a stop that cancels
    every run's scope and waits for all of them."""

    def __init__(self) -> None:
        self._scopes: set[anyio.CancelScope] = set()
        self._group: anyio.abc.TaskGroup | None = None

    def __len__(self) -> int:
        return len(self._scopes)

    def start(self, run: Callable[[Any, anyio.CancelScope], Awaitable[None]], what: Any, name: str) -> bool:
        if self._group is None:
            return False
        scope = anyio.CancelScope()
        self._scopes.add(scope)  # (counted from now, as Runs counts its tasks)
        self._group.start_soon(self._hosted, run, what, scope, name=name)
        return True

    async def _hosted(self, run: Callable[[Any, anyio.CancelScope], Awaitable[None]], what: Any,
                      scope: anyio.CancelScope) -> None:
        try:
            with anyio.CancelScope(shield=True):
                await run(what, scope)
        except Exception:
            logging.getLogger("pgflow.worker").exception("a run ended with an exception")
        finally:
            self._scopes.discard(scope)

    async def serve(self) -> None:
        async with anyio.create_task_group() as group:
            self._group = group
            try:
                await anyio.sleep_forever()
            finally:
                self._group = None
                for scope in self._scopes:
                    scope.cancel()


@contextlib.asynccontextmanager
async def runs_section(a: argparse.Namespace) -> AsyncIterator[tuple[dict[str, Measure], list[tuple[str, str]]]]:
    count = 4_000 if a.quick else 20_000
    batch = 64

    async def noop(what: int, scope: anyio.CancelScope) -> None:
        with scope:  # as a run enters the scope it is handed
            pass

    async def measure(owner: Runs | GroupRuns) -> float:
        async with anyio.create_task_group() as group:
            group.start_soon(owner.serve)
            await anyio.sleep(0)
            began = time.thread_time()
            for first in range(0, count, batch):
                for n in range(first, first + batch):
                    owner.start(noop, n, "pgflow workflow")
                while len(owner):
                    await asyncio.sleep(0)
            spent = time.thread_time() - began
            group.cancel_scope.cancel()
        return spent / count * 1e6

    yield {"Runs (asyncio tasks)": lambda _: measure(Runs()),
           "anyio task group": lambda _: measure(GroupRuns())}, [("Runs (asyncio tasks)", "anyio task group")]


# -- log_lines ---------------------------------------------------------------------------------------------------


ARGS = ("bench.noop", "0190f5a8-3c2e-7d51-9a3b-4f1e2d3c4b5a", Status.SUCCEEDED, 0.00123, 1)


@contextlib.contextmanager
def cli_logging(stream: IO[str]) -> Iterator[logging.Logger]:
    """The root logger set up as ``pgflow worker`` sets it up (``log_lines.configure``), writing to
    ``stream``; the process's logging put back after."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers = []
    try:
        log_lines.configure("INFO")
        root.handlers[0].setStream(stream)  # type: ignore[attr-defined]
        yield logging.getLogger("pgflow.workflows")
    finally:
        root.handlers = saved[0]
        root.setLevel(saved[1])


@contextlib.asynccontextmanager
async def log_lines_section(a: argparse.Namespace) -> AsyncIterator[tuple[dict[str, Measure], list[tuple[str, str]]]]:
    lines = 20_000 if a.quick else 100_000
    with tempfile.TemporaryFile("w+") as file, cli_logging(file) as logger:
        def timed(write_lines: Callable[[], None]) -> float:
            file.seek(0)
            file.truncate()
            began = time.thread_time()
            write_lines()
            return (time.thread_time() - began) / lines * 1e6

        def info() -> None:
            for _ in range(lines):
                logger.info(_END, *ARGS)

        def direct() -> None:
            for _ in range(lines):
                assert log_lines.write(logger, logging.INFO, _END, ARGS)

        ways: dict[str, Callable[[], None]] = {"logging: info()": info, "log_lines.write": direct}

        async def measure(way: str) -> float:
            return timed(ways[way])

        yield {name: measure for name in ways}, [("log_lines.write", "logging: info()")]


# -- the pool ----------------------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def public_checkout(pool: pool_module.Pool, within: float,
                          timeout: float | None = None) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """``Pool.connection``'s contract on psycopg_pool's own ``connection()``: the same deadline and
    the same note of the connection's last use (without it every checkout would be checked)."""
    async with AsyncConnectionPool.connection(pool, timeout) as conn:
        try:
            with pool_module.answered_within(conn, within):
                yield conn
        finally:
            pool._returned[conn] = time.monotonic()


@contextlib.asynccontextmanager
async def checkout_section(a: argparse.Namespace) -> AsyncIterator[tuple[dict[str, Measure], list[tuple[str, str]]]]:
    count = 5_000 if a.quick else 20_000
    pool = pool_module.Pool(Config(dsn=a.dsn, schema="pgflow_bench", pool_size=1))
    await pool.open(wait=True)
    try:
        async def ours() -> None:
            async with pool.connection():
                pass

        async def public() -> None:
            async with public_checkout(pool, pool.query_timeout):
                pass

        ways = {"Pool.connection": ours, "psycopg_pool connection()": public}

        async def measure(way: str) -> float:
            checkout = ways[way]
            began = time.thread_time()
            for _ in range(count):
                await checkout()
            return (time.thread_time() - began) / count * 1e6

        yield {name: measure for name in ways}, [("Pool.connection", "psycopg_pool connection()")]
    finally:
        await pool.close()


async def grown(pool: pool_module.Pool, size: int) -> None:
    """Hold ``size`` checkouts at once, so the pool opens that many connections (as a burst does)."""
    held = anyio.Event()
    out: list[int] = []

    async def hold() -> None:
        async with pool.connection():
            out.append(1)
            if len(out) == size:
                held.set()
            await held.wait()

    async with anyio.create_task_group() as group:
        for _ in range(size):
            group.start_soon(hold)


@contextlib.asynccontextmanager
async def pool_order_section(a: argparse.Namespace) -> AsyncIterator[tuple[dict[str, Measure], list[tuple[str, str]]]]:
    samples = 15 if a.quick else 40
    size = 10  # pgflow's default pool_size
    pools = {"newest first": pool_module.Pool(Config(dsn=a.dsn, schema="pgflow_bench", pool_size=size)),
             "oldest first (psycopg_pool)": pool_module.Pool(Config(dsn=a.dsn, schema="pgflow_bench", pool_size=size))}
    oldest = pools["oldest first (psycopg_pool)"]
    oldest._pool = collections.deque(oldest._pool)  # psycopg_pool's own deque and order back
    for pool in pools.values():
        await pool.open(wait=True)
        await grown(pool, size)
    try:
        async def latency(pool: pool_module.Pool) -> float:
            began = time.perf_counter()
            async with pool.connection() as conn:
                await conn.execute("SELECT 1")
            return (time.perf_counter() - began) * 1e6

        async def measure(way: str) -> float:
            # Both pools take turns within the round, each every ``gap`` seconds; the one measured is
            # ``way``, the other is kept at the same rhythm so neither round starts from a rested pool.
            other = next(p for name, p in pools.items() if name != way)
            taken = []
            for _ in range(samples):
                taken.append(await latency(pools[way]))
                await anyio.sleep(a.gap / 2)
                await latency(other)
                await anyio.sleep(a.gap / 2)
            return statistics.median(taken)

        yield {name: measure for name in pools}, [("newest first", "oldest first (psycopg_pool)")]
    finally:
        for pool in pools.values():
            await pool.close()


# -- the listener ------------------------------------------------------------------------------------------------


class PublicListener(Listener):
    """The listener on psycopg's public way: ``notifies()`` while it waits, and no notify handler, so
    what arrives during its own statements waits in psycopg's backlog for the next ``notifies()``."""

    async def _hear(self, conn: psycopg.AsyncConnection[Any], seconds: float) -> None:
        with contextlib.suppress(ValueError):  # (removed at the first wait: psycopg keeps a backlog without it)
            conn.remove_notify_handler(self._handed_over)
        try:
            with anyio.CancelScope() as self._hearing:  # (``want_streams`` cancels it, as the bypass's wait)
                async for note in conn.notifies(timeout=seconds):
                    self.dispatch(note.payload, note.channel)
        finally:
            self._hearing = None


SENDER = """
import json, sys, psycopg
dsn = sys.argv[1]
notes = json.load(sys.stdin)  # [channel, payload], the listeners' turns interleaved
with psycopg.connect(dsn, autocommit=True) as conn:
    for channel, text in notes:  # one a transaction: each wakes its listener on its own
        conn.execute("SELECT pg_notify(%s, %s)", (channel, text))
"""
SECRET = SignalKey(1, bytes(range(32)), -1.0, None)


def keyring(channel: str) -> Keyring:
    ring = Keyring(channel)
    ring.load([SECRET])
    return ring


LISTENERS: dict[str, type[Listener]] = {"socket reader": Listener, "psycopg notifies()": PublicListener}


def hear(kind: str, loop: loops.Choice, dsn: str, channels: tuple[str, str]) -> None:
    """A listener process of the listener section: it prints "ready" once listening; then, for each line
    "N" read from stdin, it hears N notifications and prints its own CPU per notification (us), from the
    first of them to the last. (A process each, so no listener's CPU is counted in another's.)"""
    async def serve() -> None:
        waiters = Waiters()
        waiters.add(signal_keys.queue("q"), Waiter())  # somebody waits: the listener stays
        listener = LISTENERS[kind](lambda: dsn, channels, waiters, keyring(channels[0]), idle=3600.0,
                                   health_every=3600.0)
        async with anyio.create_task_group() as group:
            group.start_soon(listener.run)
            while not listener.connected:
                await anyio.sleep(0.01)
            print("ready", flush=True)
            while line := await anyio.to_thread.run_sync(sys.stdin.readline):
                before = listener.heard
                while listener.heard == before:
                    await anyio.sleep(0.001)
                began, heard = time.process_time(), listener.heard
                while listener.heard < before + int(line):
                    await anyio.sleep(0.02)
                print((time.process_time() - began) / (listener.heard - heard) * 1e6, flush=True)
            group.cancel_scope.cancel()

    anyio.run(serve, backend="asyncio", backend_options=loops.backend_options(loop))


HEAR = "import sys, benchmarks.bypasses as b; b.hear(sys.argv[1], sys.argv[2], sys.argv[3], tuple(sys.argv[4:6]))"


@contextlib.asynccontextmanager
async def listener_section(a: argparse.Namespace) -> AsyncIterator[tuple[dict[str, Measure], list[tuple[str, str]]]]:
    """Four listener processes (the socket reader and ``notifies()``, on uvloop and on asyncio's own loop)
    hear their notifications in turns from one sender: a round measures the four at once."""
    count = 1_000 if a.quick else 3_000
    loops_here: list[loops.Choice] = ["uvloop", "asyncio"] if loops.uses_uvloop("auto") else ["asyncio"]
    channels = {f"{kind}, {loop}": (f"pgflow_bench_{uuid.uuid4().hex[:8]}", f"pgflows_bench_{uuid.uuid4().hex[:8]}")
                for loop in loops_here for kind in LISTENERS}
    procs = {name: subprocess.Popen([sys.executable, "-c", HEAR, name.split(", ")[0], name.split(", ")[1], a.dsn,
                                     *chans], cwd=harness.ROOT, env={**os.environ, "PYTHONPATH": str(harness.ROOT)},
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for name, chans in channels.items()}
    taken: dict[str, float] = {}
    try:
        for name, proc in procs.items():
            assert proc.stdout is not None
            if (await anyio.to_thread.run_sync(proc.stdout.readline)).strip() != "ready":
                raise harness.RunFailed(f"the listener process {name!r} did not start")

        async def round_() -> None:
            per = []
            for chans in channels.values():
                ring = keyring(chans[0])
                notes = []
                for _ in range(count):
                    pings = sealed(ring, chans, News([signal_keys.queue("q")]))
                    assert pings is not None
                    notes.append([chans[0], pings.payloads[0]])
                per.append(notes)
            for proc in procs.values():
                assert proc.stdin is not None
                proc.stdin.write(f"{count}\n")
                proc.stdin.flush()
            sender = subprocess.Popen([sys.executable, "-c", SENDER, a.dsn], stdin=subprocess.PIPE)
            assert sender.stdin is not None
            sender.stdin.write(json.dumps([note for turn in zip(*per, strict=True) for note in turn]).encode())
            sender.stdin.close()
            with anyio.fail_after(300):
                for name, proc in procs.items():
                    assert proc.stdout is not None
                    taken[name] = float(await anyio.to_thread.run_sync(proc.stdout.readline))
            await anyio.to_thread.run_sync(sender.wait)

        async def measure(way: str) -> float:
            if way not in taken:  # (the first way of a round asked measures them all)
                await round_()
            return taken.pop(way)

        yield {name: measure for name in procs}, [(f"socket reader, {loop}", f"psycopg notifies(), {loop}")
                                                  for loop in loops_here]
    finally:
        for proc in procs.values():
            proc.kill()
            await anyio.to_thread.run_sync(proc.wait)


# -- what they serve: pgflow's processes with a public way in place of a bypass ------------------------------------


def use_public_ways(names: str) -> None:
    """Put the public way in place of each bypass ``names`` lists (comma-separated), in this process,
    before an App opens: how the served sections run a worker or a caller without a bypass."""
    from pgflow._core import worker_parts
    from pgflow._core.signals import service

    for name in filter(None, names.split(",")):
        if name == "runs":
            setattr(worker_parts, "Runs", GroupRuns)  # noqa: B010 - (worker_parts imports the name)
        elif name == "log_lines":
            log_lines.write = lambda *_: False  # outcomes.log_end then goes through logging
        elif name == "checkout":
            pool_module.Pool.connection = public_connection  # type: ignore[method-assign,assignment]
        elif name == "pool_order":
            pool_module._NewestFirst.popleft = collections.deque.popleft  # type: ignore[method-assign]
        elif name == "listener":
            setattr(service, "Listener", PublicListener)  # noqa: B010 - (service imports the name)
        else:
            raise SystemExit(f"BENCH_PUBLIC: no public way for {name!r}")


def public_connection(self: pool_module.Pool, timeout: float | None = None, *,
                      within: float | None = None) -> contextlib.AbstractAsyncContextManager[Any]:
    return public_checkout(self, self.query_timeout if within is None else within, timeout)


def __getattr__(name: str) -> Any:
    """``pgflow worker benchmarks.bypasses:app``: the benchmarks' no-op app (``peers/pgflow_peer.py``),
    after the public ways ``$BENCH_PUBLIC`` names have been put in place."""
    if name != "app":
        raise AttributeError(name)
    use_public_ways(os.environ.get("BENCH_PUBLIC", ""))
    from benchmarks.peers import pgflow_peer

    return pgflow_peer.app


DATABASE = "pgflow_bench_bypasses"
WORKER = ["-m", "pgflow", "--log-level", "INFO", "worker", "benchmarks.bypasses:app", "--grace", "0"]
CALLER = """
import asyncio, json, statistics, sys, time
import benchmarks.bypasses as bypasses
app = bypasses.app  # (the public ways of $BENCH_PUBLIC put in place)
from benchmarks.peers.pgflow_peer import noop

async def once():
    began = time.perf_counter()
    await (await noop.start_async()).result_async(timeout=30)
    return (time.perf_counter() - began) * 1000

async def main(runs, gap):
    for _ in range(30):
        await once()
    if gap:  # a burst first, as an application's busy moment: the pools grow, then sit mostly idle
        await asyncio.gather(*(once() for _ in range(16)))
        await asyncio.sleep(1.0)
    print("ready", flush=True)
    sys.stdin.readline()
    cpu, taken = time.process_time(), []
    for _ in range(runs):
        taken.append(await once())
        if gap:
            await asyncio.sleep(gap)
    cpu = time.process_time() - cpu
    print(json.dumps({"p50_ms": statistics.median(taken), "caller_cpu_us": cpu / runs * 1e6}), flush=True)
    await app.close_async()

asyncio.run(main(int(sys.argv[1]), float(sys.argv[2])))
"""


def env_for(dsn: str, public: str) -> dict[str, str]:
    return {**os.environ, "BENCH_DSN": dsn, "PGFLOW_DSN": dsn, "PYTHONPATH": str(harness.ROOT),
            "BENCH_PUBLIC": public}


@contextlib.asynccontextmanager
async def bench_database(a: argparse.Namespace, name: str) -> AsyncIterator[str]:
    dsn = harness.recreate_database(a.dsn, name)
    subprocess.run([sys.executable, "-c", drain_ab.SETUP], cwd=harness.ROOT, env=env_for(dsn, ""), check=True)
    try:
        yield dsn
    finally:
        harness.drop_database(a.dsn, name)


def served_drain(concurrency: int) -> Callable[[argparse.Namespace], contextlib.AbstractAsyncContextManager[
        tuple[dict[str, Measure], list[tuple[str, str]]]]]:
    @contextlib.asynccontextmanager
    async def section(a: argparse.Namespace) -> AsyncIterator[tuple[dict[str, Measure], list[tuple[str, str]]]]:
        tasks = 4_000 if a.quick else 20_000
        async with bench_database(a, DATABASE) as dsn:
            ways = {"pgflow": "", "public runs": "runs", "public log_lines": "log_lines",
                    "public checkout": "checkout"}

            async def measure(way: str) -> dict[str, float]:
                # drain_ab's drain, of this checkout, with our app: the public ways reach the worker by
                # its environment (``app`` above reads it).
                os.environ["BENCH_PUBLIC"] = ways[way]
                drain_ab.APP = "benchmarks.bypasses:app"
                try:
                    figures = await anyio.to_thread.run_sync(
                        drain_ab.drain, harness.ROOT, dsn, concurrency, tasks, Path("/tmp/bench-bypasses-drain.log"))
                finally:
                    os.environ.pop("BENCH_PUBLIC", None)
                return {"worker_cpu_us": figures["cpu_us_per_workflow"], "per_s": figures["per_s"]}

            yield {name: measure for name in ways}, [("pgflow", way) for way in ways if way != "pgflow"]

    return section


async def start_to_result(dsn: str, public: str, runs: int, gap: float) -> dict[str, float]:
    """One caller process and one ``pgflow worker`` process on ``dsn``, both with the public ways
    ``public`` in place: the caller's start-to-result p50 and the CPU of each per workflow."""
    env = env_for(dsn, public)
    with open("/tmp/bench-bypasses-worker.log", "ab") as log:
        worker = subprocess.Popen([sys.executable, *WORKER, "--concurrency", "16"], cwd=harness.ROOT, env=env,
                                  stderr=log, stdout=subprocess.DEVNULL)
    caller = subprocess.Popen([sys.executable, "-c", CALLER, str(runs), str(gap)], cwd=harness.ROOT, env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert caller.stdin is not None and caller.stdout is not None
    try:
        if (await anyio.to_thread.run_sync(caller.stdout.readline)).strip() != "ready":
            raise harness.RunFailed("a caller did not start (see /tmp/bench-bypasses-worker.log)")
        worker_cpu = harness.process_cpu(worker.pid)
        caller.stdin.write("\n")
        caller.stdin.flush()
        figures: dict[str, float] = json.loads(await anyio.to_thread.run_sync(caller.stdout.readline))
        figures["worker_cpu_us"] = (harness.process_cpu(worker.pid) - worker_cpu) / runs * 1e6
        await anyio.to_thread.run_sync(caller.wait)
        return figures
    finally:
        caller.kill()
        worker.terminate()
        await anyio.to_thread.run_sync(worker.wait)


@contextlib.asynccontextmanager
async def side_by_side(a: argparse.Namespace, ways: dict[str, str], runs: int, gap: float,
                       keys: tuple[str, ...]) -> AsyncIterator[tuple[dict[str, Measure], list[tuple[str, str]]]]:
    """Start-to-result, the ways at the same time, each a caller and a worker on a database of its own:
    a round's figures are taken in one window, so the machine's drift from one minute to the next (a
    quarter here) falls on every way alike."""
    async with contextlib.AsyncExitStack() as stack:
        dsns = {way: await stack.enter_async_context(bench_database(a, f"{DATABASE}_{n}"))
                for n, way in enumerate(ways)}
        taken: dict[str, dict[str, float]] = {}

        async def round_() -> None:
            async def one(way: str) -> None:
                figures = await start_to_result(dsns[way], ways[way], runs, gap)
                taken[way] = {k: figures[k] for k in keys}

            async with anyio.create_task_group() as group:
                for way in ways:
                    group.start_soon(one, way)

        async def measure(way: str) -> dict[str, float]:
            if way not in taken:  # (the first way of a round asked measures them all)
                await round_()
            return taken.pop(way)

        yield {name: measure for name in ways}, [("pgflow", way) for way in ways if way != "pgflow"]


def lone_section(a: argparse.Namespace) -> contextlib.AbstractAsyncContextManager[
        tuple[dict[str, Measure], list[tuple[str, str]]]]:
    return side_by_side(a, {"pgflow": "", "public listener": "listener", "public checkout": "checkout"},
                        100 if a.quick else 300, 0.0, ("caller_cpu_us", "worker_cpu_us", "p50_ms"))


def sporadic_section(a: argparse.Namespace) -> contextlib.AbstractAsyncContextManager[
        tuple[dict[str, Measure], list[tuple[str, str]]]]:
    return side_by_side(a, {"pgflow": "", "public pool_order": "pool_order"}, 15 if a.quick else 40, a.sporadic_gap,
                        ("p50_ms", "caller_cpu_us", "worker_cpu_us"))


# -- running them ------------------------------------------------------------------------------------------------

Section = Callable[[argparse.Namespace], contextlib.AbstractAsyncContextManager[
    tuple[dict[str, Measure], list[tuple[str, str]]]]]
SECTIONS: dict[str, Section] = {
    "runs": runs_section, "log_lines": log_lines_section, "checkout": checkout_section,
    "pool_order": pool_order_section, "listener": listener_section,
    "drain16": served_drain(16), "drain64": served_drain(64),
    "lone": lone_section, "sporadic": sporadic_section}
MICRO = ["runs", "log_lines", "checkout", "pool_order", "listener"]
UNITS = {"runs": "us per run (CPU)", "log_lines": "us per line (CPU)", "checkout": "us per checkout (CPU)",
         "pool_order": "us per checkout + SELECT 1 (latency p50)", "listener": "us per notification (CPU)",
         "drain16": "worker CPU us per no-op, draining at concurrency 16",
         "drain64": "worker CPU us per no-op, draining at concurrency 64",
         "lone": "caller CPU us per start-to-result, back to back",
         "sporadic": "start-to-result p50 ms, one every --sporadic-gap s"}


async def run_section(name: str, a: argparse.Namespace) -> dict[str, Any]:
    rounds_wanted = a.rounds or (3 if a.quick else 7 if name in MICRO else 5)
    harness.log(f"{name} ({UNITS[name]}), {rounds_wanted} rounds:")
    async with SECTIONS[name](a) as (ways, pairs):
        if a.ways:  # (the bypass each pair is measured against is kept)
            wanted = set(a.ways.split(",")) | {bypass for bypass, public in pairs if public in a.ways.split(",")}
            ways = {way: measure for way, measure in ways.items() if way in wanted}
            pairs = [(bypass, public) for bypass, public in pairs if public in wanted]
        if name in MICRO:
            for way in ways:  # warm up
                await ways[way](way)
        rounds: dict[str, list[dict[str, float]]] = {way: [] for way in ways}
        for r in range(rounds_wanted):
            for way in (list(ways) if r % 2 == 0 else list(reversed(ways))):
                figure = await measured(name, ways[way], way)
                rounds[way].append(figure if isinstance(figure, dict) else {"figure": figure})
                if name not in MICRO:
                    harness.log(f"  round {r} {way}: " + ", ".join(f"{k} {v:.1f}" for k, v in rounds[way][-1].items()))
    keys = list(next(iter(rounds.values()))[0])
    medians = {way: {k: statistics.median(f[k] for f in figures) for k in keys} for way, figures in rounds.items()}
    main_key = keys[0]
    for way, figures in rounds.items():
        others = "  ".join(f"{k} {medians[way][k]:.1f}" for k in keys[1:])
        harness.log(f"  {way:32} {medians[way][main_key]:9.2f}   rounds: "
                    f"{' '.join(f'{f[main_key]:.1f}' for f in figures)}   {others}")
    ratios = {f"{public} / {bypass}": medians[public][main_key] / medians[bypass][main_key] for bypass, public in pairs}
    for pair, ratio in ratios.items():
        harness.log(f"  {pair}: {ratio:.3f}x")
    return {"unit": UNITS[name], "rounds_run": rounds_wanted, "pairs": pairs, "medians": medians, "rounds": rounds,
            "ratios": ratios}


async def measured(section: str, measure: Measure, way: str) -> float | dict[str, float]:
    """One measurement; one of what they serve is tried again (twice at most) when the shared server
    turned a connection away (other sessions held all of its max_connections) or a process failed."""
    for attempt in range(3):
        try:
            return await measure(way)
        except (harness.RunFailed, psycopg.OperationalError, json.JSONDecodeError) as exc:
            if section in MICRO or attempt == 2:
                raise
            harness.log(f"  {way}: failed ({exc}); trying again in 10 s")
            await anyio.sleep(10)
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bypasses", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 rounds and smaller counts")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds per section (micro-benchmarks 7, what they serve 5; --quick: 3)")
    p.add_argument("--only", default=",".join(MICRO), help=f"sections, comma-separated, of: {', '.join(SECTIONS)}"
                   f" (default: the micro-benchmarks, {','.join(MICRO)})")
    p.add_argument("--gap", type=float, default=0.3, help="pool_order: seconds between one pool's checkouts")
    p.add_argument("--sporadic-gap", type=float, default=0.3,
                   help="sporadic: seconds between starts (a caller's pool grown to 10 takes one connection a"
                        " workflow: oldest first, each has sat idle 3 s, longer than pool.IDLE_CHECK_AFTER)")
    p.add_argument("--loop", choices=loops.CHOICES, default="auto",
                   help="the micro-benchmarks' event loop, as pgflow worker's --loop (auto: uvloop where installed)")
    p.add_argument("--ways", default=None, help="only these ways (and the bypass each is measured against)")
    p.add_argument("--dsn", default=None)
    p.add_argument("--output", default=None, help="the results file (default benchmarks/results/bypasses-...json)")
    p.add_argument("--json", action="store_true", help="the results as one JSON object on stdout")
    a = p.parse_args(argv)
    a.dsn = harness.resolve_dsn(a.dsn)
    names = [n for n in a.only.split(",") if n]
    unknown = set(names) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections: {', '.join(sorted(unknown))} (known: {', '.join(SECTIONS)})")
    report: dict[str, Any] = {"benchmark": "bypasses", "quick": a.quick,
                              "loop": "uvloop" if loops.uses_uvloop(a.loop) else "asyncio",
                              "versions": harness.versions(), "load_before": os.getloadavg(), "sections": {}}
    for name in names:
        report["sections"][name] = anyio.run(run_section, name, a, backend="asyncio",
                                             backend_options=loops.backend_options(a.loop))
    report["load_after"] = os.getloadavg()
    info = harness.server_info(a.dsn)
    report["server"] = info
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H%M")
    harness.log(f"wrote {harness.write_report(report, a.output, f'bypasses-{stamp}-{harness.pg_major(info)}.json')}")
    if a.json:
        print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
