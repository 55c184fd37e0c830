"""What earlier runs of a workflow recorded, and how far this run's replay of its body has got.

A workflow's durable calls (steps, sleeps, receives, events, child starts, patch markers) are numbered
in call order: each takes the next position, and the journal answers with what an earlier run
recorded there. This is that bookkeeping alone, read once when the run starts; the execution
(``execution.py``) checks a record is of the call made there (a body that replays deterministically),
decides what to run and write, and its fenced writes go to the table, not to this copy.
"""

from __future__ import annotations

from .engine import StepRecord


class RunJournal:
    """The journal of one run: its records by position, the position its body reached, and the patch
    markers it took and has not written yet."""

    __slots__ = ("records", "horizon", "next_position", "marks", "tries_before", "loaded_at")

    def __init__(self, records: dict[int, StepRecord], horizon: int = -1, tries_before: dict[int, int] | None = None,
                 loaded_at: float = 0.0) -> None:
        self.records = records
        # The highest position an earlier run reached, by a record or by a child it started (-1: none):
        # ``patched`` answers False below it, where an older body went on without asking.
        self.horizon = horizon
        self.next_position = 0
        # Patch markers taken and not yet written, by position: each is written before anything the
        # body journals after it (``Execution.write_marks``).
        self.marks: dict[int, str] = {}
        # Per position not recorded, the step attempts that earlier runs began there: this run's tries
        # go on from them (``pgflow.step_attempt()`` counts every try of the step).
        self.tries_before = tries_before if tries_before is not None else {}
        self.loaded_at = loaded_at  # when it was read: its seconds until a wake-up count from then

    def take(self) -> int:
        """The next position, taken by a durable call of the body."""
        position = self.next_position
        self.next_position = position + 1
        return position

    def mark(self, name: str) -> int:
        """Take the next position for a patch marker ``name``, to be written with the next write."""
        position = self.take()
        self.marks[position] = name
        return position

    def marked(self, position: int) -> None:
        """The marker at ``position`` is written."""
        del self.marks[position]

    def forget_marks(self) -> None:
        """The markers taken are not to be written (a replay check writes nothing: a patch taken fresh
        is past the journal's end, where nothing follows to check)."""
        self.marks.clear()
