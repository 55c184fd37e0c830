"""pgflow.testing: the fixture's schema and worker, running until idle, and the virtual clock."""

from __future__ import annotations

import time

import pytest

import pgflow
from pgflow.testing import PgflowEnv

app = pgflow.App()
attempts: list[int] = []


@app.step(max_attempts=3, backoff=3600, backoff_rate=2, max_backoff=86400)
def flaky(x: int) -> int:
    attempts.append(pgflow.step_attempt())
    if pgflow.step_attempt() < 3:
        raise ConnectionError("not yet")
    return x * 2


@app.workflow
async def month(x: int) -> dict:
    await pgflow.sleep_async(86400)
    doubled = await flaky(x)
    await pgflow.set_event_async("doubled", doubled)
    reply = await pgflow.recv_async("approval", timeout=7 * 86400)
    await pgflow.sleep_async(20 * 86400)
    return {"doubled": doubled, "reply": reply}


@pytest.fixture
def pgflow_app() -> pgflow.App:
    return app


@pytest.fixture
def pgflow_dsn(dsn: str) -> str:
    return dsn


def test_a_month_in_a_second(pgflow_env: PgflowEnv) -> None:
    attempts.clear()
    began = time.monotonic()
    handle = month.start(21)
    pgflow_env.clock.advance(days=30)
    assert handle.status() == "succeeded"
    assert handle.result(timeout=5) == {"doubled": 42, "reply": None}
    took = time.monotonic() - began
    assert attempts == [1, 2, 3]
    assert pgflow_env.events(handle) == {"doubled": 42}
    print("took", took, [(s.position, s.name) for s in pgflow_env.steps(handle)])
    assert took < 2.0
