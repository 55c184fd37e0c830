"""Workflow context (``pgflow.workflow_id``, ``attempt``, ``step_attempt``) and step timeouts, on an
in-process worker, for async and sync workflows and steps alike."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import anyio
import pytest

import pgflow

from .helpers import KINDS, fail_to_end, query, requeue, run_to_end, step_rows

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("kind", KINDS)
async def test_context_inside_a_workflow_and_its_steps(app: pgflow.App, dsn: str, schema: str, kind: str) -> None:
    calls: Counter[str] = Counter()

    def flaky() -> list[Any]:
        calls["step"] += 1
        if calls["step"] < 3:
            raise ValueError("not yet")
        return [pgflow.workflow_id(), pgflow.step_attempt(), pgflow.attempt()]

    if kind == "async":
        @app.step(name="ctx.flaky", max_attempts=3, backoff=0.0)
        async def step() -> list[Any]:
            return flaky()

        @app.workflow(name="ctx.flow")
        async def flow() -> list[Any]:
            inner = await step()
            return [pgflow.workflow_id(), pgflow.attempt(), inner]
    else:
        @app.step(name="ctx.flaky", max_attempts=3, backoff=0.0)
        def step() -> list[Any]:
            return flaky()

        @app.workflow(name="ctx.flow")
        def flow() -> list[Any]:
            inner = step()
            return [pgflow.workflow_id(), pgflow.attempt(), inner]

    handle = await flow.with_options(id=f"ctx-{kind}").start_async()
    assert await run_to_end(app, handle) == [handle.id, 1, [handle.id, 3, 1]]
    # A second run of the workflow (as after a crash) is its second attempt; the step is replayed.
    await requeue(dsn, schema, handle.id)
    assert await run_to_end(app, handle) == [handle.id, 2, [handle.id, 3, 1]]
    assert calls["step"] == 3


@pytest.mark.parametrize("kind", KINDS)
async def test_step_attempt_in_the_workflow_body_says_where_it_belongs(app: pgflow.App, kind: str) -> None:
    if kind == "async":
        @app.workflow(name="ctx.body")
        async def flow() -> int:
            return pgflow.step_attempt()
    else:
        @app.workflow(name="ctx.body")
        def flow() -> int:
            return pgflow.step_attempt()

    failed = await fail_to_end(app, await flow.start_async())
    assert "can only be called inside a step" in failed.message


async def test_context_outside_a_workflow_raises(app: pgflow.App) -> None:
    @app.step(name="ctx.plain")
    def plain() -> str:
        return pgflow.workflow_id()

    for call in (pgflow.workflow_id, pgflow.attempt, pgflow.step_attempt, plain):
        with pytest.raises(RuntimeError, match=r"can only be called inside a workflow or step"):
            call()
    # From a thread as well as from an event loop.
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, pgflow.attempt).value))
    thread.start()
    thread.join()
    assert "can only be called inside a workflow or step" in str(errors[0])


@pytest.mark.parametrize("kind", KINDS)
async def test_step_timeout_fails_the_attempt_and_is_retried(
    app: pgflow.App, dsn: str, schema: str, kind: str,
) -> None:
    """The first attempt hangs past the timeout and is cancelled (a sync one abandoned); the retry
    succeeds. Without the timeout the workflow would hang for a minute."""
    released = threading.Event()
    if kind == "async":
        @app.step(name="ctx.slow", timeout=0.5, max_attempts=2, backoff=0.0)
        async def slow() -> int:
            if pgflow.step_attempt() == 1:
                await anyio.sleep(60)
            return pgflow.step_attempt()
    else:
        @app.step(name="ctx.slow", timeout=0.5, max_attempts=2, backoff=0.0)
        def slow() -> int:
            if pgflow.step_attempt() == 1:
                released.wait(60)
            return pgflow.step_attempt()

    @app.workflow(name="ctx.timed")
    async def flow() -> int:
        return await slow()

    began = time.monotonic()
    try:
        assert await run_to_end(app, await flow.start_async()) == 2
    finally:
        released.set()  # let the abandoned thread end
    assert time.monotonic() - began < 30


@pytest.mark.parametrize("kind", KINDS)
async def test_step_that_always_times_out_fails_with_step_timeout(
    app: pgflow.App, dsn: str, schema: str, kind: str,
) -> None:
    released = threading.Event()
    if kind == "async":
        @app.step(name="ctx.hang", timeout=0.3, max_attempts=2, backoff=0.0)
        async def hang() -> None:
            await anyio.sleep(60)
    else:
        @app.step(name="ctx.hang", timeout=0.3, max_attempts=2, backoff=0.0)
        def hang() -> None:
            released.wait(60)

    @app.workflow(name="ctx.hung")
    async def flow() -> None:
        await hang()

    handle = await flow.start_async()
    try:
        failed = await fail_to_end(app, handle)
    finally:
        released.set()
    assert failed.error_type == "pgflow.errors.StepTimeout"
    assert "did not finish within its timeout of 0.3s (attempt 2)" in failed.message
    [(position, name, attempts, error_type, _, _)] = await step_rows(dsn, schema, handle.id)
    assert (position, name, attempts, error_type) == (0, "ctx.hang", 2, "pgflow.errors.StepTimeout")


async def test_abandoned_sync_step_cannot_write_to_its_stream(app: pgflow.App, dsn: str, schema: str) -> None:
    """A sync step past its timeout runs on in its thread; what it writes afterwards is refused."""
    go_on, wrote = threading.Event(), threading.Event()
    outcome: list[str] = []

    @app.step(name="ctx.writer", timeout=0.3)
    def writer() -> None:
        pgflow.write_stream("out", "before")
        go_on.wait(60)
        try:
            pgflow.write_stream("out", "after")
            outcome.append("written")
        except pgflow.StepTimeout:
            outcome.append("refused")
        finally:
            wrote.set()

    @app.workflow(name="ctx.writes")
    async def flow() -> None:
        await writer()

    handle = await flow.start_async()
    async with app.worker(concurrency=2):
        with pytest.raises(pgflow.WorkflowFailed):
            await handle.result_async(timeout=30)
        go_on.set()
        await anyio.to_thread.run_sync(wrote.wait, 30)
    assert outcome == ["refused"]
    chunks = await query(dsn, f"SELECT count(*) FROM {schema}.streams WHERE workflow_id = %s AND value IS NOT NULL",
                         handle.id)
    assert chunks == [(1,)]


def test_bad_step_timeout_is_refused(app: pgflow.App) -> None:
    for bad in (0, -1.0, True):
        with pytest.raises(pgflow.ConfigurationError, match="timeout"):
            app.step(timeout=bad)(lambda: None)
