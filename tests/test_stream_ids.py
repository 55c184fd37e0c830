"""Streams named by a bigint id (migration 0015): a database upgraded from the text-keyed chunks
keeps them, readable and resumable; forks and pruning carry the stream names with the chunks."""

from __future__ import annotations

from datetime import timedelta

import anyio
import pytest

import pgflow
from pgflow._core.engine import migrations

from .helpers import move_schema_clock, query

pytestmark = pytest.mark.anyio

WAIT = 60.0


@pytest.mark.new_schema  # migrated by the version before, then upgraded
async def test_an_upgraded_database_keeps_its_chunks_and_a_resumed_writer_continues_after_them(
    dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = f'"{schema}"'
    # The schema as it was before 0015, with a failed workflow whose stream holds three chunks and
    # a finished one whose stream is closed, stored the old way (without the partitioning of chunks,
    # 0022-0024, which is built on 0015's table).
    before = [m for m in migrations.available() if m.version not in (15, 22, 23, 24)]
    with monkeypatch.context() as patch:
        patch.setattr(migrations, "available", lambda: before)
        old = pgflow.App(dsn, schema=schema)
        try:
            writer = old.workflow(name="t.writer")(_writer)
            resumed = await writer.start_async(5)
            done = await writer.start_async(2)
        finally:
            await old.close_async()
    await query(dsn, f"UPDATE {s}.workflows SET status = 'failed', attempt = 1, finished_at = now()"
                     " WHERE id = %s", resumed.id)
    await query(dsn, f"UPDATE {s}.workflows SET status = 'succeeded', finished_at = now() WHERE id = %s", done.id)
    await query(dsn, f"INSERT INTO {s}.streams (workflow_id, key, position, value)"
                     " SELECT %s, 'tokens', p, ('\\x0' || p)::bytea FROM generate_series(0, 2) p", resumed.id)
    await query(dsn, f"INSERT INTO {s}.streams (workflow_id, key, position, value)"
                     " VALUES (%s, 'tokens', 0, '\\x07'), (%s, 'tokens', 1, '\\x08'), (%s, 'tokens', 2, NULL)",
                done.id, done.id, done.id)

    app = pgflow.App(dsn, schema=schema, poll_interval=0.5)
    try:
        writer = app.workflow(name="t.writer")(_writer)
        await app.migrate_async()
        assert await query(dsn, f"SELECT count(*) FROM {s}.chunks") == [(6,)]
        handle = app.handle(done.id)
        assert [v async for v in handle.stream_async("tokens")] == [7, 8]
        # Run again, the body's first three writes land where the old chunks are, so they are
        # skipped, and the stream goes on at position 3.
        resumed_handle = app.handle(resumed.id)
        await resumed_handle.resume_async()
        async with app.worker(concurrency=4):
            with anyio.fail_after(WAIT):
                assert await resumed_handle.result_async() == 5
                assert [item async for item in resumed_handle.stream_items_async("tokens")] == [
                    (0, 0), (1, 1), (2, 2), (3, 3), (4, 4)]
        assert await query(dsn, f"SELECT count(*) FROM {s}.stream_ids") == [(2,)]
    finally:
        await app.close_async()


async def _writer(n: int) -> int:
    for i in range(n):
        await pgflow.write_stream_async("tokens", i)
    await pgflow.close_stream_async("tokens")
    return n


async def test_a_fork_gets_streams_of_its_own_and_pruning_removes_them_all(app: pgflow.App) -> None:
    @app.step
    async def mark(i: int) -> int:
        await pgflow.write_stream_async("log", i)
        return i

    @app.workflow
    async def steps(n: int) -> int:
        for i in range(n):
            await mark(i)
        await pgflow.close_stream_async("log")
        return n

    s = f'"{app.schema}"'
    async with app.worker(concurrency=4):
        with anyio.fail_after(WAIT):
            first = await steps.start_async(4)
            assert await first.result_async() == 4
            fork = await first.fork_async(from_step=2)
            assert await fork.result_async() == 4
            assert [v async for v in fork.stream_async("log")] == [0, 1, 2, 3]
            assert [v async for v in first.stream_async("log")] == [0, 1, 2, 3]
    assert await query(app.dsn, f"SELECT count(DISTINCT id) FROM {s}.stream_ids") == [(2,)]
    await query(app.dsn, f"UPDATE {s}.workflows SET finished_at = finished_at - %s", timedelta(days=30))
    assert await app.prune_async(older_than=timedelta(days=7)) == 2
    # The names go at once; the chunks, unreachable now, with their partition once its day is over.
    assert await query(app.dsn, f"SELECT (SELECT count(*) FROM {s}.stream_ids), (SELECT count(*) FROM {s}.streams)") \
        == [(0, 0)]
    await move_schema_clock(app, timedelta(days=2).total_seconds())
    assert await app.prune_async(older_than=timedelta(days=7)) == 0
    assert await query(app.dsn, f"SELECT count(*) FROM {s}.chunks") == [(0,)]


async def test_packed_arrays_reach_the_server_as_the_values_they_were(dsn: str) -> None:
    from psycopg import AsyncConnection

    from pgflow._core.engine import arrays

    async with await AsyncConnection.connect(dsn, autocommit=True) as conn:
        arrays.ready(conn)
        cur = await conn.execute(
            "SELECT %b::int[], %b::int8[], %b::bytea[], %b::text[], %b::int[], %b::bytea[]",
            (arrays.int4s([1, -2, 2**31 - 1]), arrays.int8s([2**40, -1]), arrays.byteas([b"ab", None, b""]),
             arrays.texts(["héllo", "", "\u2603"]), arrays.int4s([]), arrays.byteas([])))
        assert await cur.fetchone() == ([1, -2, 2**31 - 1], [2**40, -1], [b"ab", None, b""], ["héllo", "", "\u2603"],
                                        [], [])


async def test_workers_of_the_version_before_write_and_prune_through_the_old_name(app: pgflow.App, dsn: str,
                                                                                  schema: str) -> None:
    """What the statements of the version before 0015 do to ``streams`` still lands in the chunks, so
    their workers, still running while the first new one migrates, fail no stream."""
    s = f'"{schema}"'
    await app.migrate_async()
    # The old batch insert, its retry (ON CONFLICT) and its prune, as they were written.
    inserted = await query(dsn, f"INSERT INTO {s}.streams (workflow_id, key, position, value)"
                                " SELECT 'old', 'tokens', p, convert_to('c' || p, 'UTF8') FROM generate_series(0, 2) p"
                                " ON CONFLICT DO NOTHING RETURNING 1")
    assert len(inserted) == 3
    # Their retry after a lost connection that had in fact committed: nothing twice, no error.
    again = await query(dsn, f"INSERT INTO {s}.streams (workflow_id, key, position, value)"
                             " SELECT 'old', 'tokens', p, convert_to('c' || p, 'UTF8') FROM generate_series(0, 3) p"
                             " ON CONFLICT DO NOTHING RETURNING 1")
    assert len(again) == 1  # position 3 only
    rows = await query(dsn, f"SELECT c.position, c.value FROM {s}.chunks c JOIN {s}.stream_ids i"
                            " ON i.id = c.stream_id WHERE i.workflow_id = 'old' AND i.key = 'tokens' ORDER BY 1")
    assert rows == [(0, b"c0"), (1, b"c1"), (2, b"c2"), (3, b"c3")]
    await query(dsn, f"DELETE FROM {s}.streams WHERE workflow_id = 'old' AND position < 2")
    assert await query(dsn, f"SELECT position FROM {s}.streams WHERE workflow_id = 'old' ORDER BY 1") == [(2,), (3,)]
