"""The claim's query plan: each queue read in index order however many queues a worker serves, and
the next due time found from the index, so the cost of a claim stays flat as a backlog grows."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import sql as sql_

import pgflow
from pgflow._core.store import quote_identifier
from pgflow._core.store.claims import CLAIM

pytestmark = pytest.mark.anyio


def plan(dsn: str, schema: str, queues: list[str]) -> str:
    """The claim's plan as pgflow's connections run it: prepared, and planned once for any values
    (a generic plan: the planner cannot see the limit or the queues)."""
    sql = CLAIM.replace("{s}", quote_identifier(schema))
    for n, name in enumerate(["queues", "floors", "full", "names", "limit", "owner", "lease", "token", "commit"], 1):
        sql = sql.replace(f"%({name})s", f"${n}")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET jit = off")
        conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.execute(f"PREPARE claim(text[], timestamptz[], bool, text[], int, text, float8, int8, text) AS {sql}")
        cur = conn.execute(sql_.SQL("EXPLAIN EXECUTE claim({}, {}, true, {}, 16, 'probe', 10.0, 1, 'off')").format(
            sql_.Literal(queues), sql_.Literal([None] * len(queues)), sql_.Literal(["n.a", "n.b"])))
        return "\n".join(row[0] for row in cur.fetchall())


@pytest.mark.parametrize(("queues", "rows", "spread"), [
    (["q0"], 30_000, 4), (["q0", "q1", "q2"], 30_000, 4),
    # One deep queue: the planner then expects the claimed set to be large, and once joined the
    # whole table to it by a hash join over a scan of every row (a 100K backlog drained 8x slower).
    (["q0"], 120_000, 1),
])
async def test_a_claim_reads_each_queue_through_its_index_and_scans_no_table(
    app: pgflow.App, dsn: str, schema: str, queues: list[str], rows: int, spread: int,
) -> None:
    await app.migrate_async()
    with psycopg.connect(dsn, autocommit=True) as conn:
        # A backlog of queued workflows over ``spread`` queues, some delayed, and finished ones.
        conn.execute(f'INSERT INTO "{schema}".workflows (id, name, queue, inputs, priority, due_at, status)'
                     f" SELECT 'w' || i, 'n.a', 'q' || (i % {spread}), '\\x80'::bytea, i % 3,"
                     "  now() + make_interval(secs => (i % 7) * 60 - 120),"
                     "  CASE WHEN i % 5 = 0 THEN 'succeeded' ELSE 'queued' END"
                     f" FROM generate_series(1, {rows}) AS i")
        conn.execute(f'ANALYZE "{schema}".workflows')
    text = plan(dsn, schema, queues)
    assert "Seq Scan on workflows" not in text, text
    queued = text.split("CTE queued")[1].split("CTE expired")[0]
    # One ordered index scan, run once per queue of the unnest (no sort of a whole queue's rows).
    assert "Nested Loop" in queued and "Index Scan using workflows_queued" in queued, text
    assert "Sort" not in queued, text
    assert "Index Scan using workflows_due" in text, text  # the next due time: one index entry a queue
