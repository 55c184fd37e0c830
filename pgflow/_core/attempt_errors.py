"""Keeping a retried step attempt's error, for the people who look at the workflow later
(``pgflow workflows show``, the dashboard): the execution carries on whatever becomes of the note."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import anyio

from ..errors import ExecutionInterrupted
from .engine import Engine, Fenced
from .outcomes import attempt_error

T = TypeVar("T")


class Execution(Protocol):
    """What the note needs of the execution (execution.Execution): its claim, and its fenced writes."""

    store: Engine
    workflow_id: str
    lease_token: int
    run: int

    async def fenced(self, operation: Callable[[], Awaitable[Fenced[T]]], what: str) -> T: ...

log = logging.getLogger("pgflow.execution")
NOTE_WITHIN = 2.0  # seconds the note may take, as a step start's note: it is only kept for reading


async def keep_attempt_error(execution: Execution, name: str, position: int, step_attempt: int,
                             exc: BaseException) -> None:
    """Note the error of attempt ``step_attempt`` of the step at ``position``, bounded (outcomes.attempt_error)
    and fenced by the execution's claim. Shielded and bounded in time, as the start's note is; a note
    that fails costs only the record (logged), and a lost lease or a cancellation it learns of is left
    in the run's state (run_state.py) for the retry to act on."""
    error = attempt_error(exc)

    async def note() -> Fenced[None]:
        fence = await execution.store.details.note_step_error(execution.workflow_id, execution.lease_token, position,
                                                      execution.run, step_attempt, error)
        return fence.with_value(None)

    try:
        with contextlib.suppress(ExecutionInterrupted), anyio.move_on_after(NOTE_WITHIN, shield=True):
            await execution.fenced(note, f"keep the error of step {name!r}")
    except Exception as failure:  # noqa: BLE001 - the error is only kept for reading, not needed to run
        log.warning("could not keep the error of attempt %d of step %s of %s: %s", step_attempt, name,
                    execution.workflow_id, failure)
