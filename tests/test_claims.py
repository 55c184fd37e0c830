"""The plans of the claim and of the end batch. A claim reads each queue in index order however many
queues a worker serves and finds the next due time from the index, so its cost stays flat as a
backlog grows; both find their rows by the primary key, once each, so their cost grows with the
batch and not with its square."""

from __future__ import annotations

import re

import psycopg
import pytest
from psycopg import sql as sql_

import pgflow
from pgflow._core.engine import quote_identifier
from pgflow._core.engine.claims import CLAIM, FULL_CLAIM
from pgflow._core.engine.ends import FINISH, FINISH_ONE

pytestmark = pytest.mark.anyio


def positional(statement: str, schema: str, names: list[str]) -> str:
    """One of pgflow's statements for ``schema``, its named parameters made ``$1``, ``$2``... in the
    order of ``names`` (as PREPARE takes them)."""
    sql = statement.replace("{s}", quote_identifier(schema))
    for n, name in enumerate(names, 1):
        sql = sql.replace(f"%({name})s", f"${n}")
    return sql


def plan(dsn: str, schema: str, queues: list[str], full: bool = True) -> str:
    """The claim's plan as pgflow's connections run it: prepared, and planned once for any values
    (a generic plan: the planner cannot see the limit or the queues)."""
    sql = positional(FULL_CLAIM if full else CLAIM, schema,
                     ["queues", "floors", "names", "limit", "owner", "lease", "token", "commit"])
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET jit = off")
        conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.execute(f"PREPARE claim(text[], timestamptz[], text[], int, text, float8, int8, text) AS {sql}")
        cur = conn.execute(sql_.SQL("EXPLAIN EXECUTE claim({}, {}, {}, 16, 'probe', 10.0, 1, 'off')").format(
            sql_.Literal(queues), sql_.Literal([None] * len(queues)), sql_.Literal(["n.a", "n.b"])))
        return "\n".join(row[0] for row in cur.fetchall())


def subtree(plan: str, node: str) -> str:
    """The lines of ``plan`` (EXPLAIN's text) from the one that starts with ``node`` to its last child."""
    lines = plan.splitlines()
    start = next(n for n, line in enumerate(lines) if line.strip().startswith(node))
    depth = len(lines[start]) - len(lines[start].lstrip())
    end = next((n for n in range(start + 1, len(lines))
                if len(lines[n]) - len(lines[n].lstrip()) <= depth), len(lines))
    return "\n".join(lines[start:end])


@pytest.mark.parametrize(("queues", "rows", "spread"), [
    (["q0"], 30_000, 4), (["q0", "q1", "q2"], 30_000, 4),
    # One deep queue: the planner then expects the claimed set to be large, and once joined the
    # whole table to it by a hash join over a scan of every row (a 100K backlog drained 8x slower).
    (["q0"], 120_000, 1),
])
@pytest.mark.parametrize("full", [True, False], ids=["full", "bounded"])
async def test_a_claim_reads_each_queue_through_its_index_and_scans_no_table(
    app: pgflow.App, dsn: str, schema: str, queues: list[str], rows: int, spread: int, full: bool,
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
    text = plan(dsn, schema, queues, full)
    assert "Seq Scan on workflows" not in text, text
    queued = subtree(text, "CTE queued")
    # One ordered index scan, run once per queue of the unnest (no sort of a whole queue's rows).
    assert "Nested Loop" in queued and "Index Scan using workflows_queued" in queued, text
    assert "Sort" not in queued, text
    assert "Index Scan using workflows_due" in text, text  # the next due time: one index entry a queue
    assert_found_by_the_key(text)
    # Only a full claim takes workflows over: the others have no scan for expired leases, nor for the
    # fences of the workers it would take them from, in their plans at all.
    assert ("CTE expired" in text and "CTE fenced" in text) == full, text


def assert_found_by_the_key(plan: str) -> None:
    """The claimed rows are found by the primary key, one probe per chosen row: not by a scan of the
    table, nor by probes that each try the whole set of chosen ids (on PostgreSQL 15 a descent per id
    per row: 4,096 for a claim of 64, half of its time)."""
    claimed = subtree(plan, "CTE claimed")
    assert "Index Cond: (id = ch.id)" in claimed, plan
    assert "Seq Scan" not in claimed and "ANY" not in claimed, plan


async def test_a_claim_finds_its_rows_by_the_key_once_when_few_are_queued(
    app: pgflow.App, dsn: str, schema: str,
) -> None:
    """On a table whose statistics hold few queued workflows (a drained backlog, the usual state),
    the planner expects a claim of one row."""
    await app.migrate_async()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'INSERT INTO "{schema}".workflows (id, name, queue, inputs, due_at, status)'
                     f" SELECT 'w' || i, 'n.a', 'q0', '\\x80'::bytea, now(),"
                     "  CASE WHEN i <= 64 THEN 'queued' ELSE 'succeeded' END FROM generate_series(1, 30000) AS i")
        conn.execute(f'ANALYZE "{schema}".workflows')
    assert_found_by_the_key(plan(dsn, schema, ["q0"]))
    assert_found_by_the_key(plan(dsn, schema, ["q0"], full=False))


async def test_a_claim_planned_on_a_new_table_does_not_scan_it_as_it_grows(
    app: pgflow.App, dsn: str, schema: str,
) -> None:
    """A worker's connection plans the claim once, at its first claim, often on a table just made:
    empty and never analyzed. That plan is kept for as long as the connection lives, so the table it
    expects is tiny while the real one grows by every workflow run (matched against an array of the
    chosen ids, such a plan scanned the whole table on every claim: quadratic until the first ANALYZE)."""
    await app.migrate_async()
    assert_found_by_the_key(plan(dsn, schema, ["q0"]))
    assert_found_by_the_key(plan(dsn, schema, ["q0"], full=False))


async def test_a_batch_of_ends_joins_each_workflow_to_its_own_end_once(
    app: pgflow.App, dsn: str, schema: str,
) -> None:
    """The end batch's generic plan, run on 32 claimed workflows (rolled back): every row is found
    by the primary key and joined to its own end, not to a scan of every end of the batch (which
    made a batch of 64 twice as slow)."""
    await app.migrate_async()
    n = 32
    sql = positional(FINISH, schema, ["ids", "leases", "statuses", "outputs", "errors", "n", "pings_channels", "pings"])
    with psycopg.connect(dsn, autocommit=True) as conn:
        # (among 30,000 others, so that the planner's choices are those of a table in use)
        conn.execute(f'INSERT INTO "{schema}".workflows (id, name, queue, inputs, due_at, status, lease_token)'
                     f" SELECT 'w' || i, 'n.a', 'q0', '\\x80'::bytea, now(),"
                     f"  CASE WHEN i <= {n} THEN 'running' ELSE 'succeeded' END, i"
                     f" FROM generate_series(1, 30000) AS i")
        conn.execute(f'ANALYZE "{schema}".workflows')
        conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.execute(f"PREPARE finish(text[], int8[], text[], bytea[], text[], int, text[], text[]) AS {sql}")
        with conn.transaction(force_rollback=True):
            run = "EXPLAIN (ANALYZE, COSTS OFF) EXECUTE finish({}, {}, {}, {}, {}, {}, '{{}}', '{{}}')"
            cur = conn.execute(sql_.SQL(run).format(
                sql_.Literal([f"w{i}" for i in range(1, n + 1)]),
                sql_.Literal(list(range(1, n + 1))), sql_.Literal(["succeeded"] * n),
                sql_.Literal([b"\xc0"] * n), sql_.Literal([None] * n), sql_.Literal(n)))
            text = "\n".join(row[0] for row in cur.fetchall())
    done = subtree(text, "CTE done")
    assert re.search(rf"Update on workflows .* rows={n}(\.00)? loops=1", done), text  # every end recorded
    assert "Seq Scan" not in done and "Index Scan using workflows_pkey" in done, text
    assert "Rows Removed by Join Filter" not in done, text


@pytest.mark.parametrize("rows", [0, 30_000], ids=["new table", "table in use"])
async def test_a_lone_end_finds_its_workflow_by_the_key(app: pgflow.App, dsn: str, schema: str, rows: int) -> None:
    """The end of one workflow alone, planned once for any values on a new table as on one in use,
    looks its workflow up by the primary key, not through an index of running workflows (which a long
    transaction fills with every version that was ever running)."""
    await app.migrate_async()
    sql = positional(FINISH_ONE, schema, ["id", "lease", "status", "output", "error", "pings_channels", "pings"])
    with psycopg.connect(dsn, autocommit=True) as conn:
        if rows:
            conn.execute(f'INSERT INTO "{schema}".workflows (id, name, queue, inputs, due_at, status, lease_token)'
                         f" SELECT 'w' || i, 'n.a', 'q0', '\\x80'::bytea, now(),"
                         "  CASE WHEN i <= 8 THEN 'running' ELSE 'succeeded' END, i"
                         f" FROM generate_series(1, {rows}) AS i")
            conn.execute(f'ANALYZE "{schema}".workflows')
        conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.execute(f"PREPARE finish_one(text, int8, text, bytea, text, text[], text[]) AS {sql}")
        text = "\n".join(row[0] for row in conn.execute(
            "EXPLAIN (COSTS OFF) EXECUTE finish_one('w1', 1, 'succeeded', '\\xc0', NULL, '{}', '{}')").fetchall())
    assert "Index Scan using workflows_pkey on workflows w" in text and "Seq Scan" not in text, text


async def test_a_worker_given_a_queue_twice_runs_each_workflow_once(app: pgflow.App) -> None:
    """A queue named twice is served once: the claim reads each queue once, so it cannot hand the
    same workflow out twice in one answer."""
    runs: dict[int, int] = {}

    @app.workflow(name="twice.counted", queue="twice")
    async def counted(i: int) -> int:
        runs[i] = runs.get(i, 0) + 1
        return i

    await app.migrate_async()
    handles = await counted.start_many_async([(i,) for i in range(40)])
    async with app.worker(concurrency=16, queues=["twice", "twice"]) as worker:
        assert worker.queues == ["twice"]
        assert [await h.result_async(timeout=30) for h in handles] == list(range(40))
    assert runs == {i: 1 for i in range(40)}, runs
