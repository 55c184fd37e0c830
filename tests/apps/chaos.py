"""The mixed load of the fault suite (tests/chaos.py): multi-step workflows that stream as they go, a
step that fails once and is retried, workflows the suite cancels midway; served by worker processes.

Every step execution appends ``workflow-id position attempt`` to the side-effect file named by
CHAOS_LOG (the attempt is the workflow's, the fencing token), so the suite can tell whether a step ran
again after its output was recorded: that would be a line with a later attempt than the one the
journal recorded the step under.
"""

from __future__ import annotations

import os
import random

import anyio

import pgflow
from pgflow._core.current import current_execution

STREAM = "progress"


def note(line: str) -> None:
    with open(os.environ["CHAOS_LOG"], "a", encoding="utf-8") as f:
        f.write(line + "\n")


class Flaky(Exception):
    """Raised by the first run of every fifth workflow's second step: step retries under faults."""


def build(app: pgflow.App) -> pgflow.Workflow[..., list[str]]:
    """Register the load on ``app``: the worker processes and the suite's own App both call this, so
    the names match."""

    @app.step(max_attempts=5, backoff=0.05)
    async def work(seed: int, position: int) -> str:
        execution = current_execution.get()
        assert execution is not None
        note(f"{execution.workflow_id} {position} {execution.attempt}")
        await anyio.sleep(random.uniform(0.0, 0.05))
        if seed % 5 == 0 and position == 1:
            try:  # the first run of this step fails, wherever it runs
                with open(f"{os.environ['CHAOS_LOG']}.{execution.workflow_id}.flaked", "x"):
                    pass
            except FileExistsError:
                pass
            else:
                raise Flaky(f"seed {seed} step {position}")
        return f"{seed}:{position}"

    @app.workflow(max_attempts=1000)
    async def mixed(seed: int, steps: int, chunks_per_step: int) -> list[str]:
        outputs = []
        written = 0
        for position in range(steps):
            outputs.append(await work(seed, position))
            for _ in range(chunks_per_step):
                await pgflow.write_stream_async(STREAM, written)
                written += 1
        await pgflow.close_stream_async(STREAM)
        return outputs

    return mixed


def expected(seed: int, steps: int) -> list[str]:
    return [f"{seed}:{position}" for position in range(steps)]


app = pgflow.App(poll_interval=0.5, query_timeout=float(os.environ.get("CHAOS_QUERY_TIMEOUT", "10")))
mixed = build(app)
