"""Group commit of appends to free-standing streams (``_core/engine/free_appends.py``) against writers
of other processes: a batch judges its idempotent producers on the state the writer it waited for left,
not on the snapshot it began with, nor on what this process knew of the stream before (``free_known``:
the batch judged on it in one round trip writes nothing when the server finds the stream changed, and
is judged again under its locks)."""

from __future__ import annotations

from typing import Any

import anyio
import psycopg
import pytest

import pgflow
from pgflow._core.engine.free_appends import Append, Appended, Producer
from pgflow._core.engine.free_streams import FreeStreams

pytestmark = pytest.mark.anyio
BLOCKED_BY_ME = "SELECT 1 FROM pg_stat_activity WHERE pg_backend_pid() = ANY(pg_blocking_pids(pid))"


def append(seq: int, data: bytes = b"1", path: str = "/raced") -> Append:
    return Append(path, "application/json", True, lambda _: [data], False, None, Producer("p", 0, seq))


async def first_try_elsewhere(conn: psycopg.AsyncConnection[Any], table: str, sid: int, seq: int) -> None:
    """Producer-Seq ``seq`` appended at position ``seq``, as another server's batch writes it: locked and
    written, not committed."""
    await conn.execute("BEGIN")
    await conn.execute(f"SELECT 1 FROM {table}.free_streams WHERE id = %s FOR UPDATE", (sid,))
    await conn.execute(f"INSERT INTO {table}.free_chunks (stream_id, end_pos, size, batch_end, data)"
                       " VALUES (%s, %s, 1, %s, '1')", (sid, seq + 1, seq + 1))
    await conn.execute(f"INSERT INTO {table}.free_producers (stream_id, producer, epoch, seq) VALUES (%s, 'p', 0, %s)"
                       " ON CONFLICT (stream_id, producer) DO UPDATE SET seq = excluded.seq", (sid, seq))
    await conn.execute(f"UPDATE {table}.free_streams SET tail = %s WHERE id = %s", (seq + 1, sid))


async def retried_meanwhile(conn: psycopg.AsyncConnection[Any], statements: FreeStreams, path: str,
                            seq: int) -> Appended:
    """The client's retry of ``seq`` through this server, sent while the first try holds the stream's
    lock; the first try commits once the retry waits for it."""
    answers: list[Appended | Exception] = []
    async with anyio.create_task_group() as group:
        async def retry() -> None:
            answers.extend(await statements.append_many([append(seq, path=path)]))

        group.start_soon(retry)
        with anyio.fail_after(10):  # the retry's batch waits for the first try's lock
            while not await (await conn.execute(BLOCKED_BY_ME)).fetchone():
                await anyio.sleep(0.01)
        await conn.execute("COMMIT")
    [answer] = answers
    assert isinstance(answer, Appended)
    return answer


async def chunks_of(conn: psycopg.AsyncConnection[Any], table: str, sid: int) -> int:
    cur = await conn.execute(f"SELECT count(*) FROM {table}.free_chunks WHERE stream_id = %s", (sid,))
    row = await cur.fetchone()
    return int(row[0]) if row else 0


async def test_a_retry_waiting_for_the_first_try_to_commit_is_a_duplicate(app: pgflow.App) -> None:
    """Producer-Seq 0, written by another process (another server of the fleet) whose transaction has
    locked the stream and not committed yet; the client, having had no answer, sends seq 0 again here.
    The batch waits for the lock; once the first try commits, the retry is a duplicate: one copy of
    the message. (When the producers' state was read in the statement that took the locks, it came
    from that statement's snapshot, from before the first try committed: seq 0 looked new and was
    written twice.)"""
    store = await app._internals().runtime().store()
    statements = store.free_streams
    created = await statements.create("/raced", "application/json", None, None, False, True, [], None)
    assert created.outcome == "created" and created.stream is not None
    sid, table = created.stream.id, f'"{app.schema}"'
    async with await psycopg.AsyncConnection.connect(store.pool.conninfo, autocommit=True) as first:
        await first_try_elsewhere(first, table, sid, 0)
        answer = await retried_meanwhile(first, statements, "/raced", 0)
        assert (answer.outcome, answer.seq) == ("duplicate", 0)
        assert await chunks_of(first, table, sid) == 1
    [after] = await statements.append_many([append(1, b"2")])  # and the producer goes on from seq 1
    assert isinstance(after, Appended) and after.outcome == "ok" and after.stream is not None
    assert after.stream.tail == 2


async def test_what_this_process_knew_is_checked_under_the_lock(app: pgflow.App) -> None:
    """This process appended seq 0 and knows the stream at tail 1, its producer at seq 0: its next batch
    to the stream goes in one round trip, judged on that. Another server writes seq 1 meanwhile, and the
    client's retry of seq 1 comes here while that first try holds the lock. Judged on what this process
    knew, seq 1 is new; the server finds the stream changed, so nothing is written, and the batch judged
    again under its locks finds a duplicate: one copy. The stream is then contended: the locked way."""
    store = await app._internals().runtime().store()
    statements = store.free_streams
    created = await statements.create("/known", "application/json", None, None, False, True, [], None)
    assert created.stream is not None
    sid, table = created.stream.id, f'"{app.schema}"'
    assert [a.outcome for a in await statements.append_many([append(0, path="/known")])
            if isinstance(a, Appended)] == ["ok"]
    assert statements.batches == {"known": 0, "changed": 0, "locked": 1}
    async with await psycopg.AsyncConnection.connect(store.pool.conninfo, autocommit=True) as first:
        await first_try_elsewhere(first, table, sid, 1)
        answer = await retried_meanwhile(first, statements, "/known", 1)
        assert (answer.outcome, answer.seq) == ("duplicate", 1)
        assert await chunks_of(first, table, sid) == 2
    assert statements.batches == {"known": 0, "changed": 1, "locked": 2}
    await statements.append_many([append(2, b"3", "/known")])  # contended: locked again
    assert statements.batches["locked"] == 3


async def test_a_stream_this_process_alone_appends_to_takes_one_round_trip(app: pgflow.App) -> None:
    """Batch after batch judged on what this process knows (after the first, which reads), with the
    producer's rules intact: a duplicate, a gap, a new epoch, a close."""
    store = await app._internals().runtime().store()
    statements = store.free_streams
    await statements.create("/alone", "application/json", None, None, False, True, [], None)

    def to(seq: int, epoch: int = 0, close: bool = False) -> Append:
        return Append("/alone", "application/json", True, lambda _: [str(seq).encode()], close, None,
                      Producer("p", epoch, seq))

    outcomes = []
    for batch in [[to(0)], [to(1), to(2)], [to(2)], [to(5)], [to(0, epoch=1)], [to(1, epoch=1, close=True)],
                  [to(2, epoch=1)]]:
        outcomes += [a.outcome if isinstance(a, Appended) else repr(a) for a in await statements.append_many(batch)]
    assert outcomes == ["ok", "ok", "ok", "duplicate", "gap", "ok", "ok", "closed"]
    assert statements.batches == {"known": 6, "changed": 0, "locked": 1}
    found = await statements.get("/alone")
    assert found is not None and found.tail == 5 and found.closed


async def test_a_known_stream_that_expired_or_was_made_anew_is_judged_under_its_lock(
        app: pgflow.App, second_app: pgflow.App) -> None:
    store = await app._internals().runtime().store()
    statements = store.free_streams
    elsewhere = (await second_app._internals().runtime().store()).free_streams
    for path in ("/expiring", "/anew"):
        await statements.create(path, "application/json", 3600, None, False, True, [], None)
        assert [a.outcome for a in await statements.append_many([append(0, path=path)])
                if isinstance(a, Appended)] == ["ok"]
    async with await psycopg.AsyncConnection.connect(store.pool.conninfo, autocommit=True) as conn:
        await conn.execute(f'UPDATE "{app.schema}".free_streams SET touched_at = now() - interval \'2 hours\''
                           " WHERE path = '/expiring'")
    assert await elsewhere.delete("/anew") == "deleted"  # another server deletes it, and makes it anew
    await elsewhere.create("/anew", "application/json", 3600, None, False, True, [b"10", b"11"], None)
    [expired] = await statements.append_many([append(1, path="/expiring")])
    assert isinstance(expired, Appended) and expired.outcome == "missing"  # (known: seq 1 would have gone on)
    [anew] = await statements.append_many([append(1, path="/anew")])
    assert isinstance(anew, Appended) and anew.outcome == "gap"  # a new stream: its producer starts at 0
    [first] = await statements.append_many([append(0, b"12", path="/anew")])
    assert isinstance(first, Appended) and first.outcome == "ok" and first.stream is not None
    assert first.stream.tail == 3
    assert statements.batches == {"known": 0, "changed": 2, "locked": 5}
