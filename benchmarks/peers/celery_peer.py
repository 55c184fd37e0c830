"""Celery with Redis as broker and result backend: ``task.delay``, ``AsyncResult.get``, ``celery worker``
with the threads pool (the one-process pool that runs 16 tasks at once; prefork would be 16 processes)."""

from __future__ import annotations

import os
import threading
import time

from celery import Celery

REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/11")

app = Celery("bench", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(worker_hijack_root_logger=False, broker_connection_retry_on_startup=True)


@app.task(name="noop")
def noop() -> None:
    return None


async def setup() -> None:
    return None


async def enqueue(n: int, callers: int) -> float:
    """``callers`` threads (Celery's client is blocking) each calling ``delay()`` until ``n`` are sent."""
    lock, left = threading.Lock(), [n]
    errors: list[BaseException] = []

    def caller() -> None:
        try:
            while True:
                with lock:
                    if left[0] <= 0:
                        return
                    left[0] -= 1
                noop.delay()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=caller) for _ in range(callers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


async def latency(runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        noop.delay().get(timeout=30)
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def close() -> None:
    return None
