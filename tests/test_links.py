"""Links that die without a word (issue 11, B and C): a proxy that stops forwarding, connections reset
under a worker, a session of pgflow's left idle in a transaction by a paused process. Real server and
real sockets: the proxy (tests/proxy.py) sits between pgflow and PostgreSQL on 127.0.0.1."""

from __future__ import annotations

import anyio
import psycopg
import psycopg.errors
import pytest

import pgflow
from pgflow._core.connecting import linked

from .proxy import proxy_to

pytestmark = pytest.mark.anyio

WAIT = 60.0
QUERY_TIMEOUT = 2.0


async def double(x: int) -> int:
    return 2 * x


async def doubled(x: int) -> int:
    return await doubled_step(x)


doubled_step: pgflow.Step[..., int]


@pytest.mark.parametrize("fault", ["freeze", "reset"])
async def test_a_worker_whose_links_die_carries_on_over_new_ones(dsn: str, schema: str, fault: str) -> None:
    """Before: with its links frozen, the worker's claim and heartbeat waited in psycopg for ever and
    no workflow started after the freeze ever finished."""
    global doubled_step
    with proxy_to(dsn) as proxy:
        behind = pgflow.App(proxy.dsn(dsn), schema=schema, poll_interval=0.5, query_timeout=QUERY_TIMEOUT)
        caller = pgflow.App(dsn, schema=schema, poll_interval=0.5)
        try:
            for app in (caller, behind):  # the worker's step last: the workflow body calls that one
                doubled_step = app.step(double)
                workflow = app.workflow(doubled)
            async with behind.worker(concurrency=4, lease=2 * QUERY_TIMEOUT):
                with anyio.fail_after(WAIT):
                    assert await (await workflow.start_async(1)).result_async() == 2
                broken = proxy.freeze() if fault == "freeze" else proxy.reset()
                assert broken >= 2  # at least the pool's connection and the maintenance session
                accepted = proxy.accepted
                handles = [await workflow.start_async(x) for x in range(5)]
                with anyio.fail_after(WAIT):
                    assert [await h.result_async() for h in handles] == [0, 2, 4, 6, 8]
                assert proxy.accepted > accepted  # the work went on over new links
        finally:
            await behind.close_async()
            await caller.close_async()


async def test_a_session_left_idle_in_a_transaction_cannot_hold_a_workflow_past_the_bound(
        dsn: str, schema: str) -> None:
    """A process paused inside one of pgflow's transactions (a claim under queue limits holds the
    rows it claims) keeps its locks for as long as it stays paused, unless the server ends the
    session: pgflow's sessions carry idle_in_transaction_session_timeout = query_timeout."""
    app = pgflow.App(dsn, schema=schema, poll_interval=0.5, query_timeout=QUERY_TIMEOUT)
    try:
        workflow = app.workflow(double)
        handle = await workflow.start_async(21)
        paused = await psycopg.AsyncConnection.connect(linked(dsn, QUERY_TIMEOUT), autocommit=True)
        async with paused:
            await paused.execute("BEGIN")
            await paused.execute(f'SELECT FROM "{schema}".workflows WHERE id = %s FOR UPDATE', (handle.id,))
            # The paused session says nothing more; the worker's claims skip the locked row until the
            # server ends that session.
            async with app.worker(concurrency=1, lease=2 * QUERY_TIMEOUT):
                with anyio.fail_after(WAIT):
                    assert await handle.result_async() == 42
            with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout):
                await paused.execute("SELECT 1")
    finally:
        await app.close_async()


async def test_every_pgflow_session_carries_the_bounds(dsn: str, schema: str) -> None:
    app = pgflow.App(dsn, schema=schema, query_timeout=3.0)
    try:
        store = await app._client.runtime().store()
        async with store.pool.connection() as conn:
            cur = await conn.execute("SELECT current_setting('idle_in_transaction_session_timeout'),"
                                     " current_setting('plan_cache_mode')")
            assert await cur.fetchone() == ("3s", "force_generic_plan")
            assert conn.info.get_parameters().get("tcp_user_timeout") == "3000"
    finally:
        await app.close_async()


async def test_a_query_with_no_answer_is_abandoned_within_the_timeout(dsn: str, schema: str) -> None:
    """The pool's own deadline, seen directly: a statement that outlasts it fails as a lost
    connection (which pgflow's operations retry) and the pool drops that connection."""
    app = pgflow.App(dsn, schema=schema, query_timeout=1.0)
    try:
        store = await app._client.runtime().store()
        with anyio.fail_after(WAIT):
            with pytest.raises(psycopg.OperationalError):
                async with store.pool.connection() as conn:
                    await conn.execute("SELECT pg_sleep(30)")
        assert conn.closed
        async with store.pool.connection() as conn:
            await conn.execute("SELECT 1")
    finally:
        await app.close_async()


def test_a_bad_query_timeout_is_refused() -> None:
    with pytest.raises(pgflow.ConfigurationError, match="query_timeout"):
        pgflow.App("postgresql://nowhere/x", query_timeout=0)
