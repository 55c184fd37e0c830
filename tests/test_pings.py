"""Pings that ride on a statement's own commit: one at a time per process, the rest coalesced.

A caller that starts workflows one after another must not wait for the notifier's interval (the
no-op start-to-result latency depends on it), while many statements at once must still share one
NOTIFY transaction per interval."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import psycopg
import pytest

import pgflow
from pgflow._core.signals import keys as signal_keys

from .channel import listen, named, opened

pytestmark = pytest.mark.anyio

INTERVAL = 2.0  # long enough that a ping held back for the interval is plain to see


async def collect(app: pgflow.App, conn: psycopg.AsyncConnection, seen: list[tuple[float, list[str]]],
                  until: float) -> None:
    async for note in conn.notifies(timeout=max(0.0, until - time.monotonic())):
        news = opened(app, note)
        assert news is not None, "a payload of pgflow's that does not open"
        seen.append((time.monotonic(), named(news)))


def noop_app(dsn: str, schema: str) -> tuple[pgflow.App, pgflow.Workflow[[], None]]:
    app = pgflow.App(dsn, schema=schema, notify_interval=INTERVAL)

    @app.workflow(name="pings.noop")
    async def noop() -> None:
        return None

    return app, noop


async def queue_pings(dsn: str, schema: str, start: Callable[[pgflow.Workflow[[], None]], Awaitable[object]],
                      within: float) -> tuple[float, list[float]]:
    """Run ``start`` with a no-op workflow of an App whose notifier interval is ``INTERVAL``, and
    return when it began and when each NOTIFY naming the queue arrived within ``within`` seconds."""
    app, noop = noop_app(dsn, schema)
    try:
        await app.migrate_async()
        seen: list[tuple[float, list[str]]] = []
        conn = await listen(dsn, schema)
        async with conn:
            began = time.monotonic()
            await start(noop)
            await collect(app, conn, seen, began + within)
        return began, [at for at, keys in seen if signal_keys.queue("default") in keys]
    finally:
        await app.close_async()


async def test_sequential_starts_each_send_their_ping_at_once(dsn: str, schema: str) -> None:
    async def one_after_another(noop: pgflow.Workflow[[], None]) -> None:
        for n in range(3):
            await noop.with_options(id=f"seq-{n}").start_async()

    began, pings = await queue_pings(dsn, schema, one_after_another, INTERVAL * 0.8)
    # Each start committed before the next began: each carried its own ping, so all three arrive
    # long before one notifier interval has passed.
    assert len(pings) == 3, pings
    assert max(pings) - began < INTERVAL * 0.8


async def test_concurrent_starts_share_pings(dsn: str, schema: str) -> None:
    async def all_at_once(noop: pgflow.Workflow[[], None]) -> None:
        await asyncio.gather(*(noop.with_options(id=f"con-{n}").start_async() for n in range(20)))

    _, pings = await queue_pings(dsn, schema, all_at_once, INTERVAL * 1.7)
    # One start carries its ping while the others are under way; theirs wait for the notifier,
    # which sends them together after its interval.
    assert 1 <= len(pings) <= 3, pings
