"""Workflows for the fleet tests (tests/test_fleet.py, tests/test_cron.py), served by worker processes.

Steps and workflow bodies append lines to a side-effect file whose path the test passes in, most of
them with the pid of the process that wrote them, so a test can tell which worker ran what and how
often. Some hold still until a gate file exists; the gate of the zombie workflow is per process
(``open-<pid>``), so a test can let one worker go on while another one stays blocked.

Where the fleet tests need a record another process can query at once (concurrency probes, cron
ticks), steps write rows to tables the test creates in its own schema.

A worker process serves ``app`` (configured from PGFLOW_DSN and PGFLOW_SCHEMA); the test process calls
``build`` on its own App. Both register the same functions from this module, so the workflow and step
names (module + qualname) match, and both declare the same queue limits.
"""

from __future__ import annotations

import os
import time
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import anyio
import psycopg

import pgflow

GATE_POLL = 0.05  # seconds between looks at a gate file
GATE_LIMIT = 180.0  # seconds a step waits for its gate before giving up (a test that died)

LIMITED, PACED, TICKS = "limited", "paced", "ticks"
LIMITED_CONCURRENCY = 2
PACED_RATE, PACED_PER = 5, 1.0


def note(path: str, line: str) -> None:
    """Append one line to the side-effect file; a line per call, flushed before returning."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


async def wait_for_file(path: str | Path) -> None:
    deadline = time.monotonic() + GATE_LIMIT
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no gate file {path} after {GATE_LIMIT}s")
        await anyio.sleep(GATE_POLL)


def wait_for_file_sync(path: str | Path) -> None:
    deadline = time.monotonic() + GATE_LIMIT
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no gate file {path} after {GATE_LIMIT}s")
        time.sleep(GATE_POLL)


def own_gate(gates: str) -> Path:
    """The gate of the process that asks: the test opens it per worker process."""
    return Path(gates) / f"open-{os.getpid()}"


def build(app: pgflow.App) -> SimpleNamespace:
    app.queue(LIMITED, concurrency=LIMITED_CONCURRENCY)
    app.queue(PACED, rate_limit=PACED_RATE, per=PACED_PER)

    def table(name: str) -> str:
        return f'"{app.schema}".{name}'

    # -- a worker paused past its lease (SIGSTOP) --------------------------------------------------------

    @app.step
    def stamp(path: str) -> int:
        note(path, f"stamp {os.getpid()}")
        return os.getpid()

    @app.step
    async def gated_step(path: str, gates: str) -> int:
        note(path, f"start {os.getpid()}")
        await wait_for_file(own_gate(gates))
        note(path, f"done {os.getpid()}")
        return os.getpid()

    @app.workflow
    async def zombie(path: str, gates: str, where: str) -> int:
        """Holds still, per process, at the point where its next write is the one ``where`` names:
        a step record ("step"), a stream chunk ("stream") or the completion ("finish"). Returns the
        pid of the process that ran the body to its end: not journaled, so a late completion by a
        process that lost the workflow would show in the output."""
        await stamp(path)
        if where == "step":
            await gated_step(path, gates)
        else:
            note(path, f"start {os.getpid()}")
            await wait_for_file(own_gate(gates))
            note(path, f"done {os.getpid()}")
            if where == "stream":
                await pgflow.write_stream_async("pids", os.getpid())
        return os.getpid()

    # -- queue limits ---------------------------------------------------------------------------------------

    @app.step
    def occupy(tag: str, hold: float) -> int:
        """Record (pid, start, end) in the test's probe table; return how many were in flight on entry."""
        with psycopg.connect(app.dsn, autocommit=True) as conn:
            conn.execute(f"INSERT INTO {table('probe')} (tag, pid, started) VALUES (%s, %s, clock_timestamp())",
                         (tag, os.getpid()))
            row = conn.execute(f"SELECT count(*) FROM {table('probe')} WHERE ended IS NULL").fetchone()
            time.sleep(hold)
            conn.execute(f"UPDATE {table('probe')} SET ended = clock_timestamp(), seen = %s WHERE tag = %s",
                         (row[0] if row else 0, tag))
        return int(row[0]) if row else 0

    @app.workflow(queue=LIMITED)
    async def limited(tag: str, hold: float) -> int:
        return await occupy(tag, hold)

    @app.workflow(queue=PACED)
    async def paced(i: int) -> int:
        return os.getpid()

    # -- cron ------------------------------------------------------------------------------------------------

    @app.step
    def record_tick(at: str) -> int:
        with psycopg.connect(app.dsn, autocommit=True) as conn:
            conn.execute(f"INSERT INTO {table('tick_runs')} (tick, pid) VALUES (%s, %s)", (at, os.getpid()))
        return os.getpid()

    @app.workflow(queue=TICKS, schedule="* * * * * *")
    def every_second(at: datetime) -> str:
        record_tick(at.isoformat())
        return at.isoformat()

    # -- cancellation --------------------------------------------------------------------------------------

    @app.step
    async def beat_async(path: str, i: int) -> int:
        note(path, f"beat {i}")
        await anyio.sleep(0.05)
        return i

    @app.step
    def beat_sync(path: str, i: int) -> int:
        note(path, f"beat {i}")
        time.sleep(0.05)
        return i

    @app.workflow
    async def beats_async(path: str, n: int) -> int:
        total = 0
        for i in range(n):
            total += await beat_async(path, i)
        return total

    @app.workflow
    def beats_sync(path: str, n: int) -> int:
        total = 0
        for i in range(n):
            total += beat_sync(path, i)
        return total

    @app.workflow
    async def ping(x: int) -> int:
        return x + 1

    # -- holding a step: timeouts, poison workflows, the supervisor -------------------------------------

    @app.step
    async def held_async(path: str, gate: str) -> int:
        note(path, f"held start {os.getpid()}")
        await wait_for_file(gate)
        note(path, f"held done {os.getpid()}")
        return os.getpid()

    @app.step
    def held_sync(path: str, gate: str) -> int:
        note(path, f"held start {os.getpid()}")
        wait_for_file_sync(gate)
        note(path, f"held done {os.getpid()}")
        return os.getpid()

    @app.workflow
    async def hold(path: str, gate: str) -> int:
        return await held_async(path, gate)

    @app.workflow(timeout=1.0)
    async def slow_async(path: str, gate: str) -> int:
        return await held_async(path, gate)

    @app.workflow(timeout=1.0)
    def slow_sync(path: str, gate: str) -> int:
        return held_sync(path, gate)

    @app.workflow(timeout=3.0)  # the test kills its worker a moment after the step starts, then waits it out
    async def deadline_flow(path: str, gate: str) -> int:
        return await held_async(path, gate)

    @app.workflow(max_attempts=2)
    async def poison(path: str, gate: str) -> int:
        return await held_async(path, gate)

    # -- child workflows -------------------------------------------------------------------------------------

    @app.step
    async def child_work(path: str, gate: str, i: int) -> int:
        await wait_for_file(gate)
        note(path, f"child {i} ran {os.getpid()}")
        return i * 10

    @app.workflow
    async def child(path: str, gate: str, i: int) -> int:
        note(path, f"child {i} waiting {os.getpid()}")
        return await child_work(path, gate, i)

    @app.workflow
    async def parent_async(path: str, gate: str, n: int) -> int:
        handles = [await child.start_async(path, gate, i) for i in range(n)]
        note(path, f"parent waiting {os.getpid()}")
        return sum([await h.result_async() for h in handles])

    @app.workflow
    def parent_sync(path: str, gate: str, n: int) -> int:
        handles = [child.start(path, gate, i) for i in range(n)]
        note(path, f"parent waiting {os.getpid()}")
        return sum(h.result() for h in handles)

    return SimpleNamespace(
        stamp=stamp, gated_step=gated_step, zombie=zombie, occupy=occupy, limited=limited, paced=paced,
        record_tick=record_tick, every_second=every_second, beat_async=beat_async, beat_sync=beat_sync,
        beats={"async": beats_async, "sync": beats_sync}, ping=ping, held_async=held_async,
        held_sync=held_sync, hold=hold, slow={"async": slow_async, "sync": slow_sync},
        deadline_flow=deadline_flow, poison=poison, child_work=child_work, child=child,
        parent={"async": parent_async, "sync": parent_sync},
    )


app = pgflow.App()  # env-configured; connects lazily, so only a worker process serving it connects
flows = build(app)
