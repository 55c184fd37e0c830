"""The app fleet.py's worker processes serve (``python -m pgflow worker benchmarks.fleet_app:app``, the DSN
and schema from PGFLOW_DSN and PGFLOW_SCHEMA), and the orchestrator's own App of the same workflows. A
module of its own so that the workers import the very code the orchestrator registers, whether
fleet.py runs as ``__main__`` or not."""

from __future__ import annotations

import asyncio
import os
import time

import pgflow

APP_TARGET = "benchmarks.fleet_app:app"
STEP_SLEEP = 0.02  # seconds each step of the failover workflow takes
STREAM_KEY = "ticks"
DEFAULT_POLL = 1.0  # pgflow's default poll_interval, which the workers use


def make_app(dsn: str | None = None, schema: str | None = None, pool_size: int = 10) -> pgflow.App:
    """An App with the benchmark's workflows: ``fleet.noop``, and ``fleet.ticker``, a workflow that steps
    and writes a chunk until it is stopped (so that a worker can be killed in the middle of it)."""
    app = pgflow.App(dsn, schema=schema, pool_size=pool_size)

    @app.workflow(name="fleet.noop")
    async def noop() -> None:
        return None

    @app.step(name="fleet.tick")
    async def tick(i: int) -> tuple[int, float]:
        started = time.time()
        await asyncio.sleep(STEP_SLEEP)
        return os.getpid(), started

    @app.workflow(name="fleet.ticker")
    async def ticker(steps: int) -> int:
        # The sleep is in the step, so a replay after a crash skips the finished iterations at once;
        # the chunks of those iterations are skipped too (the n-th write of the body lands at the same
        # position on every run), so the new chunks are the new worker's, carrying its pid.
        for i in range(steps):
            await tick(i)
            await pgflow.write_stream_async(STREAM_KEY, [os.getpid(), time.time(), i])
        return steps

    return app


# Configured from PGFLOW_DSN and PGFLOW_SCHEMA in the worker processes; nothing connects on import.
# FLEET_POOL_SIZE (--pool-size) is for experiments; pgflow's default is 10.
app = make_app(pool_size=int(os.environ.get("FLEET_POOL_SIZE", "10")))
