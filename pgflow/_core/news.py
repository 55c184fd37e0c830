"""What pings told one event loop about workflow ends, so that a caller waiting for a result can
do without reading the workflow's row.

Two things are kept, both bounded:

- the end an ``o:`` ping carried (the end statement sends it with its commit; see ``store/ends.py``)
  of a workflow somebody on this loop waits on, until that waiter takes it;
- the workflows started on this loop while its listener was listening, and whether anything was heard
  of them since. One of which nothing was heard has not ended (its end would have pinged this loop), so
  the first look of a wait for its result needs no read either. (One that was heard of is read: its
  end, heard before the wait began, may since have been resumed.)

Whatever may have made this loop miss a ping (its listener stopping or reconnecting, a ping that
wakes everybody) forgets the starts: their waits read the row, as any other.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable
from typing import Any

import msgspec

from .store import WorkflowRow
from .streams.pings import CARRIED_CHUNK, STREAM_PING

CARRIED_END = "o:"
ENDED = "wf:"
STREAM_PINGS = (STREAM_PING, CARRIED_CHUNK)  # news of streams, none of ends
MAX_STARTS = 10_000  # starts remembered; the oldest are forgotten first (their waits read the row)


class EndNews:
    def __init__(self) -> None:
        self._watched: dict[str, int] = {}  # workflow id -> keys "wf:<id>" waited on
        self._ended: dict[str, WorkflowRow] = {}  # carried ends of watched workflows, until taken
        self._started: dict[str, bool] = {}  # started here: whether anything was heard of it since
        self.epoch = 0  # moves on whenever the starts are forgotten
        self.taken = 0  # ends a wait took from here instead of reading the row

    def watch(self, workflow_id: str) -> None:
        self._watched[workflow_id] = self._watched.get(workflow_id, 0) + 1

    def unwatch(self, workflow_id: str) -> None:
        left = self._watched.get(workflow_id, 0) - 1
        if left > 0:
            self._watched[workflow_id] = left
        else:
            self._watched.pop(workflow_id, None)
            self._ended.pop(workflow_id, None)

    def started(self, workflow_ids: Iterable[str], epoch: int | None) -> None:
        """Workflows created by a statement sent while the listener listened, at ``epoch`` (None:
        it did not listen, and nothing is remembered)."""
        if epoch is None or epoch != self.epoch:
            return
        for workflow_id in workflow_ids:
            self._started[workflow_id] = False
            if len(self._started) > MAX_STARTS:
                del self._started[next(iter(self._started))]

    def heard_of(self, workflow_id: str) -> None:
        """This loop changed the workflow itself (it resumed it): its next wait reads the row."""
        if workflow_id in self._started:
            self._started[workflow_id] = True

    def forget(self) -> None:
        """Pings may have been missed: no start can be trusted to be quiet any more."""
        self.epoch += 1
        self._started.clear()

    def hear(self, keys: Iterable[str]) -> None:
        """Note what ``keys`` (a ping's) say about watched or started workflows."""
        if not self._watched and not self._started:
            return
        for key in keys:
            if key.startswith(STREAM_PINGS):  # a stream's ping (most keys, one per stream a batch grew)
                continue
            if key.startswith(CARRIED_END):
                end = carried_end(key)
                if end is None:
                    continue
                if end.id in self._watched:
                    self._ended[end.id] = end
                if end.id in self._started:
                    self._started[end.id] = True
            elif key.startswith(ENDED):
                workflow_id = key[len(ENDED):]
                if workflow_id in self._started:
                    self._started[workflow_id] = True

    def quiet_since_start(self, workflow_id: str) -> bool:
        """For a wait on ``workflow_id`` about to look for the first time (its waiter already
        registered): True when it was started here and nothing was heard of it since, so it has not
        ended and the look needs no read."""
        return self._started.pop(workflow_id, True) is False

    def take_end(self, seen: WorkflowRow) -> WorkflowRow | None:
        """The end of a watched workflow that a ping carried since its row was ``seen``, if one did."""
        end = self._ended.pop(seen.id, None)
        if end is None or not supersedes(end, seen):
            return None
        self.taken += 1
        return end


def as_started(workflow_id: str) -> WorkflowRow:
    """The row of a workflow as its start wrote it (what a wait that needed no first read has seen)."""
    return WorkflowRow(workflow_id, "", "queued", 0, None, None)


def carried_end(key: str) -> WorkflowRow | None:
    """The workflow end an ``o:`` ping carries (None for one that does not parse)."""
    try:
        id, name, status, attempt, output, error = msgspec.json.decode(
            key[len(CARRIED_END):], type=tuple[str, str, str, int, str | None, dict[str, Any] | None])
        return WorkflowRow(id, name, status, attempt, None if output is None else base64.b64decode(output), error)
    except (msgspec.DecodeError, binascii.Error):
        return None


def supersedes(end: WorkflowRow, seen: WorkflowRow) -> bool:
    """Whether a carried ``end`` happened after the row was ``seen``: a ping can arrive late, after
    the workflow was resumed (queued again, same attempt), and must not pass for the new run's end."""
    return end.attempt > seen.attempt or (end.attempt == seen.attempt and seen.status == "running")
