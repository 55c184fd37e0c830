"""The claim's query plan: each queue read in index order however many queues a worker serves, and
the next due time found from the index, so the cost of a claim stays flat as a backlog grows."""

from __future__ import annotations

import psycopg
import pytest

import pgflow
from pgflow._core.store import quote_identifier
from pgflow._core.store.claims import CLAIM

pytestmark = pytest.mark.anyio


def plan(dsn: str, schema: str, queues: list[str]) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET jit = off")
        conn.execute("SET plan_cache_mode = force_generic_plan")  # as pgflow's connections plan it
        cur = conn.execute("EXPLAIN " + CLAIM.replace("{s}", quote_identifier(schema)),
                           {"queues": queues, "names": ["n.a", "n.b"], "limit": 16, "owner": "probe",
                            "lease": 10.0})
        return "\n".join(row[0] for row in cur.fetchall())


@pytest.mark.parametrize("queues", [["q0"], ["q0", "q1", "q2"]])
async def test_a_claim_reads_each_queue_through_its_index_and_scans_no_table(
    app: pgflow.App, dsn: str, schema: str, queues: list[str],
) -> None:
    await app.migrate_async()
    with psycopg.connect(dsn, autocommit=True) as conn:
        # A backlog of 30,000 queued workflows over four queues, some delayed, and finished ones.
        conn.execute(f'INSERT INTO "{schema}".workflows (id, name, queue, inputs, priority, due_at, status)'
                     " SELECT 'w' || i, 'n.a', 'q' || (i % 4), '\\x80'::bytea, i % 3,"
                     "  now() + make_interval(secs => (i % 7) * 60 - 120),"
                     "  CASE WHEN i % 5 = 0 THEN 'succeeded' ELSE 'queued' END"
                     " FROM generate_series(1, 30000) AS i")
        conn.execute(f'ANALYZE "{schema}".workflows')
    text = plan(dsn, schema, queues)
    assert "Seq Scan on workflows" not in text, text
    queued = text.split("CTE queued")[1].split("CTE expired")[0]
    # One ordered index scan, run once per queue of the unnest (no sort of a whole queue's rows).
    assert "Nested Loop" in queued and "Index Scan using workflows_queued" in queued, text
    assert "Sort" not in queued, text
    assert "Index Scan using workflows_due" in text, text  # the next due time: one index entry a queue
