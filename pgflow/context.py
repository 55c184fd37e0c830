"""Where the calling code runs: its workflow's id, the workflow's attempt and the step's attempt.

Each raises RuntimeError when called outside a workflow or step that a worker runs, rather than making
up an answer: code that needs them is code that only makes sense inside one.
"""

from __future__ import annotations

from ._core.current import running
from ._core.step_body import inside_step

__all__ = ["attempt", "step_attempt", "workflow_id"]


def workflow_id() -> str:
    """The id of the workflow the calling code runs in (a step's is its workflow's)."""
    return running("workflow_id()").workflow_id


def attempt() -> int:
    """The workflow's attempt, counted against ``max_attempts``: 1 on its first run, one more after
    each run cut short by its own doing (its worker process died while running it alone, see the
    README's crash attribution) or by a stop or a lost lease. A run that another workflow's crash cut
    short is run again with the same attempt, and so is one picked up after a sleep or a wait, or
    retried under the workflow's retry policy; ``resume()`` starts the count afresh. Never above
    ``max_attempts``: the workflow is given up instead. The log, ``pgflow workflows show``, the
    dashboard and the records show this same number."""
    return running("attempt()").run


def step_attempt() -> int:
    """Inside a step: its try, counted over every run of the workflow: 1 on the first, one more per
    retry and per try that a crash or a stop cut short (each counted once, as the step's record and
    ``workflows show`` count them). The step's ``max_attempts`` bounds the tries of one run: a try
    another workflow's crash cut short costs it no retry. In the workflow body (which is no step) this
    raises, since there is no step attempt to give."""
    running("step_attempt()")
    run = inside_step.get()
    if run is None:
        raise RuntimeError("pgflow.step_attempt() can only be called inside a step; the workflow body's own "
                           "attempt is pgflow.attempt()")
    return run.step_attempt
