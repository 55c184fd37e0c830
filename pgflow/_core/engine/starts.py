"""What a start puts on the queue: the options every workflow of one start shares, when it falls due
and expires, and what the start found."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple, TypedDict

from . import wire
from .channel import Pings, Riding, ping_parameters, riding
from .database import Port, Sql
from .statement import Id

# A row's creation time in microseconds: what binds news of a workflow to this one of its id.
BORN = "(extract(epoch FROM created_at) * 1000000)::int8"


@dataclass(frozen=True, slots=True)
class Timing:
    """When a new workflow falls due and when it expires: ``eta`` (a time) or else ``delay`` seconds
    from now on the server's clock; ``expires_at`` (a time) or ``expires_in`` seconds from now."""

    eta: datetime | None = None
    expires_at: datetime | None = None
    expires_in: float | None = None


NO_TIMING = Timing()
DUE = "coalesce(%(eta)s::timestamptz, {s}.clock_now() + make_interval(secs => %(delay)s))"
EXPIRES = ("coalesce(%(expires_at)s::timestamptz,"
           " {s}.clock_now() + make_interval(secs => %(expires_in)s::float8))")


@dataclass(frozen=True, slots=True, kw_only=True)
class NewWorkflows:
    """What ``enqueue`` and ``enqueue_many`` start workflows with, besides their ids and inputs: the
    workflow's ``name``, where and how it runs, ``parent`` (the workflow whose body started it, which
    cancels it with itself) and ``traceparent`` (the starting caller's trace). Due ``delay`` seconds
    from now unless ``when`` says otherwise. ``key``: what the start counts against in a queue with
    per-key limits (None: no key, stored as '': see migration 0032)."""

    name: str
    queue: str
    priority: int
    delay: float
    max_attempts: int | None
    timeout: float | None
    parent: str | None = None
    traceparent: str | None = None
    when: Timing = NO_TIMING
    key: str | None = None

    def options(self) -> Options:
        """The parameters of every start statement (a debounced one's too) but its due time's and key's."""
        return {"name": self.name, "queue": self.queue, "priority": self.priority, "max_attempts": self.max_attempts,
                "timeout": self.timeout, "parent": self.parent, "traceparent": self.traceparent,
                "expires_at": self.when.expires_at, "expires_in": self.when.expires_in}

    def parameters(self) -> New:
        """The parameters of the start statements but the key's (a start of many takes one per workflow)."""
        return {**self.options(), "eta": self.when.eta, "delay": self.delay}


class Options(TypedDict):
    """``NewWorkflows.options()``, as the start statements name them (``EXPIRES``: its expiry)."""

    name: wire.Text
    queue: wire.Text
    priority: wire.Int4
    max_attempts: wire.Int4 | None
    timeout: wire.Float8 | None
    parent: wire.Text | None
    traceparent: wire.Text | None
    expires_at: wire.Timestamptz | None
    expires_in: wire.Float8 | None


class New(Options):
    """``NewWorkflows.parameters()``: its options and its due time (``DUE``)."""

    eta: wire.Timestamptz | None
    delay: wire.Float8


class Started(NamedTuple):
    """What a start found: whether it ``created`` the row, the ``name`` of the row's workflow (another
    one's when the id was taken), and its birth (``BORN``)."""

    created: bool
    name: str
    born: int


# One start: the row inserted unless the id exists, and what the id holds either way.
START = (
    # (``lazy``: when a commit that waits for the disk follows in the same round trip, this one does
    # not wait: see ``wire.fetch_then_durable``)
    "WITH lazy AS (SELECT set_config('synchronous_commit', CASE WHEN %(lazy)s THEN 'off'"
    "  ELSE current_setting('synchronous_commit') END, true)),"
    " new AS ("
    " INSERT INTO {s}.workflows"
    "  (id, name, queue, priority, inputs, due_at, max_attempts, timeout, parent_id, traceparent,"
    "   expires_at, key)"
    " VALUES (%(id)s, %(name)s, %(queue)s, %(priority)s, %(inputs)s,"
    f"  {DUE}, %(max_attempts)s, %(timeout)s, %(parent)s, %(traceparent)s, {EXPIRES}, coalesce(%(start_key)s, ''))"
    f" ON CONFLICT (id) DO NOTHING RETURNING name, {BORN} AS born)"
    " SELECT true, name, born FROM new WHERE EXISTS (SELECT FROM lazy)"
    f" UNION ALL SELECT false, name, {BORN} FROM {{s}}.workflows WHERE id = %(id)s"
    "  AND NOT EXISTS (SELECT FROM new)" + riding(3)
)


class Starting(New, Riding):
    id: wire.Text
    start_key: wire.Text | None
    inputs: wire.Bytea
    lazy: wire.Bool


# (its row made a Started in psycopg's loop: one row, and no conversion of each column after)
STARTING = wire.Statement(START, row=Started, params=Starting)
# Whether this role may send the second commit of ``wire.fetch_then_durable`` (see ``Starts.enqueue``).
CAN_BE_DURABLE_AFTER = Sql(wire.CAN_BE_DURABLE_AFTER, row=tuple[bool])
# What a start found, once it found its id taken by a start it could not see yet.
FOUND = Sql(f"SELECT false, name, {BORN} FROM {{s}}.workflows WHERE id = %s", row=Started, params=Id)
# Many starts of one name in one statement, each id inserted unless it exists (with its key), and what
# each found (by its ordinal in the ids asked).
class EnqueueMany(New, Riding):
    ids: Sequence[str]
    inputs: Sequence[bytes]
    keys: Sequence[str | None]


class Enqueued(NamedTuple):
    """A start of ``ENQUEUE_MANY``: its ordinal ``n`` in the ids asked, whether it ``created`` the row,
    and the ``name`` and birth of the row its id holds (None: a start it could not see took the id)."""

    n: int
    created: bool
    name: str | None
    born: int | None


ENQUEUE_MANY = Sql(
    "WITH asked AS (SELECT * FROM unnest(%(ids)b::text[], %(inputs)b::bytea[], %(keys)s::text[])"
    "   WITH ORDINALITY AS a(id, inputs, key, n)),"
    " new AS (INSERT INTO {s}.workflows"
    "  (id, name, queue, priority, inputs, due_at, max_attempts, timeout, parent_id, traceparent,"
    "   expires_at, key)"
    f"  SELECT id, %(name)s, %(queue)s, %(priority)s, inputs, {DUE},"
    f"   %(max_attempts)s, %(timeout)s, %(parent)s, %(traceparent)s, {EXPIRES}, coalesce(key, '')"
    "  FROM asked ORDER BY n"
    f"  ON CONFLICT (id) DO NOTHING RETURNING id, name, {BORN} AS born)"
    " SELECT a.n, new.id IS NOT NULL, coalesce(new.name, w.name),"
    "  coalesce(new.born, (extract(epoch FROM w.created_at) * 1000000)::int8) FROM asked a"
    " LEFT JOIN new ON new.id = a.id"
    " LEFT JOIN {s}.workflows w ON w.id = a.id AND new.id IS NULL" + riding(4),
    row=Enqueued, params=EnqueueMany)


class Starts(Port):
    """The start statements of ``Engine`` (which provides the pool and the schema)."""

    _starts_in_flight = 0  # this store's single starts sent and not yet answered
    _durable_after: bool | None = None  # whether starts may commit lazily (see ``enqueue``); None: not asked yet

    async def enqueue(self, id: str, inputs: bytes, new: NewWorkflows, pings: Pings) -> Started:
        """Insert a queued workflow unless the id exists. ``pings`` go out with the commit.

        A start alone on this store is visible to the workers (and its ping sent) from its commit on,
        and made durable by a second commit in the same round trip before the caller hears of it: the
        workflow's run begins a disk flush earlier. Starts sent together each commit durably instead,
        so that the server flushes them together, which a second commit each would cost more than it
        saves. Through a pooler, which may not take a pipeline, always in one durable commit, as when
        the role may not send the second commit's message."""
        if self._durable_after is None:
            may = await self.db.row(CAN_BE_DURABLE_AFTER) if self.db.pool.prepares else None
            self._durable_after = may is not None and may[0] is True
        alone = self._durable_after and not self._starts_in_flight
        self._starts_in_flight += 1
        try:
            given: Starting = {"id": id, "inputs": inputs, **new.parameters(), "start_key": new.key,
                               "pings_channels": pings.channels, "pings": pings.payloads, "lazy": alone}
            if alone:
                async with self.db.session() as s:
                    rows = await s.rows_then_durable(STARTING, **given)
            else:
                rows = await self.db.rows(STARTING, **given)
        finally:
            self._starts_in_flight -= 1
        if rows:
            return rows[0]
        # The row was inserted by a concurrent start whose commit we could not see yet; ours waited on
        # its unique index entry, so it is committed now.
        found = await self.db.row(FOUND, id)
        if found is None:
            raise LookupError(id)
        return found

    async def enqueue_many(self, ids: list[str], inputs: list[bytes], new: NewWorkflows,
                           pings: Pings, keys: list[str | None] | None = None) -> list[Started]:
        """Insert many queued workflows of one name in one statement, skipping ids that exist; what
        each start found, in the order of ``ids``. ``keys``: each start's key (None: ``new.key``)."""
        async with self.db.session() as s:
            rows = await s.rows(ENQUEUE_MANY, ids=ids, inputs=inputs,
                                keys=keys if keys is not None else [new.key] * len(ids),
                                **new.parameters(), **ping_parameters(s.conn, pings))
        found: list[Started] = [Started(False, "", 0)] * len(ids)
        created_here: set[str] = set()
        for row in rows:
            id, created = ids[row.n - 1], row.created
            if created and id in created_here:
                created = False  # the same id twice in one list: created once
            if created:
                created_here.add(id)
            if row.name is None or row.born is None:  # a concurrent start inserted it and committed after our snapshot
                late = await self.db.row(FOUND, id)
                if late is None:
                    raise LookupError(id)
                found[row.n - 1] = late
            else:
                found[row.n - 1] = Started(created, row.name, row.born)
        return found
