"""Celery's habits, durably: ``eta=`` beside ``delay=``, ``expires=``, and a retry policy on the workflow."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import psycopg
import pytest

import pgflow

pytestmark = pytest.mark.anyio

async def server_now(dsn: str) -> datetime:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        row = await (await conn.execute("SELECT now()")).fetchone()
        assert row is not None
        return row[0]  # type: ignore[no-any-return]

async def test_eta_starts_at_that_time_and_bad_timings_are_refused_before_anything_is_written(
        app: pgflow.App, dsn: str) -> None:
    started: list[datetime] = []

    @app.workflow(name="t.at")
    async def at() -> str:
        started.append(datetime.now(UTC))
        return "ran"

    naive = datetime.now() + timedelta(seconds=5)  # noqa: DTZ005 - the point of the test
    soon = datetime.now(UTC) + timedelta(seconds=5)
    for options, error in (({"eta": naive}, "timezone-aware"), ({"eta": "tomorrow"}, "datetime"),
                           ({"eta": soon, "delay": 3.0}, "not both"),
                           ({"eta": datetime.now(UTC) + timedelta(days=3700)}, "ten years"),
                           ({"expires": naive}, "timezone-aware"), ({"expires": 0}, "above 0"),
                           ({"expires": float("nan")}, "above 0"), ({"expires": True}, "datetime or a number"),
                           ({"delay": 5.0, "expires": 2.0}, "never run"),
                           ({"eta": soon, "expires": soon - timedelta(seconds=1)}, "never run")):
        with pytest.raises((TypeError, ValueError), match=error):
            await at.with_options(**options).start_async()
    with pytest.raises(ValueError, match="not both"):
        await at.with_options(delay=3.0).with_options(eta=soon).start_async()
    assert await app.list_workflows_async() == []

    eta = (await server_now(dsn)) + timedelta(seconds=2)
    handle = await at.with_options(eta=eta).start_async()
    [record] = await app.list_workflows_async()
    assert record.due_at == eta  # stored as given, not converted through this process's clock
    async with app.worker(concurrency=2):
        assert await handle.result_async(timeout=60) == "ran"
    info = await handle.info_async()
    assert info.record.started_at is not None and info.record.started_at >= eta

@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_expires_cancels_a_workflow_not_started_in_time_even_when_claimed_late(
        app: pgflow.App, dsn: str, kind: str) -> None:
    ran: list[str] = []

    if kind == "async":
        @app.workflow(name="t.job")
        async def job(tag: str, nap: float) -> str:
            ran.append(tag)
            await pgflow.sleep_async(nap)
            return tag
    else:
        @app.workflow(name="t.job")
        def job(tag: str, nap: float) -> str:
            ran.append(tag)
            pgflow.sleep(nap)
            return tag

    late = await job.with_options(expires=1.0).start_async("late", 0.0)
    at = datetime.now(UTC) + timedelta(seconds=1.5)
    late_at = await job.with_options(expires=at).start_async("late-at", 0.0)
    [expiry] = {r.expires_at for r in await app.list_workflows_async() if r.id == late.id}
    assert expiry is not None
    while await server_now(dsn) <= max(expiry, at):  # no worker runs meanwhile: both are claimed late
        await anyio.sleep(0.1)
    async with app.worker(concurrency=4):
        for handle in (late, late_at):
            with pytest.raises(pgflow.WorkflowCancelled, match="had not started by its expiry time") as info:
                await handle.result_async(timeout=60)
            assert "never ran" in (info.value.reason or "")
            assert (await handle.info_async()).record.error_type == "pgflow.errors.WorkflowExpired"
        # Started before its expiry, it runs to its end although its sleep outlasts the expiry.
        on_time = await job.with_options(expires=30.0).start_async("on-time", 0.0)
        assert await on_time.result_async(timeout=60) == "on-time"
    assert ran == ["on-time"]

@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_workflow_retry_policy_reruns_the_body_from_its_journal_with_backoff(
        app: pgflow.App, kind: str) -> None:
    calls: dict[str, list[float]] = {"before": [], "flaky": [], "always": [], "wrong": []}

    @app.step(name="t.before")
    def before(tag: str) -> str:
        calls["before"].append(time.monotonic())
        return tag

    @app.step(name="t.flaky")
    def flaky(fails: int) -> int:
        calls["flaky"].append(time.monotonic())
        if len(calls["flaky"]) <= fails:
            raise ConnectionError(f"down ({len(calls['flaky'])})")
        return len(calls["flaky"])

    policy = pgflow.RetryPolicy(max_attempts=3, backoff=0.4, backoff_rate=2.0, retry_on=(ConnectionError,))

    if kind == "async":
        @app.workflow(name="t.flow", retry=policy)
        async def flow(fails: int) -> int:
            await before("x")
            return await flaky(fails)

        @app.workflow(name="t.wrong", retry=policy)
        async def wrong() -> None:
            calls["wrong"].append(time.monotonic())
            raise ValueError("not retried: retry_on is ConnectionError")
    else:
        @app.workflow(name="t.flow", retry=policy)
        def flow(fails: int) -> int:
            before("x")
            return flaky(fails)

        @app.workflow(name="t.wrong", retry=policy)
        def wrong() -> None:
            calls["wrong"].append(time.monotonic())
            raise ValueError("not retried: retry_on is ConnectionError")

    with pytest.raises(pgflow.ConfigurationError, match="RetryPolicy"):
        app.workflow(name="t.bad", retry=3)(lambda: None)  # type: ignore[call-overload]

    async with app.worker(concurrency=4):
        ok = await flow.start_async(2)
        assert await ok.result_async(timeout=60) == 3
        info = await ok.info_async()
        assert info.record.retries == 2 and info.record.status == "succeeded" and info.record.error_type is None
        assert [(s.name, s.error_type) for s in info.steps] == [("t.before", None), ("t.flaky", None)]
        assert len(calls["before"]) == 1  # recorded: replayed, never run again
        first, second, third = calls["flaky"]
        assert second - first >= 0.2 and third - second >= 0.4  # each wait at least half its backoff

        calls["flaky"].clear()
        given_up = await flow.start_async(10)
        with pytest.raises(pgflow.WorkflowFailed, match="down \\(3\\)"):
            await given_up.result_async(timeout=60)
        assert (await given_up.info_async()).record.retries == 2 and len(calls["flaky"]) == 3

        once = await wrong.start_async()
        with pytest.raises(pgflow.WorkflowFailed, match="not retried"):
            await once.result_async(timeout=60)
        assert (await once.info_async()).record.retries == 0 and len(calls["wrong"]) == 1

async def test_a_workflow_waiting_to_be_retried_can_be_cancelled(app: pgflow.App) -> None:
    @app.workflow(name="t.doomed", retry=pgflow.RetryPolicy(max_attempts=5, backoff=600.0, max_backoff=600.0))
    async def doomed() -> None:
        raise ConnectionError("down")

    async with app.worker(concurrency=2):
        handle = await doomed.start_async()
        while (await handle.info_async()).record.retries == 0:
            await anyio.sleep(0.05)
        record = (await handle.info_async()).record
        assert record.status == "queued" and record.error_type == "ConnectionError"
        assert record.due_at is not None and record.due_at > datetime.now(UTC) + timedelta(seconds=200)
        await handle.cancel_async()
        with pytest.raises(pgflow.WorkflowCancelled):
            await handle.result_async(timeout=30)

def _unused(*_: Any) -> None: ...
