"""pgqueuer: ``Queries.enqueue``, a ``CompletionWatcher`` for the result, and its worker (asyncpg driver, as
its quick start).

The worker runs as ``python -m benchmarks.peers.pgqueuer_peer``: ``pgqueuer.run(factory)``, which is what
``pgq run`` calls, on uvloop as ``pgq run`` does, at its best batch size measured here (see below). (``pgq run`` itself fails at start-up in pgqueuer 1.6.0
with typer 0.29: its --log-level reaches the logging setup as a str, ``'str' object has no attribute
'name'``.) Logging is set to BENCH_LOG_LEVEL (WARNING).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
from pgqueuer import PgQueuer
from pgqueuer.db import AsyncpgDriver, AsyncpgPoolDriver
from pgqueuer.models import Job
from pgqueuer.queries import Queries

DSN = os.environ.get("BENCH_DSN", "")
CONCURRENCY = int(os.environ.get("BENCH_CONCURRENCY", "16"))
POOL = int(os.environ.get("BENCH_POOL", "16"))


@contextlib.asynccontextmanager
async def main() -> AsyncIterator[PgQueuer]:
    """The factory ``pgq run`` takes (pgqueuer 1.6 wants an async context manager)."""
    connection = await asyncpg.connect(DSN)
    try:
        pgq = PgQueuer(AsyncpgDriver(connection))

        @pgq.entrypoint("noop", concurrency_limit=CONCURRENCY)
        async def noop(job: Job) -> None:
            return None

        yield pgq
    finally:
        await connection.close()


_pool: Any = None


async def _queries() -> Queries:
    global _pool
    if _pool is None:
        _pool = await asyncpg.create_pool(DSN, min_size=POOL, max_size=POOL)
    return Queries(AsyncpgPoolDriver(_pool))


async def setup() -> None:
    connection = await asyncpg.connect(DSN)
    try:
        await Queries(AsyncpgDriver(connection)).install()
    finally:
        await connection.close()


async def enqueue(n: int, callers: int) -> float:
    queries = await _queries()
    left = [n]

    async def caller() -> None:
        while left[0] > 0:
            left[0] -= 1
            await queries.enqueue("noop", None)

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    return time.perf_counter() - t0


async def latency(runs: int) -> list[float]:
    from pgqueuer.core.completion import CompletionWatcher

    connection = await asyncpg.connect(DSN)
    try:
        driver = AsyncpgDriver(connection)
        queries = Queries(driver)
        out = []
        async with CompletionWatcher(driver, queries=queries) as watcher:
            for _ in range(runs):
                t0 = time.perf_counter()
                [job_id] = await queries.enqueue("noop", None)
                await asyncio.wait_for(watcher.wait_for(job_id), 30)
                out.append((time.perf_counter() - t0) * 1000)
        return out
    finally:
        await connection.close()


async def close() -> None:
    if _pool is not None:
        await _pool.close()


if __name__ == "__main__":
    import logging

    import pgqueuer

    logging.basicConfig(level=os.environ.get("BENCH_LOG_LEVEL", "WARNING"))
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    # Its best setting, measured here draining 20,000 (BENCH_BATCH and BENCH_MAX_TASKS try others):
    # batches of its concurrency up to 32 (c16: 16 gave 1,785/s against 1,030-1,268/s with its
    # default of 10; c64: 32 gave 3,197-4,200/s against 1,345/s), and no max_concurrent_tasks beside
    # the entrypoint's concurrency_limit (setting it to the concurrency halved the rate).
    batch = int(os.environ.get("BENCH_BATCH") or min(CONCURRENCY, 32))
    limit = int(os.environ.get("BENCH_MAX_TASKS") or 0)
    runner(pgqueuer.run(main, batch_size=batch, max_concurrent_tasks=limit or None))
