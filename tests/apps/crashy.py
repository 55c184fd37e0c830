"""Workflows for the crash and shutdown tests, served by worker processes of their own.

Every step appends a line to a side-effect file whose path the test passes in, so the test can count
how often each step body really ran. The middle step blocks until a gate file exists, which holds the
workflow at a known point while the test kills or stops the worker process running it.

A worker process serves ``app`` (configured from PGFLOW_DSN and PGFLOW_SCHEMA); the test process calls
``build`` on its own App. Both register the same functions from this module, so the workflow and step
names (module + qualname) match.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import anyio

import pgflow

GATE_POLL = 0.05  # seconds between looks at the gate file inside a blocked step


def note(path: str, line: str) -> None:
    """Append one line to the side-effect file; a line per call, flushed before returning."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def build(app: pgflow.App) -> SimpleNamespace:
    @app.step
    def first(path: str, n: int) -> int:
        note(path, "s1")
        return n + 1

    @app.step
    async def second_async(path: str, gate: str, n: int) -> int:
        note(path, "s2 start")
        while not Path(gate).exists():
            await anyio.sleep(GATE_POLL)
        note(path, "s2 done")
        return n * 10

    @app.step
    def second_sync(path: str, gate: str, n: int) -> int:
        note(path, "s2 start")
        while not Path(gate).exists():
            time.sleep(GATE_POLL)
        note(path, "s2 done")
        return n * 10

    @app.step
    async def third(path: str, n: int) -> int:
        note(path, "s3")
        return n + 7

    @app.workflow
    async def async_flow(path: str, gate: str, n: int) -> int:
        a = await first(path, n)
        b = await second_async(path, gate, a)
        return await third(path, b)

    @app.workflow
    def sync_flow(path: str, gate: str, n: int) -> int:
        # A sync workflow calls its steps plainly. Its gated step is a def step too, so while it is
        # blocked both the workflow and the step body are threads, which a worker cannot cancel.
        a = first(path, n)
        b = second_sync(path, gate, a)
        return third(path, b)

    # The two mixed flavours: the blocked step is of the other kind than its workflow.
    @app.workflow
    def sync_flow_async_step(path: str, gate: str, n: int) -> int:
        a = first(path, n)
        b = second_async(path, gate, a)
        return third(path, b)

    @app.workflow
    async def async_flow_sync_step(path: str, gate: str, n: int) -> int:
        a = await first(path, n)
        b = await second_sync(path, gate, a)
        return await third(path, b)

    return SimpleNamespace(
        first=first, second_async=second_async, second_sync=second_sync, third=third,
        async_flow=async_flow, sync_flow=sync_flow,
        flows={"async": async_flow, "sync": sync_flow, "sync+async step": sync_flow_async_step,
               "async+sync step": async_flow_sync_step},
        gated={"async": second_async, "sync": second_sync, "sync+async step": second_async,
               "async+sync step": second_sync},
    )


def expected(n: int) -> int:
    """What async_flow and sync_flow return for ``n``."""
    return (n + 1) * 10 + 7


app = pgflow.App()  # env-configured; connects lazily, so only a worker process serving it connects
flows = build(app)
