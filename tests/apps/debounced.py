"""The workflow of the debounce crash tests (tests/test_debounce.py), served by worker processes.

Its one step appends a line to a side-effect file whose path the test passes in, as it starts and as
it ends, each with the argument it ran with and the writer's pid, and holds still in between until the
gate file exists: so the test can kill the worker while the run is under way, and count the runs.

A worker process serves ``app`` (configured from PGFLOW_DSN and PGFLOW_SCHEMA); the test process calls
``build`` on its own App, so that both register the same names.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import anyio

import pgflow

GATE_POLL = 0.05  # seconds between looks at the gate file
GATE_LIMIT = 180.0  # seconds the step waits for its gate before giving up (a test that died)


def note(path: str, line: str) -> None:
    """Append one line to the side-effect file, flushed before returning."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


async def wait_for_file(path: str) -> None:
    deadline = time.monotonic() + GATE_LIMIT
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no gate file {path} after {GATE_LIMIT}s")
        await anyio.sleep(GATE_POLL)


def build(app: pgflow.App) -> SimpleNamespace:
    @app.step
    async def work(path: str, gate: str, n: int) -> int:
        note(path, f"start {n} {os.getpid()}")
        await wait_for_file(gate)
        note(path, f"done {n} {os.getpid()}")
        return n * 10

    @app.workflow
    async def debounced(path: str, gate: str, n: int) -> int:
        return await work(path, gate, n)

    return SimpleNamespace(work=work, debounced=debounced)


app = pgflow.App()  # env-configured; connects lazily, so only a worker process serving it connects
flows = build(app)
