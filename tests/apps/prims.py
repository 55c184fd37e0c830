"""Workflows for the tests of the durable primitives (sleep, events, messages, start_by_name), served
by worker processes.

Every workflow has an explicit name, so a test process can start it by name without importing this
module, and reach it through ``app.handle``. Side effects go to a file whose path the test passes in
(one line per call, with the pid of the process that wrote it), so a test can tell which worker ran
what, and how often. A worker process serves ``app`` (configured from PGFLOW_DSN and PGFLOW_SCHEMA).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio

import pgflow

GATE_LIMIT = 180.0  # seconds a step waits for its gate before giving up (a test that died)


def note(path: str, line: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def build(app: pgflow.App) -> SimpleNamespace:
    # -- start_by_name --------------------------------------------------------------------------------------

    @app.workflow(name="prims.report")
    async def report(title: str, pages: int, tags: list[str] | None = None) -> str:
        return f"{title}:{pages}:{','.join(tags or [])}"

    @app.workflow(name="prims.report_sync")
    def report_sync(title: str, pages: int, tags: list[str] | None = None) -> str:
        return f"{title}:{pages}:{','.join(tags or [])}"

    # -- durable sleep ----------------------------------------------------------------------------------------

    @app.step(name="prims.mark")
    def mark(path: str, what: str) -> float:
        note(path, f"{what} {os.getpid()} {time.time():.3f}")
        return time.time()

    @app.workflow(name="prims.sleeper")
    async def sleeper(path: str, seconds: float) -> list[float]:
        before = await mark(path, "before")
        await pgflow.sleep_async(seconds)
        after = await mark(path, "after")
        return [before, after]

    @app.workflow(name="prims.sleeper_sync")
    def sleeper_sync(path: str, seconds: float) -> list[float]:
        before = mark(path, "before")
        pgflow.sleep(seconds)
        after = mark(path, "after")
        return [before, after]

    @app.workflow(name="prims.quick")
    async def quick(path: str) -> int:
        note(path, f"quick {os.getpid()}")
        return os.getpid()

    # -- events -----------------------------------------------------------------------------------------------

    @app.workflow(name="prims.publisher")
    async def publisher(path: str, gate: str) -> str:
        await pgflow.set_event_async("stage", "started")
        note(path, f"published {os.getpid()}")
        await wait_for_file(gate)
        await pgflow.set_event_async("stage", "done")
        await pgflow.set_event_async("progress", {"pct": 100})
        return "ok"

    @app.workflow(name="prims.publisher_sync")
    def publisher_sync(path: str, gate: str) -> str:
        pgflow.set_event("stage", "started")
        note(path, f"published {os.getpid()}")
        wait_for_file_sync(gate)
        pgflow.set_event("stage", "done")
        pgflow.set_event("progress", {"pct": 100})
        return "ok"

    # -- messages ---------------------------------------------------------------------------------------------

    @app.step(name="prims.gated")
    async def gated(path: str, gate: str, got: Any) -> Any:
        note(path, f"got {got!r} {os.getpid()}")
        await wait_for_file(gate)
        return got

    @app.workflow(name="prims.receiver")
    async def receiver(path: str, gate: str, n: int, timeout: float) -> list[Any]:
        got = []
        for _ in range(n):
            message = await pgflow.recv_async("inbox", timeout=timeout)
            got.append(await gated(path, gate, message))
        return got

    @app.workflow(name="prims.receiver_sync")
    def receiver_sync(path: str, gate: str, n: int, timeout: float) -> list[Any]:
        got = []
        for _ in range(n):
            message = pgflow.recv("inbox", timeout=timeout)
            got.append(gated(path, gate, message))
        return got

    return SimpleNamespace(report=report, report_sync=report_sync, mark=mark, sleeper=sleeper,
                           sleeper_sync=sleeper_sync, quick=quick, publisher=publisher,
                           publisher_sync=publisher_sync, gated=gated, receiver=receiver,
                           receiver_sync=receiver_sync)


async def wait_for_file(path: str | Path) -> None:
    deadline = time.monotonic() + GATE_LIMIT
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no gate file {path} after {GATE_LIMIT}s")
        await anyio.sleep(0.05)


def wait_for_file_sync(path: str | Path) -> None:
    deadline = time.monotonic() + GATE_LIMIT
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no gate file {path} after {GATE_LIMIT}s")
        time.sleep(0.05)


# Env-configured; connects lazily, so only a worker process serving it connects. PRIMS_SUSPEND_AFTER lets
# the sleep test's workers give a sleeper's slot back after half a second, so that its sleep can be short
# and still be a suspended one (5.0: the App's default).
app = pgflow.App(suspend_after=float(os.environ.get("PRIMS_SUSPEND_AFTER", "5.0")))
flows = build(app)
