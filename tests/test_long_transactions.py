"""Claims while a long transaction elsewhere holds vacuum back (benchmarks/long_transaction.py has the
figures): most claims skip the dead entries their predecessors left, and a workflow a bounded claim
cannot see (queued again with an old due time) is still claimed by the next full claim."""

from __future__ import annotations

import re
from collections.abc import Iterator

import psycopg
import psycopg.sql
import pytest

import pgflow
from pgflow._core.engine import quote_identifier
from pgflow._core.engine.claims import CLAIM, FLOOR_MARGIN, FLOORS, FULL_CLAIM

pytestmark = pytest.mark.anyio

PARAMETERS = ["queues", "floors", "names", "limit", "owner", "lease", "token", "commit"]


@pytest.fixture
def snapshot_held(dsn: str) -> Iterator[None]:
    """A REPEATABLE READ transaction on another connection, its snapshot taken: nothing that dies
    from now on can be removed, nor marked dead in an index, until it ends."""
    with psycopg.connect(dsn) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT 1")
        yield
        holder.rollback()


def buffers_of_claim(conn: psycopg.Connection[tuple[object, ...]], schema: str, full: bool) -> int:
    """The buffers one claim of queue ``default`` touches, run as pgflow runs it (a generic plan),
    in a transaction rolled back; bounded by the floor FLOORS computes now when not ``full``."""
    sql = (FULL_CLAIM if full else CLAIM).replace("{s}", quote_identifier(schema))
    for n, name in enumerate(PARAMETERS, 1):
        sql = sql.replace(f"%({name})s", f"${n}")
    floors = FLOORS.replace("{s}", quote_identifier(schema))
    floor = conn.execute(floors, {"queues": ["default"], "names": ["n.a"], "margin": FLOOR_MARGIN}).fetchone()
    assert floor is not None
    conn.execute(f"PREPARE probe_claim(text[], timestamptz[], text[], int, text, float8, int8, text) AS {sql}")
    rows: list[tuple[object, ...]] = []
    try:
        with conn.transaction():
            conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            rows = conn.execute(psycopg.sql.SQL(
                "EXPLAIN (ANALYZE, BUFFERS) EXECUTE probe_claim(ARRAY['default'], ARRAY[{}]::timestamptz[],"
                " ARRAY['n.a'], 16, 'probe', 10.0, 1, 'off')").format(
                    psycopg.sql.Literal(None if full else floor[1]))).fetchall()
            raise psycopg.Rollback()  # the claim's updates are not wanted
    finally:
        conn.execute("DEALLOCATE probe_claim")
    first = re.search(r"Buffers: shared hit=(\d+)(?: read=(\d+))?", "\n".join(str(row[0]) for row in rows))
    assert first is not None
    return int(first.group(1)) + int(first.group(2) or 0)


async def test_a_bounded_claim_skips_the_dead_entries_a_long_transaction_keeps(
        app: pgflow.App, dsn: str, schema: str, snapshot_held: None) -> None:
    await app.migrate_async()
    s = quote_identifier(schema)
    with psycopg.connect(dsn, autocommit=True) as conn:
        # 20,000 workflows queued, claimed and finished under the held snapshot (as a worker would
        # leave them), then 100 due ones, and one of a name this worker does not serve, long queued.
        for batch in range(20):
            conn.execute(f"INSERT INTO {s}.workflows (id, name, queue, inputs, due_at)"
                         f" SELECT 'dead-{batch}-' || i, 'n.a', 'default', '\\x80'::bytea,"
                         "  now() - interval '1 second' * (1000 - i / 10) FROM generate_series(1, 1000) i")
            conn.execute(f"UPDATE {s}.workflows SET status = 'running', lease_expires_at = now() - interval '1 hour'"
                         f" WHERE id LIKE 'dead-{batch}-%'")
            conn.execute(f"UPDATE {s}.workflows SET status = 'succeeded', finished_at = now(),"
                         f" lease_expires_at = NULL WHERE id LIKE 'dead-{batch}-%'")
        conn.execute(f"INSERT INTO {s}.workflows (id, name, queue, inputs)"
                     " SELECT 'live-' || i, 'n.a', 'default', '\\x80'::bytea FROM generate_series(1, 100) i")
        conn.execute(f"INSERT INTO {s}.workflows (id, name, queue, inputs, due_at)"
                     " VALUES ('other', 'n.other', 'default', '\\x80'::bytea, now() - interval '1 day')")
        full = buffers_of_claim(conn, schema, full=True)
        bounded = buffers_of_claim(conn, schema, full=False)
    assert full > 1000, full  # the full claim visits the dead versions (and this shows the setup worked)
    assert bounded * 5 < full, (bounded, full)  # seen: 313 against 2993


async def test_a_workflow_queued_below_the_floor_is_claimed_by_the_next_full_claim(
        app: pgflow.App, dsn: str, schema: str) -> None:
    @app.workflow(name="longtx.late")
    async def late(x: int) -> int:
        return x + 1

    async with app.worker(concurrency=4):
        assert await (await late.start_async(1)).result_async(timeout=60) == 2  # the floors are known now
        handle = await late.with_options(delay=3600).start_async(41)
        with psycopg.connect(dsn, autocommit=True) as conn:  # as a workflow given back with its old due time
            conn.execute(f"UPDATE {quote_identifier(schema)}.workflows SET due_at = now() - interval '1 day'"
                         " WHERE id = %s", (handle.id,))
        assert await handle.result_async(timeout=60) == 42
