"""Streams woken by pings and by the poll: a reader in another App, with pings off, the notifier losing
its connection, an overlong key.

Where a test needs a reader that depends on pings or on the poll alone, it reads through a second App on
the same schema: each App has its own waiters, listener and poll, and a poll of 60 s where a test must
show that pings (not the poll) delivered.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

import anyio
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import pgflow
from pgflow._core.signals import News
from pgflow._core.signals import keys as signal_keys
from pgflow._core.signals.notifier import Notifier, Refusals

from .channel import listen, named, opened, seal
from .streaming import (
    KINDS,
    PING_WAIT,
    SLOW_POLL,
    WAIT,
    consume,
    gate_async,
    other_app,
    read_sync,
    read_while_run,
    wait_until,
)

pytestmark = pytest.mark.anyio



# -- 4 and 5. pings and the poll ----------------------------------------------------------------------------


async def test_with_notify_off_a_reader_in_another_app_gets_every_chunk_by_the_poll(
    dsn: str, schema: str,
) -> None:
    # The writer sends no NOTIFY at all: a reader in another App learns of new chunks only by its poll.
    half = threading.Event()
    async with other_app(dsn, schema, notify="off", poll_interval=0.2) as writer, \
            other_app(dsn, schema, poll_interval=0.2) as reader_app:

        @writer.workflow
        async def hundred() -> int:
            for i in range(100):
                if i == 50:
                    await gate_async(half)
                await pgflow.write_stream_async("s", i)
            await pgflow.close_stream_async("s")
            return 100

        h = await hundred.start_async()
        theirs = reader_app.handle(h.id)
        got: dict[str, list[Any]] = {}
        progress: list[Any] = []

        async def async_reader() -> None:
            async for value in theirs.stream_async("s"):
                progress.append(value)
            got["async"] = progress

        async def sync_reader() -> None:
            got["sync"] = await read_sync(theirs, "s")

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(async_reader)
                tg.start_soon(sync_reader)
                async with writer.worker(concurrency=2):
                    # The readers wait mid-stream on the poll while the writer is held.
                    await wait_until(lambda: len(progress) == 50, "the first half")
                    half.set()
                    assert await h.result_async(timeout=WAIT) == 100
        assert writer.stats().notify_flushes == 0
    assert got == {"async": list(range(100)), "sync": list(range(100))}


@pytest.mark.parametrize("kind", KINDS)
async def test_with_notify_off_readers_in_the_writing_app_are_woken_directly(
    dsn: str, schema: str, kind: str,
) -> None:
    # A slow poll: the reader would take minutes if only the poll woke it between chunks.
    async with other_app(dsn, schema, notify="off", poll_interval=SLOW_POLL) as app:

        @app.workflow
        async def trickle(n: int) -> int:
            for i in range(n):
                await anyio.sleep(0.01)  # the reader catches up and waits before each chunk
                await pgflow.write_stream_async("s", i)
            await pgflow.close_stream_async("s")
            return n

        h = await trickle.start_async(30)
        got = await read_while_run(app, kind, h, "s", result=30, timeout=PING_WAIT)
        assert got == list(range(30))


@pytest.mark.parametrize("kind", KINDS)
async def test_a_second_app_in_the_same_process_is_woken_by_the_first_apps_pings(
    dsn: str, schema: str, kind: str,
) -> None:
    # The reading App polls every 60 s; everything must arrive well before that, by pings through its
    # own listener (in-process wakes reach only the writing App's own waiters).
    release = threading.Event()
    async with other_app(dsn, schema, poll_interval=0.5) as writer, \
            other_app(dsn, schema, poll_interval=SLOW_POLL) as reader_app:

        @writer.workflow
        async def gated(n: int) -> int:
            for i in range(n):
                if i == n // 2:
                    await gate_async(release)
                await pgflow.write_stream_async("s", i)
            await pgflow.close_stream_async("s")
            return n

        try:
            with anyio.fail_after(PING_WAIT):
                async with writer.worker(concurrency=2):
                    h = await gated.start_async(10)
                    theirs = reader_app.handle(h.id)
                    got: list[Any] = []
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(consume, kind, theirs, "s", got)
                        await wait_until(lambda: len(got) == 5, "the chunks before the gate")
                        release.set()  # the reader now waits for chunk 5
                    assert await theirs.result_async(timeout=PING_WAIT) == 10
            assert got == list(range(10))
        finally:
            release.set()


async def _received(app: pgflow.App, conn: psycopg.AsyncConnection[Any], timeout: float) -> list[str]:
    """Keys of every notification that arrives within ``timeout`` seconds, opened with ``app``'s keys."""
    keys: list[str] = []
    async for note in conn.notifies(timeout=timeout):
        news = opened(app, note)
        assert news is not None
        keys.extend(named(news))
    return keys


@contextlib.asynccontextmanager
async def notifier_on_pool(app: pgflow.App, dsn: str, schema: str,
                           interval: float) -> AsyncIterator[tuple[Notifier, Any]]:
    """The runtime's notifier component, sending through a real pool of one connection and sealing
    with ``app``'s keys."""
    await app.migrate_async()  # (and the keyring loaded)
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(dsn, min_size=1, max_size=1, open=False,
                                                         kwargs={"autocommit": True})
    await pool.open(wait=True)

    async def the_pool() -> AsyncConnectionPool[Any]:
        return pool

    notifier = Notifier(the_pool, interval, lambda news: seal(app, news), Refusals())
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(notifier.run)
            yield notifier, pool
            tg.cancel_scope.cancel()
    finally:
        await pool.close()


async def test_a_flush_without_a_connection_is_logged_and_dropped_and_the_next_one_goes_out(
    app: pgflow.App, dsn: str, schema: str, caplog: pytest.LogCaptureFixture,
) -> None:
    # The pool holds one connection, which the test keeps busy in a real query (no mocks), so the
    # notifier's flush cannot get a connection within its timeout.
    listener = await listen(dsn, schema)

    async def flushed(counts: tuple[int, int]) -> None:
        with anyio.fail_after(WAIT):
            while (notifier.flushes, notifier.failed_flushes) != counts:
                await anyio.sleep(0.02)

    try:
        async with notifier_on_pool(app, dsn, schema, 0.005) as (notifier, pool):
            held, release = anyio.Event(), anyio.Event()

            async def hold() -> None:
                async with pool.connection() as conn:
                    await conn.execute("SELECT 1")
                    held.set()
                    await release.wait()

            async with anyio.create_task_group() as tg:
                tg.start_soon(hold)
                await held.wait()
                with caplog.at_level(logging.WARNING, logger="pgflow.signals"):
                    notifier.add(News(["s:lost:a", "s:lost:b"]))
                    await flushed((0, 1))  # the notifier's own flush failed, and it goes on
                release.set()
            assert (notifier.flushes, notifier.failed_flushes) == (0, 1)
            assert any("dropped 2 pings" in r.getMessage() for r in caplog.records), caplog.text

            # The connection is free again; the dropped pings are gone, the new ones go out.
            notifier.add(News(["s:kept:c"]))
            await flushed((1, 1))
            assert (notifier.flushes, notifier.failed_flushes) == (1, 1)
            assert await _received(app, listener, timeout=1.0) == ["s:kept:c"]
    finally:
        await listener.close()


async def test_one_overlong_key_does_not_drop_the_other_pings_of_its_flush(app: pgflow.App, dsn: str,
                                                                            schema: str) -> None:
    listener = await listen(dsn, schema)
    try:
        async with notifier_on_pool(app, dsn, schema, 3600) as (notifier, _):
            # (both on the main channel: it is one payload's keys that are at stake)
            notifier.add(News([signal_keys.ended("x" * 8000), signal_keys.queue("ordinary")]))
            await notifier.flush()
            assert signal_keys.queue("ordinary") in await _received(app, listener, timeout=1.0)
    finally:
        await listener.close()
