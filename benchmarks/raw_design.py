"""The hand-written minimum of pgflow's stream design, shared by the benchmarks that measure against it:
the chunks of every producer in a process group-committed in one multi-row INSERT per batch (two
batches in flight, each producer awaiting its batch), whose statement also sends one NOTIFY per few
hundred of the batch's stream ids. No fencing, no journal, no framework."""

from __future__ import annotations

import asyncio
import json
from typing import Any

BATCH = 5000  # chunks per statement at most


class GroupWriter:
    """``write`` returns once the chunk's batch has committed; ``run`` sends the batches.

    ``sql`` takes (stream ids, positions, values, NOTIFY payloads), the payloads being JSON lists of
    up to ``per_payload`` of the batch's stream ids."""

    def __init__(self, pool: Any, sql: str, per_payload: int) -> None:
        self._pool = pool
        self._sql = sql
        self._per_payload = per_payload
        self._pending: list[tuple[Any, int, bytes | None, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._in_flight = asyncio.Semaphore(2)

    async def write(self, sid: Any, position: int, value: bytes | None) -> None:
        done = asyncio.get_running_loop().create_future()
        self._pending.append((sid, position, value, done))
        self._wake.set()
        await done

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                await self._in_flight.acquire()
                batch = self._pending[:BATCH]
                del self._pending[:BATCH]
                asyncio.get_running_loop().create_task(self._flush(batch))

    async def _flush(self, batch: list[tuple[Any, int, bytes | None, asyncio.Future[None]]]) -> None:
        try:
            ids = sorted({b[0] for b in batch})
            payloads = [json.dumps(ids[k:k + self._per_payload]) for k in range(0, len(ids), self._per_payload)]
            async with self._pool.connection() as conn:
                await conn.execute(self._sql, ([b[0] for b in batch], [b[1] for b in batch], [b[2] for b in batch],
                                               payloads))
            for *_, done in batch:
                done.set_result(None)
        finally:
            self._in_flight.release()
