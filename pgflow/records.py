"""What the management API returns: plain records of workflows, their steps and their streams."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

import msgspec

from ._core.engine.management import CHILD_FIELDS, RECORD_FIELDS, STEP_FIELDS
from ._core.maintenance import APPLICATION as MAINTENANCE_APPLICATION


@dataclass(frozen=True)
class StepInfo:
    """A recorded step call: its position in the workflow, its name, how it ended, and when it started
    (the first attempt of the run that recorded it; None for the body's own entries, such as sleeps,
    and for steps recorded before version 17 of the schema)."""

    position: int
    name: str
    error_type: str | None
    attempts: int
    finished_at: datetime
    started_at: datetime | None = None

    @property
    def duration_s(self) -> float | None:
        return seconds_between(self.started_at, self.finished_at)

    @classmethod
    def of(cls, row: tuple[Any, ...]) -> StepInfo:
        """From a row of the store's ``STEP_COLUMNS`` (engine/management.py), which name these fields."""
        return cls(**dict(zip(STEP_FIELDS, row, strict=True)))


@dataclass(frozen=True)
class StreamInfo:
    key: str
    length: int  # chunks, the close marker not counted
    closed: bool


@dataclass(frozen=True)
class WorkflowRecord:
    """A workflow as ``app.list_workflows`` lists it. ``attempt`` is ``pgflow.attempt()``'s count, as
    the worker's log and ``pgflow workflows show`` have it: runs begun, one more for each that a crash,
    a stop or a lost lease cut short (a resume starts it again; taking a sleeping or waiting workflow
    up again is no new attempt);
    ``error_type`` is the recorded failure's type, if any; ``parent_id`` the workflow whose body
    started it. A queued workflow is due at ``due_at`` (a sleeping one wakes then), and one that gave
    its slot back to wait for a message names the topic in ``waiting_for``."""

    id: str
    name: str
    queue: str
    status: str
    attempt: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error_type: str | None
    parent_id: str | None = None
    due_at: datetime | None = None
    waiting_for: str | None = None
    retries: int = 0  # failed runs of the body run again under the workflow's retry policy
    expires_at: datetime | None = None  # cancelled unrun if it has not started by then (expires=)

    @classmethod
    def of(cls, row: tuple[Any, ...]) -> WorkflowRecord:
        """From a row of the store's ``RECORD`` columns (engine/management.py), which name these fields."""
        return cls(**dict(zip(RECORD_FIELDS, row, strict=True)))


for _record, _fields in ((WorkflowRecord, RECORD_FIELDS), (StepInfo, STEP_FIELDS)):  # one list, one place
    if tuple(f.name for f in fields(_record)) != _fields:
        raise AssertionError(f"{_record.__name__}'s fields are not the store's columns for it: {_fields}")


@dataclass(frozen=True)
class WorkflowInfo:
    """One workflow in full, from one snapshot: its record, every recorded step (with timings and
    attempts), and its streams with their lengths."""

    record: WorkflowRecord
    steps: list[StepInfo]
    streams: list[StreamInfo]


@dataclass(frozen=True)
class QueueInfo:
    """A queue with work, limits or a pause: how much waits, how long the oldest due one has waited,
    how much runs, its fleet-wide limits, and since when it is paused (None: it is not)."""

    name: str
    queued: int
    due: int
    oldest_due_waited_s: float | None
    running: int
    concurrency: int | None
    rate_limit: int | None
    rate_period_s: float | None
    paused_since: datetime | None = None


# A worker of a version that did not record its lease counts as dead after this long unheard (what
# ``pgflow status`` takes for live).
SILENT_AFTER = 30.0


@dataclass(frozen=True)
class WorkerInfo:
    """A registered worker. ``dead``: its heartbeat is older than its lease, so the workflows it held
    are anybody's to take; it is forgotten a while later. (Registered workers are the ones that
    started and did not stop cleanly, or have not yet.)"""

    id: str
    host: str
    pid: int
    queues: list[str]
    version: str
    heartbeat_age_s: float
    running: int
    names: list[str]
    lease_s: float | None = None  # None: a worker of a version that did not record it
    dead: bool = False

    @property
    def state(self) -> str:
        return "DEAD" if self.dead else "live"


@dataclass(frozen=True)
class Session:
    """A session of the server, as ``pgflow status`` names it: who it is and how long its
    transaction has been open."""

    pid: int
    database: str | None
    application_name: str | None
    state: str | None
    transaction_age_s: float

    @classmethod
    def of(cls, row: tuple[Any, ...]) -> Session:
        pid, database, name, state, age = row
        return cls(int(pid), database, name, state, float(age or 0.0))

    def describe(self) -> str:
        return (f"session {self.pid} ({self.application_name or 'no application name'}, database"
                f" {self.database}, {self.state}) with a transaction open for {self.transaction_age_s:.0f} s")


@dataclass(frozen=True)
class LockHolder:
    """The session holding a maintenance service's advisory lock (any role may take one: PostgreSQL
    checks no privilege on advisory locks), and whether it looks like a worker's lock connection."""

    service: str
    pid: int
    user: str | None
    application_name: str | None
    session_age_s: float

    @property
    def worker(self) -> bool:
        return (self.application_name or "").startswith(MAINTENANCE_APPLICATION)

    def describe(self) -> str:
        who = "a worker's" if self.worker else "NOT a worker's: the service does not run while it holds it"
        return (f"{self.service}: held by session {self.pid} ({self.application_name or 'no application name'},"
                f" role {self.user}, up {self.session_age_s:.0f} s), {who}")


MAX_WAIT = 300.0  # seconds the oldest due workflow of a queue may wait before ``pgflow status`` fails


@dataclass(frozen=True)
class Health:
    """What ``pgflow status`` reports; ``problems`` says, one line each, what makes it unhealthy:

    - no live worker (a worker is live while its heartbeat is younger than its lease);
    - work waiting on a queue that no live worker serves (due queued workflows, and running ones whose
      lease ran out), or queued workflows whose name no live worker runs: they would wait for ever;
    - a queue whose oldest due workflow has waited longer than ``max_wait_s`` (the fleet does not keep
      up, a queue's limits hold it back, or its workers are stuck);
    - a registered worker that is dead (its heartbeat older than its lease) while work waits on one of
      its queues: its workflows wait for a live worker of that queue to take them;
    - the NOTIFY queue over half full, sessions idle in a transaction for long (a LISTEN connection in
      a transaction stalls every NOTIFY of the cluster), or a maintenance service's lock held by a
      session that is not a worker's (cron, retention and the reaper stop while it holds them).

    A delayed or sleeping workflow waits for its time, not for a worker: it counts once it is due.
    While the NOTIFY queue holds anything, ``queue_holders`` are the oldest open transactions of the
    cluster: whichever of them has run LISTEN holds the queue back (PostgreSQL does not say which)."""

    live_workers: int
    notification_queue_usage: float
    unserved: dict[str, int]  # queued workflows per name no live worker runs
    stuck_sessions: list[Session]  # of this database, idle in a transaction for long
    queue_holders: list[Session]
    maintenance: list[LockHolder]  # who holds each maintenance service's lock (unheld ones are not listed)
    unserved_queues: dict[str, int] = field(default_factory=dict)  # waiting workflows per queue nobody serves
    overdue: dict[str, float] = field(default_factory=dict)  # per queue, its oldest due one's wait, past max_wait_s
    dead_workers: list[WorkerInfo] = field(default_factory=list)  # dead while work waits on their queues
    max_wait_s: float = MAX_WAIT
    paused: dict[str, datetime] = field(default_factory=dict)  # paused queues, since when (not a problem)

    @property
    def notes(self) -> list[str]:
        """What is so by an operator's choice, said beside the problems: the paused queues."""
        return [f"queue {queue!r} is paused since {since.isoformat(timespec='seconds')}: its workflows wait"
                f" until pgflow queues resume {queue}" for queue, since in self.paused.items()]

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def problems(self) -> list[str]:
        """One line per problem, each naming it (names and ids as Python literals: any role that can
        start a workflow chose them). Empty: healthy."""
        found = [] if self.live_workers else ["no live worker: nothing runs queued workflows"]
        found += [f"{n} workflows waiting on queue {queue!r}: no live worker serves that queue"
                  for queue, n in self.unserved_queues.items()]
        found += [f"{count} queued workflows named {name!r}: no live worker runs that name"
                  for name, count in self.unserved.items()]
        found += [f"the oldest due workflow on queue {queue!r} has waited {waited:.0f} s (more than the"
                  f" {self.max_wait_s:g} s allowed)" for queue, waited in self.overdue.items()]
        found += [f"worker {w.id!r} is dead (heartbeat {w.heartbeat_age_s:.0f} s old, lease"
                  f" {w.lease_s if w.lease_s is not None else SILENT_AFTER:g} s) while work waits on its"
                  f" queues {', '.join(map(repr, w.queues))}" for w in self.dead_workers]
        found += [f"session {s.pid} idle in a transaction for {s.transaction_age_s:.0f} s"
                  f" ({s.application_name or 'no application name'}): a LISTEN connection in a transaction"
                  " stalls every NOTIFY of the cluster" for s in self.stuck_sessions]
        found += [f"maintenance lock {h.describe()}" for h in self.maintenance if not h.worker]
        if self.notification_queue_usage > 0.5:
            found.append(f"the NOTIFY queue is {self.notification_queue_usage:.1%} full: an open transaction that"
                         " ran LISTEN holds it back (queue_holders: the oldest open transactions of the cluster)")
        return found


# -- One workflow in full (``app.workflow_details``): what ``pgflow workflows show`` prints and the
# dashboard renders. msgspec Structs, so ``--json`` is their encoding as it stands.


class Undecodable(msgspec.Struct, frozen=True, tag="undecodable"):
    """Stands in for a stored value that does not decode (a row written by hand, or by a version with
    another encoding): its size and why, never a guess at its meaning."""

    size: int
    reason: str


class ErrorDetails(msgspec.Struct, frozen=True):
    """A recorded exception as data: its type's path, its message and its traceback as text."""

    type: str
    message: str
    traceback: str

    @classmethod
    def of(cls, stored: Any) -> ErrorDetails | None:
        """From a row's jsonb, trusting none of it: any JSON at all gives an ErrorDetails."""
        if stored is None:
            return None
        if not isinstance(stored, dict):
            return cls("?", msgspec.json.encode(stored).decode(), "")
        return cls(*(_as_text(stored.get(key)) for key in ("type", "message", "traceback")))


class AttemptError(msgspec.Struct, frozen=True):
    """The error of a step attempt that was retried: ``run`` is the workflow's attempt
    (``pgflow.attempt()``) it belongs to, ``step_attempt`` its number in that run
    (``pgflow.step_attempt()``). Its message and traceback are cut to a bounded size."""

    run: int
    step_attempt: int
    failed_at: datetime
    error: ErrorDetails


class StepDetails(msgspec.Struct, frozen=True):
    """A recorded journal entry: a step call, or a durable operation of the body (``pgflow.sleep``,
    ``pgflow.recv``, ``pgflow.set_event``, a child's start, named ``pgflow.*``). ``started_at`` is the
    first attempt's start in the run that recorded it (None for the body's own operations and for
    entries older than this version), so ``duration_s`` spans that run's retries and their backoff.
    ``attempts`` counts every attempt, interrupted ones included; ``attempt_errors`` are those of the
    retried ones still kept (the latest few), oldest first; ``error`` is the final one."""

    position: int
    name: str
    started_at: datetime | None
    finished_at: datetime
    duration_s: float | None
    attempts: int
    output: Any
    error: ErrorDetails | None
    attempt_errors: list[AttemptError]
    wake_at: datetime | None = None  # a sleep's wake-up time, or a receive's deadline
    waiting: bool = False  # a receive that has no message yet


class StepInProgress(msgspec.Struct, frozen=True):
    """A step begun and not recorded: running now, or cut short (a crash, a stop, a cancellation)."""

    position: int
    attempts: int
    started_at: datetime | None
    attempt_errors: list[AttemptError]


class WorkflowDetails(msgspec.Struct, frozen=True):
    """One workflow in full, from one snapshot. ``arguments`` are decoded as builtins (a map of
    parameter to value; ``{"args": [...], "kwargs": {...}}`` for one started by name and not run yet),
    ``result`` likewise, an Undecodable where a stored value does not decode. ``attempt`` is
    ``pgflow.attempt()``'s count. ``steps`` holds the first ``steps_limit`` journal entries of
    ``steps_total``."""

    id: str
    name: str
    queue: str
    status: str
    attempt: int
    priority: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    duration_s: float | None
    due_at: datetime | None
    waiting_for: str | None
    parent_id: str | None
    lease_owner: str | None
    lease_expires_at: datetime | None
    cancel_requested: bool
    max_attempts: int | None
    timeout_s: float | None
    deadline_at: datetime | None
    arguments: Any
    result: Any
    error: ErrorDetails | None
    steps: list[StepDetails]
    steps_total: int
    in_progress: list[StepInProgress]
    streams: list[StreamInfo]


class ChildInfo(msgspec.Struct, frozen=True):
    """A workflow that another's body started. ``position`` is the parent's journal position that
    started it (its id is the parent's, a dot and the position, then a dot and ``index`` for the
    index-th of one ``start_many``); None for a child started with an id of its own, which takes no
    position. ``attempt`` is ``pgflow.attempt()``'s count."""

    id: str
    name: str
    status: str
    position: int | None
    index: int | None
    attempt: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error_type: str | None

    @classmethod
    def of(cls, row: tuple[Any, ...]) -> ChildInfo:
        """From a row of the store's ``CHILD_COLUMNS`` (engine/management.py), which name these fields."""
        return cls(**dict(zip(CHILD_FIELDS, row, strict=True)))


if ChildInfo.__struct_fields__ != CHILD_FIELDS:
    raise AssertionError(f"ChildInfo's fields are not the store's columns for it: {CHILD_FIELDS}")


class Children(msgspec.Struct, frozen=True):
    """The children of one workflow, from one snapshot: the first ones by position (``children``),
    how many it has (``total``), and ``journal_positions``, one past the highest position of its
    journal that a step record or a child took: the positions ``fork(from_step=N)`` counts, a child's
    start among them though it writes no step record."""

    children: list[ChildInfo]
    total: int
    journal_positions: int


def _as_text(value: Any) -> str:
    return "" if value is None else value if isinstance(value, str) else msgspec.json.encode(value).decode()


def seconds_between(start: datetime | None, end: datetime | None) -> float | None:
    return None if start is None or end is None else (end - start).total_seconds()
