"""The pool hands out the connection returned last: under light load one warm connection serves every
checkout, and none pays the round trip of the check a long-idle connection gets (pool.py)."""

from __future__ import annotations

import anyio
import pytest

from pgflow._core.pool import Pool
from pgflow._core.registry import Config

pytestmark = pytest.mark.anyio


async def backend_pids(pool: Pool, checkouts: int) -> list[int]:
    pids = []
    for _ in range(checkouts):
        async with pool.connection() as conn:
            pids.append(conn.info.backend_pid)
    return pids


async def test_sequential_checkouts_reuse_the_connection_returned_last(dsn: str, schema: str) -> None:
    pool = Pool(Config(dsn=dsn, schema=schema, pool_size=4))
    await pool.open(wait=True)
    try:
        held = anyio.Event()
        opened: list[int] = []

        async def hold() -> None:  # three checkouts at once: the pool grows to three connections
            async with pool.connection() as conn:
                opened.append(conn.info.backend_pid)
                if len(opened) == 3:
                    held.set()
                await held.wait()

        async with anyio.create_task_group() as group:
            for _ in range(3):
                group.start_soon(hold)
        assert len(set(opened)) == 3
        first, *rest = await backend_pids(pool, 6)
        # Oldest first (psycopg_pool's own order) would go round all three.
        assert rest == [first] * 5, (first, rest)
        # The idle ones are still there for a burst.
        assert pool.get_stats()["pool_available"] == 3
    finally:
        await pool.close()
