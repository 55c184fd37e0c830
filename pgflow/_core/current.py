"""The execution that a piece of code runs on behalf of, found from wherever that code is.

Apart from ``execution.py``, which is one run as its body sees it: this is how code that is handed no
execution (``pgflow.step``'s wrapper, ``pgflow.sleep``, ``pgflow.attempt()``, a child's start, a
sync workflow's thread) finds the one it runs in, and reaches the worker's loop from a thread."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from contextvars import ContextVar
from typing import Any, TypeVar

import anyio.lowlevel
from anyio.from_thread import run as run_in_loop

from .execution import Execution
from .step_body import inside_step

T = TypeVar("T")

# The execution a piece of code runs on behalf of. Steps consult it to decide whether a call is
# journaled (inside a workflow) or plain (anywhere else, or inside another step), and child workflows
# started from a workflow derive their ids from it.
current_execution: ContextVar[Execution | None] = ContextVar("pgflow_execution", default=None)


def journaling() -> Execution | None:
    """The execution whose journal a step call made here belongs to, if any."""
    execution = current_execution.get()
    if execution is None or inside_step.get():
        return None
    return execution


def running(what: str) -> Execution:
    """The execution that the calling code runs in, for a function that only makes sense there."""
    execution = current_execution.get()
    if execution is None:
        raise RuntimeError(f"pgflow.{what} can only be called inside a workflow or step run by a worker")
    return execution


def from_thread(what: str, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
    """The sync twin ``pgflow.<what>`` of an async function of the execution: run on the worker's
    loop from a sync workflow's or step's thread; refused on the loop itself, which it would block."""
    execution = running(what)
    try:
        on_loop = anyio.lowlevel.current_token() == execution.token
    except RuntimeError:
        on_loop = False
    if on_loop:
        raise RuntimeError(f"pgflow.{what} blocks; in async code use `await pgflow.{what}_async(...)`")
    return run_in_loop(fn, execution, *args, token=execution.token)
