"""Group commit of appends to free-standing streams (``_core/engine/free_appends.py``) against writers
of other processes: a batch judges its idempotent producers on the state the writer it waited for left,
not on the snapshot it began with."""

from __future__ import annotations

import anyio
import psycopg
import pytest

import pgflow
from pgflow._core.engine.free_appends import Append, Appended, Producer

pytestmark = pytest.mark.anyio
BLOCKED_BY_ME = "SELECT 1 FROM pg_stat_activity WHERE pg_backend_pid() = ANY(pg_blocking_pids(pid))"


def append(seq: int, data: bytes = b"1") -> Append:
    return Append("/raced", "application/json", True, lambda _: [data], False, None, Producer("p", 0, seq))


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
        await first.execute("BEGIN")  # the first try, as another server's batch writes it
        await first.execute(f"SELECT 1 FROM {table}.free_streams WHERE id = %s FOR UPDATE", (sid,))
        await first.execute(f"INSERT INTO {table}.free_chunks (stream_id, end_pos, size, batch_end, data)"
                            " VALUES (%s, 1, 1, 1, '1')", (sid,))
        await first.execute(f"INSERT INTO {table}.free_producers (stream_id, producer, epoch, seq)"
                            " VALUES (%s, 'p', 0, 0)", (sid,))
        await first.execute(f"UPDATE {table}.free_streams SET tail = 1 WHERE id = %s", (sid,))
        answers: list[Appended | Exception] = []
        async with anyio.create_task_group() as group:
            async def retry() -> None:
                answers.extend(await statements.append_many([append(0)]))

            group.start_soon(retry)
            with anyio.fail_after(10):  # the retry's batch waits for the first try's lock
                while not await (await first.execute(BLOCKED_BY_ME)).fetchone():
                    await anyio.sleep(0.01)
            await first.execute("COMMIT")
        [answer] = answers
        assert isinstance(answer, Appended)
        assert (answer.outcome, answer.seq) == ("duplicate", 0)
        cur = await first.execute(f"SELECT count(*) FROM {table}.free_chunks WHERE stream_id = %s", (sid,))
        assert await cur.fetchone() == (1,)
    [after] = await statements.append_many([append(1, b"2")])  # and the producer goes on from seq 1
    assert isinstance(after, Appended) and after.outcome == "ok" and after.stream is not None
    assert after.stream.tail == 2
