"""DBOS Transact: a DBOS queue served by a launched DBOS process (``python -m benchmarks.peers.dbos_peer``),
``DBOSClient.enqueue_async`` and ``handle.get_result`` from the client.

DBOS's queue is polled, never notified: a worker dequeues at most ``worker_concurrency`` minus its running
workflows every ``polling_interval_sec`` (1 s by default), so its defaults drain at about
concurrency / interval (16/s), and a client's ``get_result`` polls every second. The settings below are the
best found by the sweep in benchmarks/README.md, and can be changed through the environment.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from typing import Any

import sqlalchemy as sa

DSN = os.environ.get("BENCH_DSN", "")
CONCURRENCY = int(os.environ.get("BENCH_CONCURRENCY", "16"))
POOL = int(os.environ.get("BENCH_POOL", "16"))
QUEUE_POLL = float(os.environ.get("BENCH_DBOS_QUEUE_POLL", "0.001"))
# The queue's worker_concurrency: the run's concurrency unless BENCH_DBOS_WORKER_CONCURRENCY says (a number,
# or "none" for no per-worker limit).
_WC = os.environ.get("BENCH_DBOS_WORKER_CONCURRENCY", str(CONCURRENCY))
WORKER_CONCURRENCY = None if _WC.lower() == "none" else int(_WC)
RESULT_POLL = float(os.environ.get("BENCH_DBOS_RESULT_POLL", "0.005"))
QUEUE = "bench"
WORKFLOW = "noop"


def url() -> str:
    return sa.make_url(DSN).set(drivername="postgresql").render_as_string(hide_password=False)


def config() -> Any:
    return {"name": "pgflow-bench", "system_database_url": url(),
            "log_level": os.environ.get("BENCH_LOG_LEVEL", "WARNING"), "sys_db_pool_size": max(20, CONCURRENCY + 4)}


def serve() -> None:
    """The worker process: launch DBOS with the queue and the workflow, run until SIGTERM."""
    from dbos import DBOS

    DBOS(config=config())

    @DBOS.workflow(name=WORKFLOW)
    async def noop() -> None:
        return None

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    DBOS.launch()
    # DBOS 3.4 persists a queue's configuration in its system database, so it is registered once launched.
    DBOS.register_queue(QUEUE, worker_concurrency=WORKER_CONCURRENCY, polling_interval_sec=QUEUE_POLL)
    try:
        stop.wait()
    finally:
        DBOS.destroy(workflow_completion_timeout_sec=0)


_client: Any = None


def _get_client() -> Any:
    global _client
    if _client is None:
        from dbos import DBOSClient

        _client = DBOSClient(system_database_url=url(), system_database_pool_size=POOL)
    return _client


async def setup() -> None:
    """DBOS's client never migrates: launch DBOS once (no queue registered) to create its tables."""
    from dbos import DBOS

    def migrate() -> None:
        DBOS(config=config())
        DBOS.launch()
        DBOS.destroy(workflow_completion_timeout_sec=0)

    await asyncio.to_thread(migrate)


async def enqueue(n: int, callers: int) -> float:
    from concurrent.futures import ThreadPoolExecutor

    # enqueue_async runs the blocking enqueue in the loop's default executor (6 threads on 2 cores):
    # give it one thread per caller.
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max(callers, 4)))
    client = _get_client()
    options: Any = {"queue_name": QUEUE, "workflow_name": WORKFLOW}
    left = [n]

    async def caller() -> None:
        while left[0] > 0:
            left[0] -= 1
            await client.enqueue_async(options)

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    return time.perf_counter() - t0


async def latency(runs: int) -> list[float]:
    client = _get_client()
    options: Any = {"queue_name": QUEUE, "workflow_name": WORKFLOW}
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        handle = await client.enqueue_async(options)
        await asyncio.wait_for(handle.get_result(polling_interval_sec=RESULT_POLL), 30)
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def close() -> None:
    if _client is not None:
        await asyncio.to_thread(_client.destroy)


if __name__ == "__main__":
    serve()
    sys.exit(0)
