"""The tasks a worker runs its claimed workflows in, and their owner: pgflow's one bypass of anyio's
task groups, kept here.

One task per workflow run, as an anyio task group would keep them, but spawned as plain asyncio
tasks: anyio's ``start_soon`` gives every task a handle, a cancel scope of the group's and a done
callback that this owner does not need. What that buys, measured side by side (``python -m
benchmarks.bypasses --only runs,drain16,drain64``, benchmarks/README.md): 16 against 50 µs of CPU a
run, and a draining worker spends 1.35-1.38x its CPU per no-op with a task group in its place. It
uses anyio's public cancel scopes only (entered in tasks anyio did not spawn, which its asyncio
backend supports), so it needs no bound on anyio's version; tests/test_runs.py holds what the group
did that matters, below.

What the group did that matters is kept: each run is handed a cancel scope to run its body in (the
one a cancellation request also cancels: one scope a run, not two), so stopping it honours the
shielded parts (an end being recorded, an interrupted run being given back); and ``serve``, a task of
the worker's group, owns the runs: when the worker stops it cancels every run's scope and waits for
each run to end.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import anyio

log = logging.getLogger("pgflow.worker")

T = TypeVar("T")
Run = Callable[[T, anyio.CancelScope], Coroutine[Any, Any, None]]


class Runs:
    """The worker's running workflows' tasks, started by its claim loop and owned by ``serve``."""

    def __init__(self) -> None:
        self._scopes: dict[asyncio.Task[None], anyio.CancelScope] = {}
        self._open = True

    def __len__(self) -> int:
        return len(self._scopes)

    def start(self, run: Run[T], what: T, name: str) -> bool:
        """Run ``run(what, scope)`` in a task of its own, ``scope`` being what a stop cancels; False
        (nothing run) once ``serve`` has stopped: the caller gives the workflow back."""
        if not self._open:
            return False
        scope = anyio.CancelScope()
        task = asyncio.get_running_loop().create_task(run(what, scope), name=name)
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
        """Own the runs until cancelled (the worker stopping); then cancel each one's scope and wait
        for all of them to end, shielded: a run being given back finishes doing so."""
        try:
            await anyio.sleep_forever()
        finally:
            self._open = False
            with anyio.CancelScope(shield=True):
                while self._scopes:
                    for scope in self._scopes.values():
                        scope.cancel()
                    await asyncio.wait(list(self._scopes))
