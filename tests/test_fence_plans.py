"""The fenced writes find their workflow through the primary key, whatever the table held when their
plans were made. pgflow's connections plan a statement once for any values
(``plan_cache_mode=force_generic_plan``), and a plan made on a new, unanalysed table lasts until the
table is analyzed. On an empty table the planner preferred the partial indexes of running workflows
for ``id = $1 AND status = 'running'``: harmless while they hold a few dozen entries, but while a long
transaction holds vacuum back they hold every version that was ever running, and each step write
walked them all (benchmarks/README.md, "Long transactions", session 10)."""

from __future__ import annotations

import os
from typing import Any

import anyio
import psycopg
import pytest

import pgflow
from pgflow._core.engine import arrays
from tests.helpers import query, wait_for

# The plans and index counters of a schema just made, never used by an earlier test (tests/recycling.py).
pytestmark = [pytest.mark.anyio, pytest.mark.new_schema]

WORKFLOWS = 40


async def test_fenced_writes_planned_on_an_empty_table_read_no_partial_index_of_running_workflows(
        dsn: str, schema: str) -> None:
    app = pgflow.App(dsn, schema=schema, poll_interval=0.5)

    @app.step(name="fence.first")
    async def first(i: int) -> int:
        return i + 1

    @app.step(name="fence.second")
    async def second(i: int) -> int:
        return i * 2

    @app.workflow(name="fence.flow")
    async def flow(i: int) -> int:
        await pgflow.set_event_async("seen", i)
        return await second(await first(i))

    others = await _sessions(dsn)  # other Apps' of this process, left open by earlier tests
    try:
        await app.migrate_async()  # empty and never analyzed, as a new deployment's table is
        handles = [await flow.start_async(i) for i in range(WORKFLOWS)]
        # (a long lease: no version's lease can expire while it runs, so the claim's look for expired
        # leases reads nothing of workflows_leased on a slow machine either)
        async with app.worker(concurrency=4, lease=300):
            results = [await h.result_async(timeout=60) for h in handles]
        assert results == [(i + 1) * 2 for i in range(WORKFLOWS)]
        ours = await _sessions(dsn) - others
    finally:
        await app.close_async()
    # A backend reports its index reads when it exits: wait until this App's sessions have.
    await wait_for(lambda: _gone(dsn, ours), timeout=30)
    rows = dict(await query(dsn, "SELECT indexrelname, idx_tup_read FROM pg_stat_user_indexes"
                                 " WHERE schemaname = %s AND indexrelname IN"
                                 " ('workflows_running_by_queue', 'workflows_leased')", schema))
    # No queue has limits, so nothing here needs the running workflows by queue; the claim reads
    # the leased index for expired leases only, and none expired.
    assert rows == {"workflows_running_by_queue": 0, "workflows_leased": 0}, rows


async def _sessions(dsn: str) -> set[int]:
    """The server processes of this test process's Apps (their sessions are named after its pid)."""
    rows = await query(dsn, "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s", f"%-{os.getpid()}")
    return {int(row[0]) for row in rows}


async def _gone(dsn: str, pids: set[int]) -> bool:
    return not (await _sessions(dsn) & pids)


# The partial indexes of running workflows: what a write that finds its workflow by id must not walk.
RUNNING_INDEXES = ("workflows_running_by_queue", "workflows_leased")


async def test_every_statement_of_a_run_planned_on_an_empty_table_finds_workflows_by_their_key(
        dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every statement a worker and a caller send in a run that touches most paths (steps, a retried
    step, an event, a message, a stream, a retried workflow, sleeps that give the slot back, lease
    renewals, a run a stop cuts short) is planned again, generic, on an empty schema, and its plan read:
    none but the claim's looks for due and expired workflows may read a partial index of running ones.
    (The first test sees only what a few dozen workflows make psycopg prepare; this one every statement.)"""
    sent: dict[str, Any] = {}
    real_execute = psycopg.AsyncCursor.execute

    async def recording(self: psycopg.AsyncCursor[Any], query: Any, params: Any = None, **kwargs: Any) -> Any:
        if isinstance(query, str):
            sent.setdefault(query, params)
        return await real_execute(self, query, params, **kwargs)

    await _run_every_path(dsn, schema, monkeypatch, recording)
    empty = f"{schema}_empty"
    planned = pgflow.App(dsn, schema=empty)
    try:
        await planned.migrate_async()
    finally:
        await planned.close_async()
    plans = await _generic_plans(dsn, {q.replace(f'"{schema}"', f'"{empty}"'): p for q, p in sent.items()
                                       if f'"{schema}".workflows' in q})
    await query(dsn, f'DROP SCHEMA "{empty}" CASCADE')
    # (each kind of statement was seen and planned: a record of a step, a lease renewal, a give-back)
    for kind in ("INSERT INTO {s}.steps", "SET lease_expires_at = now() + make_interval",
                 "SET status = 'queued', lease_owner = NULL"):
        assert any(kind.format(s=f'"{empty}"') in q and plan for q, plan in plans.items()), kind
    walking = {q: plan for q, plan in plans.items()
               if any(index in plan for index in RUNNING_INDEXES) and not q.startswith("WITH queued AS")
               and "count(*) FROM" not in q}
    assert not walking, "\n\n".join(f"{q}\n{plan}" for q, plan in walking.items())


async def _run_every_path(dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch, recording: Any) -> None:
    app = pgflow.App(dsn, schema=schema, poll_interval=0.5, suspend_after=0.1)
    failed_once: set[int] = set()
    stopped = anyio.Event()

    @app.step(name="paths.flaky", max_attempts=2, backoff=0.01)
    async def flaky(i: int) -> int:
        if pgflow.step_attempt() == 1:
            raise ConnectionError("first try")
        return i

    @app.workflow(name="paths.flow", retry=pgflow.RetryPolicy(max_attempts=2, backoff=0.01))
    async def flow(i: int) -> int:
        await pgflow.set_event_async("seen", i)
        await pgflow.write_stream_async("out", i)
        await pgflow.close_stream_async("out")
        await pgflow.sleep_async(0.3)  # past suspend_after: the slot is given back
        got = await pgflow.recv_async("go", timeout=30)
        if i not in failed_once:
            failed_once.add(i)
            raise RuntimeError("the workflow fails once and is retried")
        return await flaky(i) + int(got)

    @app.workflow(name="paths.stuck")
    async def stuck() -> None:
        stopped.set()
        await anyio.sleep_forever()  # until its worker stops under it

    monkeypatch.setattr(psycopg.AsyncCursor, "execute", recording)
    try:
        await app.migrate_async()
        handles = [await flow.start_async(i) for i in range(3)]
        for handle in handles:
            await handle.send_async("go", 1)
        async with app.worker(concurrency=4, heartbeat=0.1, lease=5):
            assert [await h.result_async(timeout=60) for h in handles] == [1, 2, 3]
            await stuck.start_async()
            with anyio.fail_after(30):
                await stopped.wait()
    finally:
        monkeypatch.undo()
        await app.close_async()


async def _generic_plans(dsn: str, statements: dict[str, Any]) -> dict[str, str]:
    """Each statement's generic plan, as auto_explain reports the plan it ran, on a connection that
    plans as pgflow's do; each run in a transaction rolled back. (Statements that fail on the empty
    schema are left out.)"""
    plans: dict[str, str] = {}
    notices: list[str] = []
    async with await psycopg.AsyncConnection.connect(
            dsn, options="-c plan_cache_mode=force_generic_plan") as conn:
        conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
        arrays.ready(conn)  # (the hot statements send arrays packed beforehand)
        await conn.execute("LOAD 'auto_explain'")
        await conn.execute("SET auto_explain.log_min_duration = 0")
        await conn.execute("SET auto_explain.log_level = notice")
        await conn.execute("SET client_min_messages = notice")
        await conn.commit()
        for statement, params in statements.items():
            notices.clear()
            try:
                await conn.execute(statement, params, prepare=True)
            except psycopg.errors.IntegrityError:  # (a row the empty schema lacks)
                pass
            await conn.rollback()
            plans[statement] = "\n".join(notices)
    return plans
