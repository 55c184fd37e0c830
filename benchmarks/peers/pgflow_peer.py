"""pgflow, from this checkout: ``wf.start_async``, ``handle.result_async``, ``pgflow worker``."""

from __future__ import annotations

import asyncio
import os
import time

import pgflow

DSN = os.environ.get("BENCH_DSN")
# The client App gets one connection per concurrent caller (pgflow's default pool_size is 10); the
# worker's App keeps pgflow's defaults.
app = pgflow.App(DSN, pool_size=int(os.environ.get("BENCH_POOL", "10")))


@app.workflow(name="bench.noop")
async def noop() -> None:
    return None


async def setup() -> None:
    await app.migrate_async()


async def enqueue(n: int, callers: int) -> float:
    """Seconds taken by ``callers`` asyncio tasks to start ``n`` workflows, one start_async at a time."""
    left = [n]

    async def caller() -> None:
        while left[0] > 0:
            left[0] -= 1
            await noop.start_async()

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    return time.perf_counter() - t0


async def latency(runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        handle = await noop.start_async()
        await handle.result_async(timeout=30)
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def close() -> None:
    await app.close_async()
