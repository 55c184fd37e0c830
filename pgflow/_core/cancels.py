"""Cancellations a worker hears of, for the workflows whose writes no longer read their rows.

A write fenced by its workflow's row also says whether somebody asked for the workflow to be
cancelled, so a running workflow stops at its next write. A batch of chunks fenced by its worker
(migration 0026) reads no workflow row, and a workflow that only streams would then learn of its
cancellation from the worker's heartbeat alone, a third of a lease later. So a workflow that writes
under its worker's fence is watched: ``cancel_async`` sends its ``ended`` ping, which wakes this
service, and one query for every watched workflow says which to stop. The heartbeat stays the
backstop for a ping that was lost.
"""

from __future__ import annotations

import logging

import anyio
import psycopg

from .engine import Engine
from .run_state import RunState
from .signals import Waiters
from .signals import keys as signal_keys

log = logging.getLogger("pgflow.worker")


class CancelWatch:
    """Watches the ``ended`` pings of the workflows given to ``watch``; ``run`` stops those whose
    cancellation was asked for, through the states of the runs their worker runs (``RunState.cancel``,
    the one way a run is cancelled)."""

    def __init__(self, store: Engine, waiters: Waiters, runs_by_id: dict[str, RunState]) -> None:
        self._store = store
        self._waiters = waiters
        self._runs_by_id = runs_by_id
        self._watched: set[str] = set()
        self._unchecked: set[str] = set()  # watched since the last look, which no ping has told of
        self._heard = False  # a ping (or a reconnect) since the last look: every watched one is looked at
        self._pinged = anyio.Event()

    def watch(self, workflow_id: str) -> None:
        """From the workflow's first chunk under its worker's fence: a cancel asked for before then
        sent its ping to nobody, so it is looked for once now (with the others of this turn)."""
        if workflow_id not in self._watched:
            self._watched.add(workflow_id)
            self._unchecked.add(workflow_id)
            self._waiters.add(signal_keys.ended(workflow_id), self)
            self._pinged.set()

    def forget(self, workflow_id: str) -> None:
        if workflow_id in self._watched:
            self._watched.discard(workflow_id)
            self._waiters.remove(signal_keys.ended(workflow_id), self)

    def wake(self) -> None:  # (a ping of a watched workflow, or every waiter's wake on a reconnect)
        self._heard = True
        self._pinged.set()

    def hand(self, stream_id: int, position: int, value: bytes | None) -> None:
        self.wake()

    async def run(self) -> None:
        while True:
            await self._pinged.wait()
            self._pinged = anyio.Event()
            looked_at = sorted(self._watched if self._heard else self._unchecked & self._watched)
            self._heard, self._unchecked = False, set()
            if not looked_at:
                continue
            try:
                cancelled = await self._store.workflows.cancels_requested(looked_at)
            except (psycopg.Error, OSError) as exc:  # the heartbeat still tells, a third of a lease later
                log.warning("could not look for cancellations: %s", exc)
                self._unchecked.update(looked_at)  # (looked at again with the next wake)
                continue
            for workflow_id in cancelled:
                run = self._runs_by_id.get(workflow_id)
                if run is not None:
                    log.info("workflow %s was cancelled; stopping it", workflow_id)
                    run.cancel()
