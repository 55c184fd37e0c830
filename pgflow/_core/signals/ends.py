"""What one event loop heard about workflow ends, so that a caller waiting for a result can do
without reading the workflow's row.

Two things are kept, both bounded:

- the end that news carried (``payload.End``, sealed: nobody without the schema's key can make one)
  of a workflow somebody on this loop waits on, until that waiter takes it;
- the workflows started on this loop while its listener was listening, and whether anything was heard
  of them since. One of which nothing was heard has not ended (its end would have reached this loop),
  so the first look of a wait for its result needs no read either. (One that was heard of is read:
  its end, heard before the wait began, may since have been resumed.)

Whatever may have made this loop miss news (its listener stopping or reconnecting, a "wake all")
forgets the starts: their waits read the row, as any other. So does a start during which an end was
heard: it may have been that start's own.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..engine import WorkflowRow
from ..status import Status
from . import keys as signal_keys
from .payload import End, News

MAX_STARTS = 10_000  # starts remembered; the oldest are forgotten first (their waits read the row)
MAX_ENDS = 10_000  # carried ends kept for waiters that have not taken them yet


class EndNews:
    def __init__(self) -> None:
        self._watched: dict[str, int] = {}  # workflow id -> waits on its end
        self._ended: dict[str, End] = {}  # carried ends of watched workflows, until taken
        self._started: dict[str, tuple[int, bool]] = {}  # started here: (born, heard of since)
        self.epoch = 0  # moves on whenever the starts are forgotten, and with every end heard
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

    def started(self, workflows: Iterable[tuple[str, int]], epoch: int | None) -> None:
        """Workflows (id, born) created by a statement sent while the listener listened, at ``epoch``
        (None: it did not listen, and nothing is remembered)."""
        if epoch is None or epoch != self.epoch:
            return
        for workflow_id, born in workflows:
            self._started[workflow_id] = (born, False)
            if len(self._started) > MAX_STARTS:
                del self._started[next(iter(self._started))]

    def heard_of(self, workflow_id: str) -> None:
        """This loop changed the workflow itself (it resumed it): its next wait reads the row."""
        start = self._started.get(workflow_id)
        if start is not None:
            self._started[workflow_id] = (start[0], True)

    def forget(self) -> None:
        """News may have been missed: no start can be trusted to be quiet any more."""
        self.epoch += 1
        self._started.clear()

    def hear(self, news: News) -> None:
        """Note what ``news`` says about watched or started workflows.

        News of an end moves the epoch on: a start sent before it and not yet answered may be the
        workflow it tells of (its row visible, and run, from its commit on, before the caller hears
        of it), so that start is not remembered as quiet, and its wait reads the row."""
        if news.ends or any(signal_keys.ended_workflow(key) is not None for key in news.keys):
            self.epoch += 1
        if not self._watched and not self._started:
            return
        for end in news.ends:
            if end.workflow_id in self._watched:
                self._ended[end.workflow_id] = end
                if len(self._ended) > MAX_ENDS:
                    del self._ended[next(iter(self._ended))]
            self.heard_of(end.workflow_id)
        if self._started:
            for key in news.keys:
                workflow_id = signal_keys.ended_workflow(key)
                if workflow_id is not None:
                    self.heard_of(workflow_id)

    def quiet_since_start(self, workflow_id: str) -> WorkflowRow | None:
        """For a wait on ``workflow_id`` about to look for the first time (its waiter already
        registered): the row as its start wrote it when it was started here and nothing was heard
        of it since, so it has not ended and the look needs no read; None otherwise."""
        start = self._started.pop(workflow_id, None)
        if start is None or start[1]:
            return None
        return WorkflowRow(workflow_id, "", Status.QUEUED.value, 0, None, None, start[0])

    def take_end(self, seen: WorkflowRow) -> WorkflowRow | None:
        """The end of a watched workflow that news carried since its row was ``seen``, if any."""
        end = self._ended.pop(seen.id, None)
        if end is None or not supersedes(end, seen):
            return None
        self.taken += 1
        return WorkflowRow(end.workflow_id, end.name, end.status, end.attempt, end.output, end.error, end.born)


def supersedes(end: End, seen: WorkflowRow) -> bool:
    """Whether a carried ``end`` happened after the row was ``seen``. It must be of the same
    workflow (``born``: not a pruned one of the same id), and later: news can arrive late, after the
    workflow was resumed (queued again, same attempt), and must not pass for the new run's end."""
    if end.born != seen.born:
        return False
    return end.attempt > seen.attempt or (end.attempt == seen.attempt and seen.status == Status.RUNNING)
