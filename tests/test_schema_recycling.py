"""The schemas the ``schema`` fixture uses again (tests/recycling.py): one a test has used, once reset, is
what a fresh migration leaves for everything a test can observe, and one a test changed is not used again."""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

import pgflow

from .helpers import TIMEOUT, move_schema_clock, query, running, wait_for
from .recycling import SchemaPool, describe

pytestmark = pytest.mark.anyio

WRITTEN = ("migrations", "chunk_partitions", "chunk_partitioning", "signal_keys")  # by the migration


def observed(dsn: str, name: str) -> dict[str, Any]:
    """What a test can see of schema ``name``, its name left out, and the times the migration wrote
    (compared on their own): the objects, every table's rows, the sequences, the planner's numbers and
    the statistics views' counters."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        s = sql.Identifier(name)
        tables = [t for t, in conn.execute("SELECT relname::text FROM pg_class WHERE relnamespace ="
                                           " to_regnamespace(%s) AND relkind IN ('r', 'p') ORDER BY 1",
                                           (f'"{name}"',)).fetchall()]
        rows = {t: conn.execute(sql.SQL("SELECT count(*) FROM {}.{}").format(s, sql.Identifier(t))).fetchone()
                for t in tables}
        kept = {
            "migrations": conn.execute(sql.SQL("SELECT version, name FROM {}.migrations ORDER BY 1")
                                       .format(s)).fetchall(),
            "partitions": conn.execute(sql.SQL("SELECT name, first_id, end_id, starts_at, ends_at >= now() - '1 minute'"
                                               "::interval FROM {}.chunk_partitions ORDER BY 2").format(s)).fetchall(),
            "partitioning": conn.execute(sql.SQL("SELECT * FROM {}.chunk_partitioning").format(s)).fetchall(),
            "keys": conn.execute(sql.SQL("SELECT id, octet_length(secret), accept_until FROM {}.signal_keys")
                                 .format(s)).fetchall(),
        }
        sequences = conn.execute("SELECT sequencename::text, last_value FROM pg_sequences WHERE schemaname = %s"
                                 " ORDER BY 1", (name,)).fetchall()
        planner = conn.execute("SELECT relname::text, relpages, reltuples, relallvisible FROM pg_class"
                               " WHERE relnamespace = to_regnamespace(%s) ORDER BY 1", (f'"{name}"',)).fetchall()
        statistics = conn.execute("SELECT count(*) FROM pg_statistic WHERE starelid IN (SELECT oid FROM pg_class"
                                  " WHERE relnamespace = to_regnamespace(%s))", (f'"{name}"',)).fetchone()
        # (the counters of the tables the migration writes to count its writes, once its session has
        # reported them, some time after it ended: left out)
        counters = conn.execute(
            "SELECT relname::text, seq_scan, coalesce(idx_scan, 0), n_tup_ins, n_tup_upd, n_tup_del, n_live_tup,"
            " n_dead_tup, n_mod_since_analyze, last_analyze IS NULL FROM pg_stat_all_tables WHERE schemaname = %s"
            " AND NOT relname = ANY(%s) ORDER BY 1", (name, list(WRITTEN))).fetchall()
        index_counters = conn.execute("SELECT indexrelname::text, idx_scan, idx_tup_read FROM pg_stat_all_indexes"
                                      " WHERE schemaname = %s AND NOT relname = ANY(%s) ORDER BY 1",
                                      (name, list(WRITTEN))).fetchall()
        return {"objects": describe(conn, name), "rows": rows, "kept": kept, "sequences": sequences,
                "planner": planner, "statistics": statistics, "counters": counters,
                "index_counters": index_counters}


def secret(dsn: str, name: str) -> bytes:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(sql.SQL("SELECT secret FROM {}.signal_keys").format(sql.Identifier(name))).fetchone()
        assert row is not None
        return bytes(row[0])


@pytest.fixture
def pool(dsn: str) -> Iterator[SchemaPool]:
    """A pool of this test's own, not the session's: what it hands out here is this test's to spoil."""
    made = SchemaPool(dsn)
    yield made
    made.drop_all()


async def sessions(dsn: str) -> set[int]:
    """The server processes of this test process's Apps (their sessions are named after its pid)."""
    rows = await query(dsn, "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s", f"%-{os.getpid()}")
    return {int(row[0]) for row in rows}


async def use(dsn: str, name: str) -> None:
    """Use the schema as tests do: workflows run with steps and a stream, a worker registered, the
    sequences drawn, the tables analyzed, rows the migration wrote changed; then wait until the App's
    sessions have ended (a session reports what it read and wrote to the statistics views as it ends)."""
    others = await sessions(dsn)
    app = pgflow.App(dsn, schema=name, poll_interval=0.5)
    try:
        @app.step(name="recycled.step")
        async def step(i: int) -> int:
            return i + 1

        @app.workflow(name="recycled.flow")
        async def flow(i: int) -> int:
            await pgflow.write_stream_async("out", f"chunk {i}")
            return await step(i)

        handles = [await flow.start_async(i) for i in range(5)]
        async with running(app):
            assert [await h.result_async(timeout=TIMEOUT) for h in handles] == [1, 2, 3, 4, 5]
        ours = await sessions(dsn) - others
    finally:
        await app.close_async()
    s = f'"{name}"'
    for statement in (f"ANALYZE {s}.workflows", f"ANALYZE {s}.steps",
                      f"INSERT INTO {s}.migrations (version, name) VALUES (9999, 'from the future')",
                      f"UPDATE {s}.chunk_partitioning SET ahead = 5",
                      "SELECT nextval(c.oid) FROM pg_class c WHERE c.relkind = 'S'"
                      f" AND c.relnamespace = to_regnamespace('{s}')"):
        await query(dsn, statement)
    await wait_for(lambda: gone(dsn, ours), timeout=30)


async def gone(dsn: str, pids: set[int]) -> bool:
    return not (await sessions(dsn) & pids)


async def test_a_schema_used_and_handed_back_is_reset_to_what_a_fresh_migration_leaves(
        dsn: str, pool: SchemaPool) -> None:
    fresh = pool.take()
    before, first_secret = observed(dsn, fresh), secret(dsn, fresh)
    await use(dsn, fresh)
    assert observed(dsn, fresh)["rows"] != before["rows"]  # it was used
    pool.give_back(fresh)
    again = pool.take()
    assert again == fresh and (pool.made, pool.reused) == (1, 1)
    after = observed(dsn, again)
    # The counters of the statistics views start from zero; a fresh schema's count what its migration
    # read (it scans tables to add columns and partitions). The tests that read them have new_schema.
    for counted in ("counters", "index_counters"):
        assert all(not any(n for n in row[1:] if not isinstance(n, bool)) for row in after.pop(counted)), counted
        before.pop(counted)
    assert after == before
    assert secret(dsn, again) != first_secret  # a key of its own, drawn anew as a migration draws it
    # And it serves a test as a fresh one does.
    await use(dsn, again)


async def test_a_schema_whose_objects_a_test_changed_is_dropped_not_used_again(dsn: str, pool: SchemaPool) -> None:
    changed, clocked = pool.take(), pool.take()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE {}.mine (a int)").format(sql.Identifier(changed)))
    async with pgflow.App(dsn, schema=clocked) as app:
        await move_schema_clock(app, 3 * 86400.0)  # clock_now() replaced, as pgflow.testing does
    pool.give_back(changed)
    pool.give_back(clocked)
    fresh = pool.take()
    assert fresh not in (changed, clocked) and (pool.reused, pool.discarded) == (0, 2)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT nspname FROM pg_namespace WHERE nspname = ANY(%s)",
                            ([changed, clocked],)).fetchall() == []
        assert describe(conn, fresh) == describe(conn, pool.take())


async def test_a_schema_is_not_used_again_while_a_session_holds_an_advisory_lock(dsn: str, pool: SchemaPool) -> None:
    """A worker left running holds its maintenance services' locks (named after the schema): the next
    test's worker could not take them. Its schema is not used again while such a lock is held."""
    used = pool.take()
    pool.give_back(used)
    with psycopg.connect(dsn, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(hashtext(%s))", (f"pgflow.{used}.retention",))
        other = pool.take()
    assert other != used and pool.discarded == 1


async def test_no_schema_is_used_again_once_the_period_of_its_chunk_partitions_is_over(
        dsn: str, pool: SchemaPool) -> None:
    """A migration makes the chunk partitions of the period the clock is in and of those after it: once
    that period is over (the day turned), a schema made in it is not what a migration makes any more."""
    used = pool.take()
    pool.give_back(used)
    reference = pool._reference  # noqa: SLF001 - made in the period before, as if the day had turned since
    assert reference is not None
    hours, start = reference.period
    reference.period = (hours, start - timedelta(hours=hours))
    other = pool.take()
    assert other != used and pool.discarded == 1
    assert pool._reference is not None and pool._reference.period == (hours, start)  # noqa: SLF001
