"""A small chunk rides on its stream's ping: a reader waiting at exactly its position takes it with no
query; a reader anywhere else takes the ping as a plain one and reads the table."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import pgflow
from pgflow._core.streams.pings import CARRY_AT_MOST, carrying, stream_ping

pytestmark = pytest.mark.anyio

VALUES: list[Any] = ["tok", 1, {"nested": [1.5, None, True]}, "x" * (CARRY_AT_MOST * 2), "é\n\"'", ""]


def in_step(app: pgflow.App, second_app: pgflow.App, name: str) -> tuple[Any, list[asyncio.Event]]:
    """A workflow on ``second_app``'s worker that writes each of VALUES only once the reader has taken
    the one before (so the reader waits at exactly the next position), then closes the stream."""
    taken = [asyncio.Event() for _ in VALUES]

    async def writes() -> int:
        for n, value in enumerate(VALUES):
            if n:
                await taken[n - 1].wait()
            await pgflow.write_stream_async("tokens", value)
        await taken[-1].wait()
        await pgflow.close_stream_async("tokens")
        return len(VALUES)

    second_app.workflow(name=name)(writes)
    return app.workflow(name=name)(writes), taken


async def listening(app: pgflow.App) -> None:
    while app.stats().listeners_connected == 0:
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_reader_in_step_takes_chunks_from_their_pings(app: pgflow.App, second_app: pgflow.App,
                                                              kind: str) -> None:
    wf, taken = in_step(app, second_app, f"carried.chunks.{kind}")
    await second_app.migrate_async()
    h = await wf.start_async()
    loop = asyncio.get_running_loop()
    got: list[Any] = []

    def take(value: Any) -> None:
        got.append(value)
        loop.call_soon_threadsafe(taken[len(got) - 1].set)

    async with second_app.worker():
        if kind == "async":
            async for value in h.stream_async("tokens"):
                if not got:
                    await listening(app)
                take(value)
        else:
            def read() -> None:
                for value in h.stream("tokens"):
                    if not got:
                        asyncio.run_coroutine_threadsafe(listening(app), loop).result(60)
                    take(value)

            await asyncio.to_thread(read)
        assert await h.result_async(timeout=60) == len(VALUES)
    assert got == VALUES
    stats = app.stats()
    # Every chunk after the first (which the reader's first look may find) and the close marker came
    # on its ping, except the one too big to ride on it, which was read.
    assert len(VALUES) - 1 <= stats.chunks_from_pings <= len(VALUES)
    assert stats.fetch_queries <= 4


async def test_a_carried_chunk_is_taken_only_at_the_readers_position(dsn: str, schema: str) -> None:
    """Pings handed to a reader of a real stream: one for a chunk it has is ignored, one ahead of it
    makes it read the table, one at its position is taken as it came. (No poll tick comes meanwhile:
    every read below is one a ping caused.)"""
    async with pgflow.App(dsn, schema=schema, poll_interval=600) as app:
        await _handed_at_position(app)


async def _handed_at_position(app: pgflow.App) -> None:
    written, done = asyncio.Event(), asyncio.Event()

    @app.workflow(name="carried.six")
    async def six() -> None:
        for n in range(6):
            await pgflow.write_stream_async("tokens", n)
        written.set()
        await done.wait()

    runtime = app._client.runtime()
    h = await six.start_async()
    ping = stream_ping(h.id, "tokens")
    async with app.worker():
        await written.wait()  # the reader finds all six in its first look, and no ping is left to come
        stream = h.stream_items_async("tokens")
        got = [await anext(stream)]
        while len(got) < 6:
            got.append(await anext(stream))
        assert got == [(n, n) for n in range(6)]
        reading = asyncio.create_task(anext(stream))  # waits for position 6
        queries = runtime.fetcher.queries

        runtime.waiters.wake([carrying(ping, 2, b"\xa3old")])  # behind it: nothing happens
        await asyncio.sleep(0.05)
        assert not reading.done() and runtime.fetcher.queries == queries
        runtime.waiters.wake([carrying(ping, 8, b"\xa5ahead")])  # ahead of it: it reads, finds nothing
        while runtime.fetcher.queries == queries:
            await asyncio.sleep(0.01)
        assert not reading.done()
        runtime.waiters.wake([carrying(ping, 6, b"\xa6handed")])  # at its position: taken as it came
        assert await asyncio.wait_for(reading, 10) == (6, "handed")
        assert runtime.fetcher.handed == 1

        reading = asyncio.create_task(anext(stream))
        queries = runtime.fetcher.queries
        runtime.waiters.wake(["c:7:not base64!:" + ping])  # a value that does not decode: a plain ping
        while runtime.fetcher.queries == queries:
            await asyncio.sleep(0.01)
        assert not reading.done() and runtime.fetcher.handed == 1
        done.set()
        with pytest.raises(StopAsyncIteration):  # the workflow ended: so does its stream
            await asyncio.wait_for(reading, 10)
