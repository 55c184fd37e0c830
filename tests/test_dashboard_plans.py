"""The dashboard's statements at a million finished workflows, planned as pgflow's connections plan
them (once for any values: ``plan_cache_mode=force_generic_plan``): each reads pgflow's tables
through an index, never a whole table, and none sorts a set it did not bound first. The claim's
plan test (tests/test_claims.py) checks the claim the same way."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest

import pgflow
from pgflow._core.engine import dashboard as sql
from pgflow._core.engine import quote_identifier

# The plans of a schema just made, never used by an earlier test (tests/recycling.py).
pytestmark = [pytest.mark.anyio, pytest.mark.slow, pytest.mark.new_schema]

FINISHED = 1_000_000
# The tables that grow with the work. (``workers`` holds a row per worker process and ``queues`` one per
# queue with limits: a handful, read whole where the planner finds that cheaper.)
TABLES = ("workflows", "steps", "events", "messages", "stream_ids", "chunks", "step_attempts", "step_errors")
# The primary key of a partition of chunks ("Seq Scan on chunks" catches a partition's sequential scan too).
CHUNK_INDEX = "_pkey on chunks_"


def generic_plan(conn: psycopg.Connection[Any], schema: str, template: str, params: dict[str, Any]) -> str:
    """``EXPLAIN EXECUTE`` of ``template`` prepared with its parameters as $n: the generic plan."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match[1] not in names:
            names.append(match[1])
        return f"${names.index(match[1]) + 1}"

    text = re.sub(r"%\((\w+)\)s", number, template.replace("{s}", quote_identifier(schema)))
    conn.execute(f"PREPARE probe AS {text}", prepare=False)
    try:
        values = ", ".join(psycopg.sql.Literal(params[n]).as_string(conn) for n in names)
        cur = conn.execute(f"EXPLAIN EXECUTE probe({values})" if names else "EXPLAIN EXECUTE probe", prepare=False)
        return "\n".join(row[0] for row in cur.fetchall())
    finally:
        conn.execute("DEALLOCATE probe", prepare=False)


def populate(conn: psycopg.Connection[Any], s: str) -> None:
    """A million finished workflows over 50 names and 4 queues, a few failed; a backlog; running ones
    held by two workers; a parent with children; steps, events, messages and streams."""
    conn.execute("SET synchronous_commit = off")
    conn.execute(
        f"INSERT INTO {s}.workflows (id, name, queue, inputs, status, created_at, started_at, finished_at,"
        "  error, attempt)"
        " SELECT 'w' || i, 'n' || (i % 50), 'q' || (i % 4), '\\x80'::bytea,"
        "  CASE WHEN i % 1000 = 0 THEN 'failed' WHEN i % 997 = 0 THEN 'cancelled' ELSE 'succeeded' END,"
        f"  now() - make_interval(secs => ({FINISHED} - i) * 0.01),"
        f"  now() - make_interval(secs => ({FINISHED} - i) * 0.01),"
        f"  now() - make_interval(secs => ({FINISHED} - i) * 0.01 - 0.005),"
        "  CASE WHEN i % 1000 = 0 THEN '{\"type\": \"ValueError\", \"message\": \"no\"}'::jsonb END, 1"
        f" FROM generate_series(1, {FINISHED}) AS i")
    conn.execute(
        f"INSERT INTO {s}.workflows (id, name, queue, inputs, status, due_at, parent_id)"
        " SELECT 'b' || i, 'n' || (i % 50), 'q' || (i % 4), '\\x80'::bytea, 'queued',"
        "  now() + make_interval(secs => i % 100 - 50), CASE WHEN i <= 300 THEN 'w1' END"
        " FROM generate_series(1, 20000) AS i")
    conn.execute(
        f"INSERT INTO {s}.workflows (id, name, queue, inputs, status, lease_owner, lease_expires_at,"
        "  started_at, attempt)"
        " SELECT 'r' || i, 'n' || (i % 50), 'q' || (i % 4), '\\x80'::bytea, 'running',"
        "  'worker-' || (i % 2), now() + interval '10 s', now(), 1 FROM generate_series(1, 64) AS i")
    conn.execute(f"INSERT INTO {s}.workers (id, host, pid, queues, version, names)"
                 " VALUES ('worker-0', 'h', 1, '{q0}', 'v', '{n1}'), ('worker-1', 'h', 2, '{q1}', 'v', '{n2}')")
    conn.execute(f"INSERT INTO {s}.queues (name, concurrency) VALUES ('q0', 8)")
    conn.execute(f"INSERT INTO {s}.steps (workflow_id, position, name, output, attempts, attempt)"
                 " SELECT 'w' || (i / 4 + 1), i % 4, 'step', '\\x01'::bytea, 1, 1"
                 " FROM generate_series(0, 199999) AS i")
    conn.execute(f"INSERT INTO {s}.step_errors (workflow_id, position, run, step_attempt, error)"
                 " SELECT 'w' || (i / 4 + 1), i % 4, 1, 1, '{\"type\": \"OSError\"}'::jsonb"
                 " FROM generate_series(0, 49999) AS i")
    conn.execute(f"INSERT INTO {s}.step_attempts (workflow_id, position, attempt, tries)"
                 " SELECT 'r' || (i % 64 + 1), i / 64, 1, 1 FROM generate_series(0, 9999) AS i")
    conn.execute(f"INSERT INTO {s}.events (workflow_id, key, value) SELECT 'w' || i, 'k', '\\x01'::bytea"
                 " FROM generate_series(1, 50000) AS i")
    conn.execute(f"INSERT INTO {s}.messages (workflow_id, topic, value, idempotency_key)"
                 " SELECT 'w' || (i % 5000 + 1), 't', '\\x01'::bytea, 'w' || (i % 7000 + 1) || '.' || i"
                 " FROM generate_series(1, 50000) AS i")
    conn.execute(f"INSERT INTO {s}.stream_ids (workflow_id, key) SELECT 'w' || i, 'out'"
                 " FROM generate_series(1, 20000) AS i")
    conn.execute(f"INSERT INTO {s}.chunks (stream_id, position, value)"
                 f" SELECT id, p, '\\x01'::bytea FROM {s}.stream_ids, generate_series(0, 9) AS p")
    # As autovacuum leaves a table that grew by inserts (PostgreSQL 13 on): analyzed, and its
    # visibility map set, which is what makes the list's positions an index-only read.
    for table in TABLES:
        conn.execute(f"VACUUM ANALYZE {s}.{table}")
    # A snapshot anywhere in the database while VACUUM runs (another session's statement) leaves the
    # pages it cannot yet call all-visible unmarked (seen on PostgreSQL 15: 765 of 15,636 pages): vacuum
    # again until the map is set, as autovacuum would come back to it.
    for _ in range(60):
        [(pages, visible)] = conn.execute("SELECT relpages, relallvisible FROM pg_class"
                                          f" WHERE oid = '{s}.workflows'::regclass").fetchall()
        if visible >= 0.95 * pages:
            break
        time.sleep(0.5)
        conn.execute(f"VACUUM {s}.workflows")
    else:
        pytest.fail(f"the visibility map of workflows stayed unset: {visible} of {pages} pages")


def check(plan: str, *indexes: str) -> None:
    for table in TABLES:
        assert f"Seq Scan on {table}" not in plan, plan
    for index in indexes:
        assert index in plan, f"{index} not used:\n{plan}"


def reads_only_running(plan: str) -> bool:
    """Whether the plan finds the running workflows through one of the two partial indexes that hold
    only them (workflows_leased, workflows_running_by_queue): which one a generic plan picks depends on
    the sample ANALYZE drew, so either is right. Since migration 0025 no index leads with the status."""
    return "workflows_leased" in plan or "workflows_running_by_queue" in plan


def test_every_dashboard_statement_reads_through_an_index_at_a_million_finished_workflows(
        app: pgflow.App, dsn: str, schema: str) -> None:
    app.migrate()
    s = quote_identifier(schema)
    with psycopg.connect(dsn, autocommit=True) as conn:
        populate(conn, s)
        conn.execute("SET jit = off")
        conn.execute("SET plan_cache_mode = force_generic_plan")

        now = datetime.now(UTC)
        # The running workflows (as many as the fleet's slots), through an index that holds only them.
        plan = generic_plan(conn, schema, sql.QUEUES, {"queues": 200, "cap": 10_000})
        check(plan, "workflows_due")
        assert reads_only_running(plan), plan
        # The running workflows again, for the workers' page.
        plan = generic_plan(conn, schema, sql.WORKERS, {"workers": 500, "running": 20_000})
        check(plan)
        assert reads_only_running(plan), plan
        plan = generic_plan(conn, schema, sql.THROUGHPUT, {"window": 3600.0, "sample": 20_000})
        check(plan, "workflows_finished")
        check(generic_plan(conn, schema, sql.ESTIMATE, {"table": f"{s}.workflows"}))
        plan = generic_plan(conn, schema, sql.WORKFLOW, {"id": "w1", "big": 262144, "small": 8192, "steps": 2000,
                                                         "rows": 200, "depth": 8})
        check(plan, "workflows_pkey", "steps_pkey", "step_attempts_pkey", "step_errors_pkey", "events_pkey",
              "messages_by_workflow", "messages_by_sender", "stream_ids_workflow_id_key", CHUNK_INDEX,
              "workflows_parent")
        check(generic_plan(conn, schema, sql.FINGERPRINT, {"id": "w1"}), "workflows_pkey", "steps_pkey",
              "messages_by_workflow")
        check(generic_plan(conn, schema, sql.CHUNKS, {"stream": 1, "offset": 0, "rows": 100, "small": 8192}),
              CHUNK_INDEX)

        # Every combination of the list's filters, with and without a lower time bound: read newest
        # first along the index of creation time, sorting nothing (no filter has an index of its own).
        values = {"name": "n7", "queue": "q1", "status": "failed", "since": now, "at": now, "after": "",
                  "limit": 50, "scan": 5000}
        for mask in range(8):
            given = tuple(f for i, f in enumerate(sql.FILTERS) if mask & (1 << i))
            for since in (False, True):
                page = generic_plan(conn, schema, sql.list_statement("{s}", given, since), values)
                check(page, "workflows_created_id")
                assert "Sort" not in page, page
                edge = generic_plan(conn, schema, sql.edge_statement("{s}", since), values)
                check(edge, "workflows_created_id")
                assert "Sort" not in edge, edge
