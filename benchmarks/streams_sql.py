"""The designs of streams.py written by hand in SQL, on one table of chunks in the run's schema.

  raw    the ceiling pgflow is measured against: the chunks of all producers group-committed
         (raw_design.GroupWriter), one NOTIFY per batch naming its streams; the reader answers every wake
         with one shared query for all the pinged streams.
  naive  one transaction per chunk, INSERT + pg_notify in one statement, over a pool of NAIVE_POOL; the
         reader runs one query per notified stream.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from benchmarks.streams_roles import Reads, Tally, emit, gather_all, stream_id

NAIVE_POOL = 32
PAGE = 1000  # chunks per stream per fetch of the raw reader

Write = Callable[[str, int, "bytes | None"], Awaitable[None]]
# Given the writer's pool: how one chunk is written, and the coroutines to run beside the producers.
Writing = Callable[[Any], tuple[Write, list[Coroutine[Any, Any, None]]]]


def names(schema: str) -> tuple[str, str]:
    """The chunks' table and the channel their pings go on."""
    return f'"{schema}".streams', f"{schema}_chunks"


async def setup(dsn: str, schema: str) -> None:
    import psycopg

    table, _ = names(schema)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await conn.execute(f'CREATE SCHEMA "{schema}"')
        await conn.execute(
            f"CREATE TABLE {table} (stream_id text NOT NULL, position integer NOT NULL, value bytea,"
            " PRIMARY KEY (stream_id, position))"
        )


async def write_streams(a: argparse.Namespace, pool_size: int, writing: Writing) -> None:
    """The writer of both designs: a pool, and a producer per stream writing (id, position, value)
    chunks, the producers released together at the go; only how a chunk is written differs."""
    import msgspec
    from psycopg_pool import AsyncConnectionPool

    tally, go = Tally(), asyncio.Event()
    async with AsyncConnectionPool(a.dsn, min_size=pool_size, max_size=pool_size, open=False,
                                   kwargs={"autocommit": True}) as pool:
        await pool.open(wait=True, timeout=30)
        write, batching = writing(pool)

        def producer(sid: str) -> Coroutine[Any, Any, None]:
            return tally.produce(a.chunks, lambda v: write(sid, v[1], msgspec.json.encode(v)),
                                 lambda: write(sid, a.chunks, None), go)

        tasks = [asyncio.create_task(producer(stream_id(a.run, i))) for i in range(a.streams)]
        background = [asyncio.create_task(b) for b in batching]
        cpu, t_go = await tally.released(a.streams, go, lambda: gather_all(tasks))
        for b in background:
            b.cancel()
        emit("result", **tally.result(a.streams * a.chunks, cpu, t_go))


async def naive_writer(a: argparse.Namespace) -> None:
    table, channel = names(a.schema)
    sql = (f"WITH w AS (INSERT INTO {table} (stream_id, position, value) VALUES (%s, %s, %s)"
           " RETURNING stream_id) SELECT pg_notify(%s, stream_id) FROM w")

    def writing(pool: Any) -> tuple[Write, list[Coroutine[Any, Any, None]]]:
        async def write(sid: str, position: int, value: bytes | None) -> None:
            async with pool.connection() as conn:
                await conn.execute(sql, (sid, position, value, channel))

        return write, []

    await write_streams(a, NAIVE_POOL, writing)


async def raw_writer(a: argparse.Namespace) -> None:
    from benchmarks.raw_design import GroupWriter

    table, channel = names(a.schema)
    sql = (f"WITH w AS (INSERT INTO {table} (stream_id, position, value)"
           " SELECT * FROM unnest(%b::text[], %b::int[], %b::bytea[]) RETURNING 1)"
           f" SELECT pg_notify('{channel}', p) FROM unnest(%s::text[]) AS p WHERE (SELECT count(*) FROM w) > 0")

    def writing(pool: Any) -> tuple[Write, list[Coroutine[Any, Any, None]]]:
        writer = GroupWriter(pool, sql, per_payload=200)
        return writer.write, [writer.run()]

    await write_streams(a, 2, writing)


async def naive_reader(a: argparse.Namespace) -> None:
    import msgspec
    import psycopg
    from psycopg_pool import AsyncConnectionPool

    table, channel = names(a.schema)
    reads = Reads(a.streams, a.chunks)
    ids = [stream_id(a.run, i) for i in range(a.streams)]
    events = {sid: asyncio.Event() for sid in ids}
    sql = f"SELECT position, value FROM {table} WHERE stream_id = %s AND position >= %s ORDER BY position"

    async def consume(pool: Any, i: int) -> None:
        sid, event, offset = ids[i], events[ids[i]], 0
        while True:
            event.clear()  # before the query: a notification during it makes us query again
            async with pool.connection() as conn:
                rows = await (await conn.execute(sql, (sid, offset))).fetchall()
            for position, value in rows:
                if value is None:
                    reads.end(i)
                    return
                reads.chunk(i, msgspec.json.decode(value))
                offset = position + 1
            with contextlib.suppress(TimeoutError):  # the slow poll, in case a notification is lost
                await asyncio.wait_for(event.wait(), 1.0)

    async with await psycopg.AsyncConnection.connect(a.dsn, autocommit=True) as listen, \
            AsyncConnectionPool(a.dsn, min_size=10, max_size=10, open=False, kwargs={"autocommit": True}) as pool:
        await listen.execute(f'LISTEN "{channel}"')
        await pool.open(wait=True, timeout=30)
        listening = asyncio.create_task(wake_on(listen, lambda payload: [payload], events.get))
        try:
            emit("result", **await reads.follow([consume(pool, i) for i in range(a.streams)]))
        finally:
            listening.cancel()


async def wake_on(listen: Any, stream_ids: Callable[[str], list[str]],
                  wake: Callable[[str], asyncio.Event | None]) -> None:
    """Each notification's stream ids (``stream_ids(payload)``) woken by ``wake(id)`` (an Event, or None)."""
    async for note in listen.notifies():
        for sid in stream_ids(note.payload):
            event = wake(sid)
            if event is not None:
                event.set()


async def raw_reader(a: argparse.Namespace) -> None:
    import psycopg

    table, channel = names(a.schema)
    reads = Reads(a.streams, a.chunks)
    ids = [stream_id(a.run, i) for i in range(a.streams)]
    index = {sid: i for i, sid in enumerate(ids)}
    dirty: set[int] = set(range(a.streams))
    wake = asyncio.Event()

    def pinged(sid: str) -> asyncio.Event | None:
        if sid not in index:
            return None
        dirty.add(index[sid])
        return wake

    async with await psycopg.AsyncConnection.connect(a.dsn, autocommit=True) as listen, \
            await psycopg.AsyncConnection.connect(a.dsn, autocommit=True) as query:
        await listen.execute(f'LISTEN "{channel}"')
        listening = asyncio.create_task(wake_on(listen, json.loads, pinged))
        try:
            emit("result", **await reads.follow([raw_fetcher(query, table, ids, reads, dirty, wake)]))
        finally:
            listening.cancel()


async def raw_fetcher(query: Any, table: str, ids: list[str], reads: Reads, dirty: set[int],
                      wake: asyncio.Event) -> None:
    """On every wake, one query for the next page of every pinged stream still open (every open one on
    the slow poll); a stream that filled its page is asked again at once."""
    import msgspec

    fetch = (f"SELECT r.i, c.position, c.value FROM unnest(%b::text[], %b::int[]) WITH ORDINALITY"
             f" AS r(sid, start, i) JOIN LATERAL (SELECT position, value FROM {table}"
             f" WHERE stream_id = r.sid AND position >= r.start ORDER BY position LIMIT {PAGE}) c ON true"
             " ORDER BY r.i, c.position")
    offsets = [0] * len(ids)
    open_streams = set(range(len(ids)))
    while open_streams:
        with contextlib.suppress(TimeoutError):  # the slow poll, in case a notification is lost
            await asyncio.wait_for(wake.wait(), 1.0)
        wake.clear()
        asked = sorted((dirty or open_streams) & open_streams)
        dirty.clear()
        if not asked:
            continue
        cur = await query.execute(fetch, ([ids[i] for i in asked], [offsets[i] for i in asked]), binary=True)
        got = [0] * len(asked)
        for ordinal, position, value in await cur.fetchall():
            i = asked[ordinal - 1]
            got[ordinal - 1] += 1
            if value is None:
                reads.end(i)
                open_streams.discard(i)
                continue
            reads.chunk(i, msgspec.json.decode(value))
            offsets[i] = position + 1
        again = [asked[k] for k, n in enumerate(got) if n == PAGE]
        if again:  # more than one page waits: look again at once
            dirty.update(again)
            wake.set()
