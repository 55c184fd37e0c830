"""What a start puts on the queue: the options every workflow of one start shares, when it falls due
and expires, and what the start found."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from . import wire
from .channel import riding

# A row's creation time in microseconds: what binds news of a workflow to this one of its id.
BORN = "(extract(epoch FROM created_at) * 1000000)::int8"


@dataclass(frozen=True, slots=True)
class Timing:
    """When a new workflow falls due and when it expires: ``eta`` (a time) or else ``delay`` seconds
    from now on the server's clock; ``expires_at`` (a time) or ``expires_in`` seconds from now."""

    eta: datetime | None = None
    expires_at: datetime | None = None
    expires_in: float | None = None

    def parameters(self) -> dict[str, Any]:
        return {"eta": self.eta, "expires_at": self.expires_at, "expires_in": self.expires_in}


NO_TIMING = Timing()
DUE = "coalesce(%(eta)s::timestamptz, {s}.clock_now() + make_interval(secs => %(delay)s))"
EXPIRES = ("coalesce(%(expires_at)s::timestamptz,"
           " {s}.clock_now() + make_interval(secs => %(expires_in)s::float8))")


@dataclass(frozen=True, slots=True, kw_only=True)
class NewWorkflows:
    """What ``enqueue`` and ``enqueue_many`` start workflows with, besides their ids and inputs: the
    workflow's ``name``, where and how it runs, ``parent`` (the workflow whose body started it, which
    cancels it with itself) and ``traceparent`` (the starting caller's trace). Due ``delay`` seconds
    from now unless ``when`` says otherwise."""

    name: str
    queue: str
    priority: int
    delay: float
    max_attempts: int | None
    timeout: float | None
    parent: str | None = None
    traceparent: str | None = None
    when: Timing = NO_TIMING

    def parameters(self) -> dict[str, Any]:
        return {"name": self.name, "queue": self.queue, "priority": self.priority, "delay": self.delay,
                "max_attempts": self.max_attempts, "timeout": self.timeout, "parent": self.parent,
                "traceparent": self.traceparent, **self.when.parameters()}


class Started(NamedTuple):
    """What a start found: whether it ``created`` the row, the ``name`` of the row's workflow (another
    one's when the id was taken), and its birth (``BORN``)."""

    created: bool
    name: str
    born: int


# One start: the row inserted unless the id exists, and what the id holds either way.
START = (
    "WITH new AS ("
    " INSERT INTO {s}.workflows"
    "  (id, name, queue, priority, inputs, due_at, max_attempts, timeout, parent_id, traceparent,"
    "   expires_at)"
    " VALUES (%(id)s, %(name)s, %(queue)s, %(priority)s, %(inputs)s,"
    f"  {DUE}, %(max_attempts)s, %(timeout)s, %(parent)s, %(traceparent)s, {EXPIRES})"
    f" ON CONFLICT (id) DO NOTHING RETURNING name, {BORN} AS born)"
    " SELECT true, name, born FROM new"
    f" UNION ALL SELECT false, name, {BORN} FROM {{s}}.workflows WHERE id = %(id)s"
    "  AND NOT EXISTS (SELECT FROM new)" + riding(3)
)
STARTING = wire.Statement(
    START, id=wire.TEXT, name=wire.TEXT, queue=wire.TEXT, priority=wire.INT4, inputs=wire.BYTEA, eta=wire.TIMESTAMPTZ,
    delay=wire.FLOAT8, max_attempts=wire.INT4, timeout=wire.FLOAT8, parent=wire.TEXT, traceparent=wire.TEXT,
    expires_at=wire.TIMESTAMPTZ, expires_in=wire.FLOAT8, pings_channels=wire.TEXTS, pings=wire.TEXTS)
