"""Changing a workflow's code while runs of the old code are asleep or waiting: ``patched``.

A workflow that sleeps, waits for a message or simply runs across a deploy replays its journal on the
new code, which must make the same durable calls in the same order up to where the journal ends. A
change behind ``if pgflow.patched("change-id"):`` keeps both paths: the old one for journals written
before the change, the new one for every run that reaches the call fresh. The answer is journaled (a
marker entry ``pgflow.patch:<change-id>`` at the call's position), so it never changes for a
workflow, whichever code replays it later.

Once no journal older than the patch is left (``pgflow check-replay`` tells), the old path goes and
``patched`` becomes ``deprecate_patch``, which lets the journals that recorded the marker replay;
once those are gone too, the call goes.
"""

from __future__ import annotations

import asyncio

from ._core.checks import check_change_id
from ._core.current import from_thread, running
from ._core.execution import Execution
from ._core.step_body import inside_step

__all__ = ["deprecate_patch", "patched", "patched_async"]

PATCH = "pgflow.patch:"  # + the change id: the journal entry of a patch that was taken


def _marker(change_id: str, what: str) -> tuple[Execution, str]:
    check_change_id(change_id)
    execution = running(what)
    execution.state.check()
    if inside_step.get() is not None:
        raise RuntimeError(f"pgflow.{what} is for the workflow body, not for the inside of a step: a step's code "
                           "is not replayed, so it can change freely")
    return execution, PATCH + change_id


def _decide(execution: Execution, name: str) -> bool:
    """True, taking the next position, when the journal recorded this patch there, or when no earlier
    run got this far (the marker is then taken, to be written before the next journal write). False,
    taking no position, when an earlier run went past this point without it: an older body's
    journal, which the old path must replay."""
    journal = execution.journal
    position = journal.next_position
    record = journal.records.get(position)
    if record is not None and record.name == name:
        journal.take()
        return True
    if record is not None or journal.horizon >= position:
        return False
    journal.mark(name)
    return True


def patched(change_id: str) -> bool:
    """Inside a workflow body: whether this run takes the code path of change ``change_id``.

    True on every run that reaches the call fresh; False when replaying a journal that an older body
    wrote past this point without the call. Journaled, so a workflow gets the same answer on every
    replay. A plain call in ``async def`` bodies too: a fresh answer's marker is written with the
    body's next journal write (an answer not yet written is given again after a crash, since nothing
    after it was recorded either)."""
    execution, name = _marker(change_id, "patched")
    decided = _decide(execution, name)
    if decided and execution.journal.marks and not _on_a_loop():
        from_thread("patched", _write)  # a ``def`` body's thread: written now
    return decided


def _on_a_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def patched_async(change_id: str) -> bool:
    """``patched``, with a fresh answer's marker written before it returns."""
    execution, name = _marker(change_id, "patched_async")
    decided = _decide(execution, name)
    if execution.journal.marks:
        await execution.write_marks()
    return decided


async def _write(execution: Execution) -> None:
    await execution.write_marks()


def deprecate_patch(change_id: str) -> None:
    """The clean-up step of a patch whose old path is gone: replays of journals that recorded the
    patch step over its marker, and fresh runs record nothing. Remove the call once no such journal
    is left."""
    execution, name = _marker(change_id, "deprecate_patch")
    record = execution.journal.records.get(execution.journal.next_position)
    if record is not None and record.name == name:
        execution.journal.take()
