"""The worker of the shutdown tests (tests/test_cli_workers.py): an atexit hook that leaves a file
behind, so a test can tell a process that left through Python's normal exit (hooks run) from one that
left by ``os._exit``; a sync workflow, whose thread goes back to the loop's pool; and a workflow held
in a sync step until a gate file exists, whose thread a stopping worker cannot take back."""

from __future__ import annotations

import atexit
import os
import time
from pathlib import Path

import pgflow

app = pgflow.App()

GATE_POLL = 0.05  # seconds between looks at the gate file


@app.workflow(name="exiting.quick")
def quick(n: int) -> int:
    return n + 1


@app.step(name="exiting.wait")
def wait_for(gate: str, started: str) -> None:
    Path(started).touch()
    while not Path(gate).exists():
        time.sleep(GATE_POLL)


@app.workflow(name="exiting.held")
async def held(gate: str, started: str) -> None:
    await wait_for(gate, started)


def _at_exit() -> None:
    path = os.environ.get("PGFLOW_TEST_ATEXIT")
    if path:
        Path(path).write_text(f"{os.getpid()}\n")


atexit.register(_at_exit)
