"""The worker of the liveness probe tests (tests/test_worker_health.py)."""

from __future__ import annotations

import time

import pgflow

app = pgflow.App()


@app.workflow(name="probed.block")
async def block(seconds: float) -> None:
    time.sleep(seconds)  # noqa: ASYNC251 - on purpose: it blocks the worker's loop, which the probe must tell


@app.workflow(name="probed.noop")
async def noop() -> int:
    return 1
