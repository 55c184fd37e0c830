"""The worker of the liveness probe tests (tests/test_worker_health.py) and of the loop and process
tests (tests/test_loops.py)."""

from __future__ import annotations

import asyncio
import gc
import time

import pgflow

app = pgflow.App()


@app.workflow(name="probed.block")
async def block(seconds: float) -> None:
    time.sleep(seconds)  # noqa: ASYNC251 - on purpose: it blocks the worker's loop, which the probe must tell


@app.workflow(name="probed.noop")
async def noop() -> int:
    return 1


@app.workflow(name="probed.loop")
async def loop_kind() -> str:
    """The kind of event loop the worker runs its workflows on (tests/test_loops.py)."""
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


@app.workflow(name="probed.frozen")
async def frozen() -> int:
    """How many objects the worker's process froze out of the collector's sight (tests/test_loops.py)."""
    return gc.get_freeze_count()
