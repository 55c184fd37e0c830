"""procrastinate: ``task.defer_async``, the job's status polled for the result (procrastinate keeps no
results), ``procrastinate worker``."""

from __future__ import annotations

import asyncio
import os
import time

import procrastinate

DSN = os.environ.get("BENCH_DSN", "")
POOL = int(os.environ.get("BENCH_POOL", "4"))
# How often the latency caller looks at its job's status: procrastinate has no result notification.
STATUS_POLL = float(os.environ.get("BENCH_PROCRASTINATE_POLL", "0.002"))

app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=DSN, min_size=1, max_size=POOL))


@app.task(name="noop")
async def noop() -> None:
    return None


_opened = False


async def _open() -> None:
    global _opened
    if not _opened:
        await app.open_async()
        _opened = True


async def setup() -> None:
    await _open()
    await app.schema_manager.apply_schema_async()


async def enqueue(n: int, callers: int) -> float:
    left = [n]

    async def caller() -> None:
        while left[0] > 0:
            left[0] -= 1
            await noop.defer_async()

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    return time.perf_counter() - t0


async def latency(runs: int) -> list[float]:
    await _open()
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        job_id = await noop.defer_async()
        deadline = time.monotonic() + 30
        while (status := await app.job_manager.get_job_status_async(job_id)).value != "succeeded":
            if status.value in ("failed", "cancelled", "aborted") or time.monotonic() > deadline:
                raise RuntimeError(f"job {job_id} ended {status.value}")
            await asyncio.sleep(STATUS_POLL)
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def close() -> None:
    if _opened:
        await app.close_async()
