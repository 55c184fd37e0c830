"""The tasks a worker runs its claimed workflows in, and their owner.

One task per workflow run, as an anyio task group would keep them, but spawned as plain asyncio
tasks: anyio's ``start_soon`` gives every task a handle, a cancel scope and an event nobody reads
here, about 22 us more per task than ``create_task`` on this machine (a no-op workflow's whole
worker CPU is about 120 us). What the group did that matters is kept: each run is hosted in a
cancel scope of its own, so cancelling it honours the shielded scopes inside (an end being
recorded, an interrupted run being given back), and ``serve``, a task of the worker's group, owns
them all: when the worker stops it cancels every run and waits for each to end.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

import anyio

log = logging.getLogger("pgflow.worker")


class Runs:
    """The worker's running workflows' tasks, started by its claim loop and owned by ``serve``."""

    def __init__(self) -> None:
        self._scopes: dict[asyncio.Task[None], anyio.CancelScope] = {}
        self._open = True

    def __len__(self) -> int:
        return len(self._scopes)

    def start(self, run: Coroutine[Any, Any, None], name: str) -> bool:
        """Run ``run`` in a task of its own; False (``run`` closed, not run) once ``serve`` has
        stopped: the caller gives the workflow back."""
        if not self._open:
            run.close()
            return False
        scope = anyio.CancelScope()
        task = asyncio.get_running_loop().create_task(_hosted(scope, run), name=name)
        self._scopes[task] = scope
        task.add_done_callback(self._ended)
        return True

    def _ended(self, task: asyncio.Task[None]) -> None:
        del self._scopes[task]
        if not task.cancelled() and (exc := task.exception()) is not None:
            # (A run catches its exceptions; what reaches here is a bug, and the task group that
            # once hosted runs would have stopped the worker with it.)
            log.error("the task of %s ended with an exception", task.get_name(), exc_info=exc)

    async def serve(self) -> None:
        """Own the runs until cancelled (the worker stopping); then cancel each and wait for all of
        them to end, shielded: a run being given back finishes doing so."""
        try:
            await anyio.sleep_forever()
        finally:
            self._open = False
            with anyio.CancelScope(shield=True):
                while self._scopes:
                    for scope in self._scopes.values():
                        scope.cancel()
                    await asyncio.wait(list(self._scopes))


async def _hosted(scope: anyio.CancelScope, run: Coroutine[Any, Any, None]) -> None:
    with scope:
        await run
