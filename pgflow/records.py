"""What the management API returns: plain records of workflows, their steps and their streams."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ._core.maintenance import APPLICATION as MAINTENANCE_APPLICATION


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
    resume starts it again from 0; taking a sleeping or waiting workflow up again is no new attempt);
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
        return cls(*row)


@dataclass(frozen=True)
class WorkflowInfo:
    """One workflow in full, from one snapshot: its record, every recorded step (with timings and
    attempts), and its streams with their lengths."""

    record: WorkflowRecord
    steps: list[StepInfo]
    streams: list[StreamInfo]


@dataclass(frozen=True)
class QueueInfo:
    """A queue with work or limits: how much waits, how long the oldest due one has waited, how much
    runs, and its fleet-wide limits."""

    name: str
    queued: int
    due: int
    oldest_due_waited_s: float | None
    running: int
    concurrency: int | None
    rate_limit: int | None
    rate_period_s: float | None


@dataclass(frozen=True)
class WorkerInfo:
    id: str
    host: str
    pid: int
    queues: list[str]
    version: str
    heartbeat_age_s: float
    running: int
    names: list[str]


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


@dataclass(frozen=True)
class Health:
    """What ``pgflow status`` reports. Unhealthy: no live worker, queued workflows whose name no live
    worker runs (they would wait forever), the NOTIFY queue over half full, sessions idle in a
    transaction for long (a LISTEN connection in a transaction stalls every NOTIFY of the cluster), or
    a maintenance service's lock held by a session that is not a worker's (cron, retention and the
    reaper stop while it holds them).
    While the queue holds anything, ``queue_holders`` are the oldest open transactions of the
    cluster: whichever of them has run LISTEN holds the queue back (PostgreSQL does not say which)."""

    live_workers: int
    notification_queue_usage: float
    unserved: dict[str, int]  # queued workflows per name no live worker runs
    stuck_sessions: list[Session]  # of this database, idle in a transaction for long
    queue_holders: list[Session]
    maintenance: list[LockHolder]  # who holds each maintenance service's lock (unheld ones are not listed)

    @property
    def ok(self) -> bool:
        return (self.live_workers > 0 and not self.unserved and not self.stuck_sessions
                and self.notification_queue_usage <= 0.5 and all(h.worker for h in self.maintenance))
