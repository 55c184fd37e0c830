"""Pings that ride on a statement's own commit: one at a time per process, the rest coalesced.

A caller that starts workflows one after another must not wait for the notifier's interval (the
no-op start-to-result latency depends on it), while many statements at once must still share one
NOTIFY transaction per interval."""

from __future__ import annotations

import asyncio
import json
import time

import psycopg
import pytest

import pgflow

pytestmark = pytest.mark.anyio

INTERVAL = 3.0  # long enough that a ping held back for the interval is plain to see


async def listen(dsn: str, schema: str) -> psycopg.AsyncConnection:
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    await conn.execute(f'LISTEN "pgflow_{schema}"')
    return conn


async def collect(conn: psycopg.AsyncConnection, seen: list[tuple[float, list[str]]], until: float) -> None:
    async for note in conn.notifies(timeout=max(0.0, until - time.monotonic())):
        seen.append((time.monotonic(), json.loads(note.payload)[1]))


def noop_app(dsn: str, schema: str) -> tuple[pgflow.App, pgflow.Workflow[[], None]]:
    app = pgflow.App(dsn, schema=schema, notify_interval=INTERVAL)

    @app.workflow(name="pings.noop")
    async def noop() -> None:
        return None

    return app, noop


async def test_sequential_starts_each_send_their_ping_at_once(dsn: str, schema: str) -> None:
    app, noop = noop_app(dsn, schema)
    try:
        await app.migrate_async()
        seen: list[tuple[float, list[str]]] = []
        conn = await listen(dsn, schema)
        async with conn:
            began = time.monotonic()
            for n in range(3):
                await noop.with_options(id=f"seq-{n}").start_async()
            # Each start committed before the next began: each carried its own ping, so all three
            # arrive long before one notifier interval has passed.
            await collect(conn, seen, began + INTERVAL * 0.8)
        pings = [at for at, keys in seen if "q:default" in keys]
        assert len(pings) == 3, seen
        assert max(pings) - began < INTERVAL * 0.8
    finally:
        await app.close_async()


async def test_concurrent_starts_share_pings(dsn: str, schema: str) -> None:
    app, noop = noop_app(dsn, schema)
    try:
        await app.migrate_async()
        seen: list[tuple[float, list[str]]] = []
        conn = await listen(dsn, schema)
        async with conn:
            began = time.monotonic()
            await asyncio.gather(*(noop.with_options(id=f"con-{n}").start_async() for n in range(20)))
            await collect(conn, seen, began + INTERVAL * 1.7)
        pings = [keys for _, keys in seen if "q:default" in keys]
        # One start carries its ping while the others are under way; theirs wait for the notifier,
        # which sends them together after its interval.
        assert 1 <= len(pings) <= 3, seen
    finally:
        await app.close_async()
