"""Stream news has a channel of its own, which a loop listens on only while it waits for a stream: a
worker whose workflows read no stream receives none of the fleet's chunks, and a loop that begins to
wait for a stream while its listener is already connected (a worker's, which listens for queue
pings) starts listening on the stream channel at once, and stops once none has been waited for in
``listen_idle`` seconds.

Each App here is a process of its own as far as the channel goes (its own sender, listener and
waiters), with a poll of 60 s: what reaches a reader in time came by a ping."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest

import pgflow
from pgflow._core.signals import keys as signal_keys
from pgflow._core.signals.listener import Listener

from .helpers import CountedWaiter, wait_for
from .streaming import PING_WAIT, SLOW_POLL, WAIT, other_app

pytestmark = pytest.mark.anyio

CHUNKS = 200


def _listener(app: pgflow.App) -> Listener:
    listener = app._client.runtime().signals.listener
    assert listener is not None
    return listener


def _listening_to_streams(app: pgflow.App) -> bool:
    """Whether ``app``'s loop listens on the stream channel (False before its store is open)."""
    listener = app._client.runtime().signals.listener
    return listener is not None and listener.streams


async def _until(check: Callable[[], bool]) -> None:
    async def look() -> bool:
        return check()
    await wait_for(look, timeout=WAIT)


async def _take(items: AsyncIterator[object], n: int) -> list[object]:
    return [await anext(items) for _ in range(n)]


def _streaming_app(dsn: str, schema: str, go: asyncio.Event, done: asyncio.Event) -> tuple[pgflow.App, Any]:
    """An App whose ``channel.tokens`` workflow writes CHUNKS chunks once ``go`` is set."""
    app = other_app(dsn, schema, poll_interval=SLOW_POLL)

    @app.workflow(name="channel.tokens")
    async def tokens() -> int:
        await go.wait()
        for i in range(CHUNKS):
            await pgflow.write_stream_async("tokens", i)
        await done.wait()
        return CHUNKS

    return app, tokens


async def test_a_worker_that_reads_no_stream_hears_nothing_of_anothers_chunks(dsn: str, schema: str) -> None:
    go, done = asyncio.Event(), asyncio.Event()
    writer, tokens = _streaming_app(dsn, schema, go, done)
    reader = other_app(dsn, schema, poll_interval=SLOW_POLL)
    bystander = other_app(dsn, schema, poll_interval=SLOW_POLL)  # a worker of another queue
    try:
        h = await tokens.start_async()
        async with writer.worker(), bystander.worker(queues=["elsewhere"]):
            await _until(lambda: _listener(bystander).connected)
            items = reader.handle(h.id).stream_async("tokens")
            first = asyncio.create_task(_take(items, 1))
            await _until(lambda: _listening_to_streams(reader))
            heard = _listener(bystander).heard
            go.set()
            got = await first + await asyncio.wait_for(_take(items, CHUNKS - 1), PING_WAIT)
            assert got == list(range(CHUNKS))
            # The chunks came carried by the news, and the bystander heard none of it.
            assert reader.stats().chunks_from_pings > 0
            assert not _listener(bystander).streams
            assert _listener(bystander).heard == heard
            done.set()
            assert await h.result_async(timeout=WAIT) == CHUNKS
    finally:
        for app in (writer, reader, bystander):
            await app.close_async()


async def test_a_connected_listener_starts_listening_to_streams_when_a_stream_is_waited_for(
        dsn: str, schema: str) -> None:
    go, done = asyncio.Event(), asyncio.Event()
    writer, tokens = _streaming_app(dsn, schema, go, done)
    follower = other_app(dsn, schema, poll_interval=SLOW_POLL)  # a worker's loop that also reads
    try:
        h = await tokens.start_async()
        async with writer.worker(), follower.worker(queues=["elsewhere"]):
            listener = _listener(follower)
            await _until(lambda: listener.connected)
            assert not listener.streams  # its worker waits for queue pings only
            items = follower.handle(h.id).stream_async("tokens")
            first = asyncio.create_task(_take(items, 1))
            # At once, on the same connection: not at the end of the wait for notifications the
            # listener began when it connected (5 s, its longest), nor by reconnecting.
            with anyio.fail_after(3):
                await _until(lambda: listener.streams)
            assert listener.reconnects == 0
            go.set()
            got = await asyncio.wait_for(first, PING_WAIT) + await asyncio.wait_for(
                _take(items, CHUNKS - 1), PING_WAIT)
            assert got == list(range(CHUNKS))
            done.set()
            assert await h.result_async(timeout=WAIT) == CHUNKS
    finally:
        for app in (writer, follower):
            await app.close_async()


async def test_a_listener_wakes_stream_waiters_once_it_listens_and_stops_when_none_is_left(
        dsn: str, schema: str) -> None:
    """A waiter that began before the LISTEN is woken once it is done (news sent in between passed this
    loop by); ``listen_idle`` after the last stream wait the listener leaves the stream channel, on
    the same connection, and comes back (waking again) when a stream is waited for again."""
    app = other_app(dsn, schema, poll_interval=SLOW_POLL, listen_idle=0.3)
    try:
        await app.migrate_async()
        waiters = app._client.runtime().signals.waiters
        stream_key = signal_keys.stream("some-workflow", "tokens")
        with waiters.watching([signal_keys.queue("default")]):  # keeps the listener connected
            await _until(lambda: _listener(app).connected)
            listener = _listener(app)
            for round_ in range(2):
                woken = CountedWaiter()
                waiters.add(stream_key, woken)
                await _until(lambda: listener.streams)
                assert woken.times >= 1, round_
                waiters.remove(stream_key, woken)
                await _until(lambda: not listener.streams)
            assert listener.connected and listener.reconnects == 0
    finally:
        await app.close_async()
