"""The hot statements' path through libpq (``_core/engine/wire.py``), on a real server: every parameter
type it packs comes back as sent, a statement is prepared once per connection, the server's errors
are psycopg's, and a statement cut off halfway (a cancelled task, a killed backend) costs the
connection, never the next statement on it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple, TypedDict

import anyio
import psycopg
import pytest

from pgflow._core.engine import unreachable, wire
from pgflow._core.engine.database import BEGIN, COMMIT, Database, Session
from pgflow._core.pool import Pool
from pgflow._core.registry import Config

from .helpers import query

pytestmark = pytest.mark.anyio



class Echoed(TypedDict):
    text: wire.Text | None
    bytea: wire.Bytea | None
    bool: wire.Bool | None
    int4: wire.Int4 | None
    int8: wire.Int8 | None
    float8: wire.Float8 | None
    at: wire.Timestamptz | None
    texts: wire.Texts | None
    int4s: wire.Int4s | None
    int8s: wire.Int8s | None
    byteas: wire.Byteas | None
    ats: wire.Timestamptzs | None


class Sleeping(TypedDict):
    seconds: wire.Float8


class Dividing(TypedDict):
    zero: wire.Int4


class Hashing(TypedDict):
    b: wire.Bytea


ECHO = wire.Statement(
    "SELECT %(text)s, %(bytea)s, %(bool)s, %(int4)s, %(int8)s, %(float8)s, %(at)s, %(texts)s, %(int4s)s,"
    " %(int8s)s, %(byteas)s, %(ats)s, %(text)s || '%%(not a placeholder)s'", row=tuple[Any, ...], params=Echoed)
SLEEP = wire.Statement("SELECT 1 FROM pg_sleep(%(seconds)s)", row=tuple[int], params=Sleeping)
DIVIDE = wire.Statement("SELECT x FROM (VALUES (1), (1)) v(x) GROUP BY x HAVING 1 / (%(zero)s) > 0",
                        row=tuple[int], params=Dividing)


@pytest.fixture
async def pool(dsn: str, schema: str) -> AsyncIterator[Pool]:
    pool = Pool(Config(dsn=dsn, schema=schema, pool_size=2))
    await pool.open(wait=True)
    try:
        yield pool
    finally:
        await pool.close()


@pytest.mark.parametrize("prepare", [True, False], ids=["prepared", "unnamed"])
async def test_every_parameter_type_comes_back_as_it_was_sent(pool: Pool, prepare: bool) -> None:
    at = datetime(2026, 12, 5, 23, 59, 58, 123456, tzinfo=UTC)
    sent = {"text": "ünïcode ✓", "bytea": b"\x00\xff\x00", "bool": True, "int4": -2**31, "int8": 2**63 - 1,
            "float8": 0.1, "at": at, "texts": ["a", None, "", "ß"], "int4s": [1, -1, 2**31 - 1], "int8s": [],
            "byteas": [b"", None, b"\x00"], "ats": [at, None, at - timedelta(days=9000)]}
    async with pool.connection() as conn:
        [row] = await wire.fetch(conn, ECHO, "x", sent, prepare=prepare)
        assert row == (*sent.values(), "ünïcode ✓%(not a placeholder)s")
        [nulls] = await wire.fetch(conn, ECHO, "x", dict.fromkeys(sent), prepare=prepare)
        assert nulls == (None,) * 12 + (None,)


async def test_a_statement_is_prepared_once_per_connection(pool: Pool) -> None:
    async with pool.connection() as conn:
        for _ in range(3):
            assert await wire.fetch(conn, SLEEP, "x", {"seconds": 0}) == [(1,)]
        cur = await conn.execute("SELECT count(*) FROM pg_prepared_statements WHERE name LIKE '\\_pgflow\\_%'")
        assert await cur.fetchone() == (1,)


class A(TypedDict):
    a: wire.Text


class AC(A):
    c: wire.Text


class Untyped(TypedDict):
    a: str  # (no wire type: how would it be sent?)


def test_a_statement_says_which_parameter_has_no_type_or_is_not_named() -> None:
    with pytest.raises(TypeError, match=r"%\(b\)s, whose type is not given"):
        wire.Statement("SELECT %(a)s, %(b)s", row=tuple[str, str], params=A)
    with pytest.raises(TypeError, match=r"does not name: \['c'\]"):
        wire.Statement("SELECT %(a)s", row=tuple[str], params=AC)
    with pytest.raises(TypeError, match="'a' of Untyped is no wire type"):
        wire.Statement("SELECT %(a)s", row=tuple[str], params=Untyped)


class Pair(NamedTuple):
    text: str
    number: int


async def test_a_row_comes_back_as_its_statement_declares_it(pool: Pool) -> None:
    """A NamedTuple row is made in psycopg's loop, read by name; a ``tuple[...]`` one stays psycopg's tuple."""
    named = wire.Statement("SELECT %(a)s, 7::int8", row=Pair, params=A)
    plain = wire.Statement("SELECT %(a)s, 7::int8", row=tuple[str, int], params=A)
    async with pool.connection() as conn:
        [pair] = await wire.fetch(conn, named, "x", {"a": "seven"})
        [bare] = await wire.fetch(conn, plain, "x", {"a": "seven"})
    assert type(pair) is Pair and (pair.text, pair.number) == ("seven", 7)
    assert type(bare) is tuple and bare == ("seven", 7)


async def test_the_servers_error_is_psycopgs_and_the_connection_goes_on(pool: Pool) -> None:
    async with pool.connection() as conn:
        with pytest.raises(psycopg.errors.DivisionByZero):
            await wire.fetch(conn, DIVIDE, "x", {"zero": 0})
        assert await wire.fetch(conn, DIVIDE, "x", {"zero": 1}) == [(1,)]  # idle again, and usable


async def test_a_statement_bigger_than_the_sockets_buffer_goes_out_whole(pool: Pool, dsn: str) -> None:
    big = bytes(range(256)) * 32768  # 8 MiB
    async with pool.connection() as conn:
        [(back,)] = await wire.fetch(conn, wire.Statement("SELECT md5(%(b)s)", row=tuple[str], params=Hashing), "x",
                                     {"b": big})
    [(expected,)] = await query(dsn, "SELECT md5(%s)", big)
    assert back == expected


async def test_a_cancelled_statement_costs_its_connection_not_the_next_statement(pool: Pool) -> None:
    with anyio.move_on_after(0.3) as cut:
        async with pool.connection() as conn:
            cut_off = conn.info.backend_pid
            await wire.fetch(conn, SLEEP, "x", {"seconds": 30})
    assert cut.cancelled_caught
    async with pool.connection() as conn:  # the pool closed the one left mid-statement
        assert conn.info.backend_pid != cut_off
        assert await wire.fetch(conn, SLEEP, "x", {"seconds": 0}) == [(1,)]


async def test_a_killed_backend_is_an_outage_that_trying_again_mends(pool: Pool, dsn: str) -> None:
    async with pool.connection() as conn:
        victim = conn.info.backend_pid
        async with anyio.create_task_group() as group:
            async def kill() -> None:
                while not await query(dsn, "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND wait_event = 'PgSleep'",
                                      victim):
                    await anyio.sleep(0.01)
                await query(dsn, "SELECT pg_terminate_backend(%s)", victim)

            group.start_soon(kill)
            with pytest.raises(psycopg.OperationalError) as lost:
                await wire.fetch(conn, SLEEP, "x", {"seconds": 30})
    assert unreachable(lost.value)
    async with pool.connection() as conn:
        assert await wire.fetch(conn, SLEEP, "x", {"seconds": 0}) == [(1,)]


@pytest.mark.parametrize("durable", [False, True], ids=["fetch", "fetch_then_durable"])
async def test_a_statement_psycopg_deallocated_is_prepared_again(pool: Pool, durable: bool) -> None:
    """psycopg, once it has prepared statements of its own on a connection, sends DEALLOCATE ALL there
    after a rollback (or a DROP): ours go with them. The next run of ours prepares it again, runs it
    once, and says nothing of it (seen: a start refused with "prepared statement does not exist"
    after a prune's lock timeout rolled back on the same pooled connection)."""
    run = wire.fetch_then_durable if durable else wire.fetch
    async with pool.connection() as conn:
        assert await run(conn, SLEEP, "x", {"seconds": 0}) == [(1,)]
        for _ in range(6):  # past psycopg's prepare_threshold (5): it prepares this one itself
            await conn.execute("SELECT 1 WHERE %s", (True,))
        with pytest.raises(ZeroDivisionError):
            async with conn.transaction():  # rolled back: psycopg will clear the server's statements
                raise ZeroDivisionError
        await conn.execute("SELECT 2")  # (its DEALLOCATE ALL goes before its next statement)
        cur = await conn.execute("SELECT count(*) FROM pg_prepared_statements WHERE name LIKE '\\_pgflow\\_%'")
        assert await cur.fetchone() == (0,)  # ours are gone: the test shows what it says
        assert await run(conn, SLEEP, "x", {"seconds": 0}) == [(1,)]
        assert await run(conn, SLEEP, "x", {"seconds": 0}) == [(1,)]


class Kept(TypedDict):
    n: wire.Int4


TABLE = wire.Statement("CREATE TABLE IF NOT EXISTS {s}.kept (n int)", row=None, params=wire.Nothing)
KEEP = wire.Statement("INSERT INTO {s}.kept VALUES (%(n)s)", row=None, params=Kept)
KEPT = wire.Statement("SELECT array_agg(n ORDER BY n) FROM {s}.kept", row=tuple[list[int] | None],
                      params=wire.Nothing)


@pytest.mark.parametrize("prepare", [True, False], ids=["prepared", "unnamed"])
async def test_a_pipeline_answers_each_statement_and_stops_at_the_first_error(pool: Pool, prepare: bool) -> None:
    async with pool.connection() as conn:
        rows = await wire.pipeline(conn, [SLEEP.step(seconds=0), DIVIDE.step(zero=1), ECHO.step(**dict.fromkeys(
            ["text", "bytea", "bool", "int4", "int8", "float8", "at", "texts", "int4s", "int8s", "byteas", "ats"]))],
            "x", prepare=prepare)
        assert rows == [[(1,)], [(1,)], [(None,) * 13]]
        with pytest.raises(psycopg.errors.DivisionByZero):
            await wire.pipeline(conn, [SLEEP.step(seconds=0), DIVIDE.step(zero=0), SLEEP.step(seconds=30)],
                                "x", prepare=prepare)  # (the sleep after it would take 30 s: it does not run)
        assert await wire.pipeline(conn, [DIVIDE.step(zero=1)], "x", prepare=prepare) == [[(1,)]]  # idle again


async def test_a_pipelined_transaction_commits_rolls_back_and_runs_again_when_forgotten(
        pool: Pool, schema: str) -> None:
    """``Database.pipelined``: BEGIN in the body's first pipeline, COMMIT in its last (or after it, when
    the body left the transaction open); a body that raises leaves nothing; a body whose prepared
    statement psycopg deallocated mid-transaction is run again from the start, its first try's writes
    rolled back."""
    db = Database(pool, schema)
    quoted = db.quoted
    async with pool.connection() as conn:
        await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {quoted}")
        await wire.fetch(conn, TABLE, quoted, {})

    async def kept() -> list[int] | None:
        [(found,)] = await db.rows(KEPT)
        return found

    async def two(s: Session) -> str:
        await s.pipeline(BEGIN.step(), KEEP.step(n=1))
        await s.pipeline(KEEP.step(n=2), COMMIT.step())
        return "done"

    assert await db.pipelined(two) == "done"

    async def left_open(s: Session) -> None:
        await s.pipeline(BEGIN.step(), KEEP.step(n=3))

    await db.pipelined(left_open)
    assert await kept() == [1, 2, 3]

    async def fails(s: Session) -> None:
        await s.pipeline(BEGIN.step(), KEEP.step(n=4))
        raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        await db.pipelined(fails)
    assert await kept() == [1, 2, 3]
    tries: list[int] = []

    async def forgets_once(s: Session) -> None:
        tries.append(len(tries))
        await s.pipeline(BEGIN.step(), KEEP.step(n=10 + len(tries)))
        if len(tries) == 1:
            await s.script(b"DEALLOCATE ALL")  # (what psycopg sends after a rollback it saw)
        await s.pipeline(KEEP.step(n=20 + len(tries)), COMMIT.step())

    await db.pipelined(forgets_once)
    assert tries == [0, 1]
    assert await kept() == [1, 2, 3, 12, 22]  # the first try's writes rolled back, the second's committed
