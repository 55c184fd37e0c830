"""One attempt of a step's body: under its timeout, in a thread for a sync step, and known to the code
it calls as the inside of a step (``inside_step``: ``pgflow.step_attempt()``, and the journal's refusal
of waits there)."""

from __future__ import annotations

import contextvars
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread

from ..errors import StepTimeout
from .registry import StepSpec


@dataclass(eq=False)
class StepRun:
    """One attempt of one step call: its number (``pgflow.step_attempt()``), and whether its
    execution gave up on it (it ran past its timeout in a thread that cannot be stopped)."""

    step_attempt: int
    abandoned: bool = False


inside_step: ContextVar[StepRun | None] = ContextVar("pgflow_inside_step", default=None)


async def run_step_body(step: StepSpec, run: StepRun, workflow_id: str, args: Any, kwargs: Any) -> Any:
    """One attempt of the step, cut short at its timeout (which fails the attempt)."""
    token = inside_step.set(run)
    try:
        with anyio.move_on_after(step.timeout):
            if step.is_async:
                return await step.fn(*args, **kwargs)
            context = contextvars.copy_context()
            # A thread cannot be interrupted: on cancellation it is abandoned, and fencing refuses
            # anything it tries to write after its workflow was given back (and a timed-out
            # attempt's stream writes are refused by ``RunStreams.put``).
            return await anyio.to_thread.run_sync(lambda: context.run(step.fn, *args, **kwargs),
                                                  abandon_on_cancel=True)
        run.abandoned = True
        raise StepTimeout(f"step {step.name!r} of workflow {workflow_id!r} did not finish within its "
                          f"timeout of {step.timeout}s (attempt {run.step_attempt})")
    finally:
        inside_step.reset(token)
