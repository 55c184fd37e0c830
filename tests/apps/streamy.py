"""Workflows that write streams, served by worker processes of their own in the stream fault tests.

Every workflow writes a deterministic sequence, so a reader can check that it saw every chunk exactly
once and in order, whatever happened to the writer in between. Each one holds still before its last
chunk until a gate file exists, so a test knows the writer cannot have finished before it kills the
worker, terminates a connection or restarts the server. ``pace`` seconds pass between chunks, so a
stream is still being written while the test does that.

A worker process serves ``app`` (configured from PGFLOW_DSN and PGFLOW_SCHEMA); the test process calls
``build`` on its own App. Both register the same functions from this module, so the workflow and step
names (module + qualname) match. See tests/apps/crashy.py for the same pattern.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import anyio

import pgflow

SEQ = "seq"  # the stream key of the sequence workflows
GATE_POLL = 0.02  # seconds between looks at a gate file
GATE_LIMIT = 120.0  # seconds a workflow waits for its gate before giving up (a test that died)


async def wait_for_file(path: str) -> None:
    deadline = time.monotonic() + GATE_LIMIT
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no gate file {path} after {GATE_LIMIT}s")
        await anyio.sleep(GATE_POLL)


def wait_for_file_sync(path: str) -> None:
    deadline = time.monotonic() + GATE_LIMIT
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no gate file {path} after {GATE_LIMIT}s")
        time.sleep(GATE_POLL)


def build(app: pgflow.App) -> SimpleNamespace:
    # -- the sequence 0..n-1 written from the workflow body: replayed deterministically ---------------

    @app.workflow
    async def body_seq(n: int, gate: str, pace: float) -> int:
        for i in range(n):
            if i == n - 1:
                await wait_for_file(gate)
            await pgflow.write_stream_async(SEQ, i)
            if pace:
                await anyio.sleep(pace)
        await pgflow.close_stream_async(SEQ)
        return n

    @app.workflow
    def body_seq_sync(n: int, gate: str, pace: float) -> int:
        for i in range(n):
            if i == n - 1:
                wait_for_file_sync(gate)
            pgflow.write_stream(SEQ, i)
            if pace:
                time.sleep(pace)
        pgflow.close_stream(SEQ)
        return n

    # -- the same sequence written by one step that resumes from stream_offset ------------------------

    @app.step
    async def resumable(n: int, gate: str, pace: float) -> int:
        start = pgflow.stream_offset(SEQ)
        for i in range(start, n):
            if i == n - 1:
                await wait_for_file(gate)
            await pgflow.write_stream_async(SEQ, i)
            if pace:
                await anyio.sleep(pace)
        return start

    @app.step
    def resumable_sync(n: int, gate: str, pace: float) -> int:
        start = pgflow.stream_offset(SEQ)
        for i in range(start, n):
            if i == n - 1:
                wait_for_file_sync(gate)
            pgflow.write_stream(SEQ, i)
            if pace:
                time.sleep(pace)
        return start

    @app.workflow
    async def step_seq(n: int, gate: str, pace: float) -> int:
        """Returns where the step's successful run started: above 0 when it resumed a killed run."""
        start = await resumable(n, gate, pace)
        await pgflow.close_stream_async(SEQ)
        return start

    @app.workflow
    def step_seq_sync(n: int, gate: str, pace: float) -> int:
        start = resumable_sync(n, gate, pace)
        pgflow.close_stream(SEQ)
        return start

    # -- one workflow, many keys: each phase is one batch of len(keys) chunks -------------------------

    @app.workflow
    async def fan_out(keys: list[str], gate: str) -> int:
        async def each(write: object, *args: object) -> None:
            async with anyio.create_task_group() as tg:
                for key in keys:
                    tg.start_soon(write, key, *args)  # type: ignore[arg-type]

        await each(pgflow.write_stream_async, 0)
        await wait_for_file(gate)
        await each(pgflow.write_stream_async, 1)
        await each(pgflow.close_stream_async)
        return len(keys)

    return SimpleNamespace(
        body_seq=body_seq, body_seq_sync=body_seq_sync, resumable=resumable,
        resumable_sync=resumable_sync, step_seq=step_seq, step_seq_sync=step_seq_sync, fan_out=fan_out,
        seq={"async": body_seq, "sync": body_seq_sync, "async step": step_seq, "sync step": step_seq_sync},
    )


# env-configured; connects lazily, so only a worker process serving it connects. A short poll: a
# worker that takes over from a killed one finds the expired lease soon.
app = pgflow.App(poll_interval=0.2)
flows = build(app)
