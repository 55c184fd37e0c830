"""Where the calling code runs: its workflow's id, the workflow's attempt and the step's attempt.

Each raises RuntimeError when called outside a workflow or step that a worker runs, rather than making
up an answer: code that needs them is code that only makes sense inside one.
"""

from __future__ import annotations

from ._core.execution import running
from ._core.step_body import inside_step

__all__ = ["attempt", "step_attempt", "workflow_id"]


def workflow_id() -> str:
    """The id of the workflow the calling code runs in (a step's is its workflow's)."""
    return running("workflow_id()").workflow_id


def attempt() -> int:
    """The workflow's attempt: 1 on its first run, one more after each run that a crash, a stop or a
    lost lease interrupted, counted against ``max_attempts``. Picking a sleeping or waiting workflow
    up again is not a new attempt, and ``resume()`` starts the count afresh."""
    return running("attempt()").run


def step_attempt() -> int:
    """Inside a step: its attempt, 1 on the first run and one more per retry. In the workflow body
    (which is no step) this raises, since there is no step attempt to give."""
    running("step_attempt()")
    run = inside_step.get()
    if run is None:
        raise RuntimeError("pgflow.step_attempt() can only be called inside a step; the workflow body's own "
                           "attempt is pgflow.attempt()")
    return run.step_attempt
