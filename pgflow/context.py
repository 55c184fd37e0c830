"""The execution a piece of code runs on behalf of, carried in a context variable.

Steps consult it to decide whether a call is journaled (inside a workflow) or plain (anywhere else, or
inside another step), and child workflows started from a workflow derive their ids from it.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .execution import Execution

current_execution: ContextVar[Execution | None] = ContextVar("pgflow_execution", default=None)
inside_step: ContextVar[bool] = ContextVar("pgflow_inside_step", default=False)


def journaling() -> Execution | None:
    """The execution whose journal a step call made here belongs to, if any."""
    execution = current_execution.get()
    if execution is None or inside_step.get():
        return None
    return execution
