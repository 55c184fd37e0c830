"""A small chunk rides with its stream's news: a reader waiting at exactly its position takes it with
no query; a reader anywhere else takes the news as a plain ping and reads the table."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

import pgflow
from pgflow._core.engine import Pings
from pgflow._core.signals import Chunk, News
from pgflow._core.signals import keys as signal_keys
from pgflow._core.signals.payload import CARRY_CHUNK_AT_MOST

from .helpers import wait_for

pytestmark = pytest.mark.anyio

VALUES: list[Any] = ["tok", 1, {"nested": [1.5, None, True]}, "x" * (CARRY_CHUNK_AT_MOST * 2), "é\n\"'", ""]


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
    """Until the listener listens and the read its connection caused (it wakes every reader, since
    pings sent before it listened are gone) is over: news that came during that read would make
    the reader read instead of taking the chunk, on a loaded machine."""
    fetcher = app._client.runtime().fetcher
    while app.stats().listeners_connected == 0 or fetcher._busy:
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_reader_in_step_takes_chunks_from_their_pings(dsn: str, schema: str, kind: str) -> None:
    # Two Apps, as two processes would be (one's pings are foreign to the other), with no poll tick to
    # find a chunk before its ping does.
    async with pgflow.App(dsn, schema=schema, poll_interval=600) as app, \
            pgflow.App(dsn, schema=schema, poll_interval=600) as second_app:
        await _in_step(app, second_app, kind)


async def _in_step(app: pgflow.App, second_app: pgflow.App, kind: str) -> None:
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
    if kind == "async":
        # The reader waits again before the writer is let go: every chunk after the first (which its
        # first look may find) and the close marker came on its ping, except the one too big to ride
        # on it, which was read.
        assert len(VALUES) - 1 <= stats.chunks_from_pings <= len(VALUES)
        assert stats.fetch_queries <= 4
    else:
        # A sync reader lets the writer go while its thread still holds the chunk before: a ping that
        # comes before it asks for the next one makes it read instead.
        assert 1 <= stats.chunks_from_pings <= len(VALUES)


async def test_a_carried_chunk_is_taken_only_at_the_readers_position(dsn: str, schema: str) -> None:
    """News handed to a reader of a real stream: a chunk it has is ignored, one ahead of it makes it
    read the table, one of another stream id (a pruned workflow's stream of the same name) too, and
    one at its position is taken as it came. (No poll tick comes meanwhile: every read below is one
    the news caused.)"""
    async with pgflow.App(dsn, schema=schema, poll_interval=600) as app:
        await _handed_at_position(app, dsn, schema)


async def _handed_at_position(app: pgflow.App, dsn: str, schema: str) -> None:
    written, done = asyncio.Event(), asyncio.Event()

    @app.workflow(name="carried.six")
    async def six() -> None:
        for n in range(6):
            await pgflow.write_stream_async("b:tokens", n)
        written.set()
        await done.wait()

    runtime = app._client.runtime()
    h = await six.with_options(id="carried-six").start_async()
    stream = signal_keys.stream(h.id, "b:tokens")

    def hand(sid: int, position: int, value: bytes) -> None:
        runtime.signals.waiters.hear(News(chunks=[Chunk(stream, sid, position, value)]))

    async with app.worker():
        # The loop's listener LISTENs on the stream channel once a stream is waited for, and that
        # wakes every waiter (pings sent before passed it by): it does so here, before the reader
        # whose every read is counted below begins.
        listener = runtime.signals.listener
        assert listener is not None
        with runtime.signals.waiters.watching([signal_keys.stream("another", "stream")]):
            await wait_for(lambda: _true(listener.streams))
        await written.wait()  # the reader finds all six in its first look, and no news is left to come
        items = h.stream_items_async("b:tokens")
        got = [await anext(items)]
        while len(got) < 6:
            got.append(await anext(items))
        assert got == [(n, n) for n in range(6)]
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            cur = await conn.execute(f'SELECT id FROM "{schema}".stream_ids WHERE workflow_id = %s', (h.id,))
            [(sid,)] = await cur.fetchall()
        reading = asyncio.create_task(anext(items))  # waits for position 6
        queries = runtime.fetcher.queries

        hand(sid, 2, b"\xa3old")  # behind it: nothing happens
        await asyncio.sleep(0.05)
        assert not reading.done() and runtime.fetcher.queries == queries
        hand(sid, 8, b"\xa5ahead")  # ahead of it: it reads, finds nothing
        while runtime.fetcher.queries == queries:
            await asyncio.sleep(0.01)
        assert not reading.done()
        queries = runtime.fetcher.queries
        hand(sid + 1000, 6, b"\xa5other")  # the chunk of another stream of that name: not ours
        while runtime.fetcher.queries == queries:
            await asyncio.sleep(0.01)
        assert not reading.done()
        hand(sid, 6, b"\xa6handed")  # at its position: taken as it came
        assert await asyncio.wait_for(reading, 10) == (6, "handed")
        assert runtime.fetcher.handed == 1
        done.set()
        with pytest.raises(StopAsyncIteration):  # the workflow ended: so does its stream
            await asyncio.wait_for(anext(items), 10)


async def _true(value: bool) -> bool:
    return value


async def test_a_fenced_batch_sends_no_carried_chunk(app: pgflow.App, dsn: str, schema: str) -> None:
    """A batch with a chunk whose writer no longer holds its workflow sends none of its payloads with
    its commit (they may carry a chunk that was not written; its writer names the streams plainly
    afterwards)."""
    store = await app._client.runtime().store()
    async with store.pool.connection() as conn:
        await conn.execute(f'INSERT INTO "{schema}".workflows (id, name, queue, inputs, status, lease_token)'
                           " VALUES ('fenced', 'wf', 'default', '\\xc0', 'running', 7)")
    sid = (await store.chunks.stream_ids(["fenced"], ["tokens"]))[("fenced", "tokens")]
    channel = f"pgflow_{schema}"
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as listener:
        await listener.execute(f'LISTEN "{channel}"')
        for position, lease in ((0, 8), (0, 7), (1, 8), (1, 7)):
            fenced, _, _ = await store.chunks.write_chunks([("fenced", lease)], [1], [sid], [position], [b"\x01"],
                                                 Pings([channel], [f"lease {lease} position {position}"]))
            assert fenced == ({("fenced", lease)} if lease == 8 else set())
        # Only the written batches pinged (a notification of the fenced ones would come first).
        notes = listener.notifies(timeout=10)
        try:
            assert [(await anext(notes)).payload for _ in range(2)] == ["lease 7 position 0", "lease 7 position 1"]
        finally:
            await notes.aclose()  # (it holds the connection while it is open)
    assert await store.chunks.stream_ends("fenced") == {"tokens": 2}
