"""What the management API returns: plain records of workflows, their steps and their streams."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class StepInfo:
    """A recorded step call: its position in the workflow, its name, and how it ended."""

    position: int
    name: str
    error_type: str | None
    attempts: int
    finished_at: datetime


@dataclass(frozen=True)
class StreamInfo:
    key: str
    length: int  # chunks, the close marker not counted
    closed: bool


@dataclass(frozen=True)
class WorkflowRecord:
    """A workflow as ``app.list_workflows`` lists it. ``attempt`` counts the claims of this run (a
    resume starts it again from 0); ``error_type`` is the recorded failure's type, if any."""

    id: str
    name: str
    queue: str
    status: str
    attempt: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error_type: str | None

    @classmethod
    def of(cls, row: tuple[Any, ...]) -> WorkflowRecord:
        return cls(*row)


@dataclass(frozen=True)
class WorkflowInfo:
    """One workflow in full, from one snapshot: its record, every recorded step (with timings and
    attempts), and its streams with their lengths."""

    record: WorkflowRecord
    steps: list[StepInfo]
    streams: list[StreamInfo]
