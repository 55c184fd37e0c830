"""The SQL of operations: listing workflows, looking into one, resuming and forking."""

from __future__ import annotations

from datetime import datetime
from typing import NamedTuple, TypedDict, cast

from ..status import Status
from .database import SNAPSHOT, Sql
from .overview import HealthRead, Overview, QueueRow, WaitingRow, WorkerRow
from .statement import ById, Id

__all__ = ["HealthRead", "Management", "QueueRow", "WaitingRow", "WorkerRow"]


class RecordRow(NamedTuple):
    """The light record of a workflow (``pgflow.records.WorkflowRecord``, whose class checks on import
    that its fields are these), as ``RECORD`` reads it."""

    id: str
    name: str
    queue: str
    status: str
    attempt: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error_type: str | None
    parent_id: str | None
    due_at: datetime | None
    waiting_for: str | None
    retries: int
    expires_at: datetime | None


class StepRow(NamedTuple):
    """A recorded step as ``info`` reads it (``pgflow.records.StepInfo``), in the same way."""

    position: int
    name: str
    error_type: str | None
    attempts: int
    finished_at: datetime
    started_at: datetime | None


# The column that gives each field of the rows above, where it is no column of the same name.
_ERROR_TYPE = {"error_type": "error->>'type'"}
_RECORD_EXPRESSIONS = {"attempt": "attempt - attempt_base", "due_at": "CASE WHEN status = 'queued' THEN due_at END",
                       "waiting_for": "CASE WHEN status = 'queued' THEN waiting_for END", **_ERROR_TYPE}
RECORD_COLUMNS = tuple((field, _RECORD_EXPRESSIONS.get(field, field)) for field in RecordRow._fields)
RECORD_FIELDS = RecordRow._fields
RECORD = ", ".join(column for _, column in RECORD_COLUMNS)
STEP_COLUMNS = tuple((field, _ERROR_TYPE.get(field, field)) for field in StepRow._fields)
STEP_FIELDS = StepRow._fields
# A child's id is its parent's, a dot and the journal position that started it, and for start_many a
# dot and its index (``workflow.new_id``); a child started with an id of its own takes no position.
_DERIVED = ("left(id, length(%(id)s) + 1) = %(id)s || '.'"
            " AND substr(id, length(%(id)s) + 2) ~ '^[0-9]{1,9}([.][0-9]{1,9})?$'")
_PART = "split_part(substr(id, length(%(id)s) + 2), '.', {})"
# A child as ``pgflow workflows show`` lists it (``pgflow.records.ChildInfo``, whose class checks on import
# that its fields are these): each field, the column that gives it, and the row's type (a plain tuple: a
# NamedTuple could not name a field ``index``).
CHILD_COLUMNS: tuple[tuple[str, str], ...] = (
    ("id", "id"), ("name", "name"), ("status", "status"),
    ("position", f"CASE WHEN {_DERIVED} THEN {_PART.format(1)}::int END"),
    ("index", f"CASE WHEN {_DERIVED} THEN nullif({_PART.format(2)}, '')::int END"),
    ("attempt", "attempt - attempt_base"), ("created_at", "created_at"), ("started_at", "started_at"),
    ("finished_at", "finished_at"), ("error_type", "error->>'type'"),
)
CHILD_FIELDS = tuple(field for field, _ in CHILD_COLUMNS)
ChildRow = tuple[str, str, str, int | None, int | None, int, datetime, datetime | None, datetime | None, str | None]
_CHILDREN = (f"SELECT {', '.join(f'{column} AS {field}' for field, column in CHILD_COLUMNS)}"
             " FROM {s}.workflows WHERE parent_id = %(id)s")  # by the workflows_parent index


class Listing(TypedDict):
    """A listing's filters (None: any), and how many it lists at most."""

    status: str | None
    name: str | None
    queue: str | None
    after: datetime | None
    before: datetime | None
    limit: int


def _listing(order: str) -> str:
    """The light records of the workflows that match every filter given, by creation time in ``order``."""
    return (
        f"SELECT {RECORD} FROM {{s}}.workflows"
        " WHERE (%(status)s::text IS NULL OR status = %(status)s)"
        " AND (%(name)s::text IS NULL OR name = %(name)s)"
        " AND (%(queue)s::text IS NULL OR queue = %(queue)s)"
        " AND (%(after)s::timestamptz IS NULL OR created_at > %(after)s)"
        " AND (%(before)s::timestamptz IS NULL OR created_at < %(before)s)"
        f" ORDER BY created_at {order}, id LIMIT %(limit)s")


LIST_OLDEST_FIRST = Sql(_listing("ASC"), row=RecordRow, params=Listing)
LIST_NEWEST_FIRST = Sql(_listing("DESC"), row=RecordRow, params=Listing)

# One workflow as ``info`` reads it: its record, its step records, its streams (key, chunks, closed).
INFO_RECORD = Sql(f"SELECT {RECORD} FROM {{s}}.workflows WHERE id = %s", row=RecordRow, params=Id)
INFO_STEPS = Sql(f"SELECT {', '.join(column for _, column in STEP_COLUMNS)} FROM {{s}}.steps"
                 " WHERE workflow_id = %s ORDER BY position", row=StepRow, params=Id)
INFO_STREAMS = Sql(
    "SELECT key, count(*) FILTER (WHERE value IS NOT NULL), bool_or(value IS NULL) FROM {s}.streams"
    " WHERE workflow_id = %s GROUP BY key ORDER BY key", row=tuple[str, int, bool], params=Id)


class Children(ById):
    limit: int


class ChildrenCount(NamedTuple):
    """How many children a workflow has, and the highest position a child or a step record took (-1: none)."""

    children: int
    last_child: int
    last_step: int


# A workflow's children, the first %(limit)s by journal position; then how many there are, and the
# highest position a child or a step record took.
CHILDREN = Sql(f"SELECT * FROM ({_CHILDREN}) c ORDER BY position NULLS LAST, index NULLS FIRST, created_at, id"
               " LIMIT %(limit)s", row=cast("type[ChildRow]", ChildRow), params=Children)
CHILDREN_COUNT = Sql(
    "SELECT count(*), coalesce(max(position), -1),"
    " coalesce((SELECT max(position) FROM {s}.steps WHERE workflow_id = %(id)s), -1)"
    f" FROM ({_CHILDREN}) c", row=ChildrenCount, params=ById)

# A resume (``Management.resume``): the row locked, then its journal from the first error on, its
# attempts' notes, the errors of steps no longer recorded, and the row queued again.
RESUMING = Sql("SELECT status, queue FROM {s}.workflows WHERE id = %s FOR UPDATE", row=tuple[str, str], params=Id)
FORGET_FROM_ERROR = Sql(
    "DELETE FROM {s}.steps WHERE workflow_id = %(id)s AND position >= coalesce("
    " (SELECT min(position) FROM {s}.steps WHERE workflow_id = %(id)s AND error IS NOT NULL),"
    " 2147483647)", row=None, params=ById)
FORGET_ATTEMPTS = Sql("DELETE FROM {s}.step_attempts WHERE workflow_id = %s", row=None, params=Id)
FORGET_STEP_ERRORS = Sql(
    "DELETE FROM {s}.step_errors e WHERE workflow_id = %s AND NOT EXISTS (SELECT FROM {s}.steps s"
    " WHERE s.workflow_id = e.workflow_id AND s.position = e.position)", row=None, params=Id)
REQUEUE = Sql(
    "UPDATE {s}.workflows SET status = 'queued', attempt_base = attempt, retries = 0, due_at = {s}.clock_now(),"
    " output = NULL, error = NULL, finished_at = NULL, cancel_requested = false,"
    " deadline_at = NULL, lease_owner = NULL, lease_expires_at = NULL WHERE id = %s", row=None, params=Id)


class Forking(NamedTuple):
    new: str  # the fork's id
    old: str  # the workflow forked


class ForkingFrom(NamedTuple):
    new: str
    old: str
    steps: int  # the steps copied: those before this position


class Forked(TypedDict):
    new: str
    old: str
    n: int  # the steps copied: those before this position


# A fork (``Management.fork``): the new row, then copies of the first steps' records, the events they
# published, the ended children they started and the chunks written before the last of them ended.
FORK = Sql(
    "INSERT INTO {s}.workflows (id, name, queue, priority, inputs, max_attempts, timeout,"
    "  attempt, attempt_base)"
    " SELECT %s, name, queue, priority, inputs, max_attempts, timeout, 1, 1 FROM {s}.workflows"
    " WHERE id = %s RETURNING queue", row=tuple[str], params=Forking)
FORK_STEPS = Sql(
    "INSERT INTO {s}.steps (workflow_id, position, name, output, error, attempts,"
    "  attempt, stream_ends, wake_at, waiting)"
    " SELECT %s, position, name, output, error, attempts, 0, stream_ends, wake_at, waiting"
    " FROM {s}.steps WHERE workflow_id = %s AND position < %s", row=None, params=ForkingFrom)
FORK_EVENTS = Sql(
    "INSERT INTO {s}.events (workflow_id, key, value)"
    " SELECT DISTINCT ON (name) %s, substr(name, length('pgflow.set_event:') + 1), output"
    " FROM {s}.steps WHERE workflow_id = %s AND position < %s AND name LIKE 'pgflow.set\\_event:%%'"
    " ORDER BY name, position DESC", row=None, params=ForkingFrom)
FORK_CHILDREN = Sql(
    "INSERT INTO {s}.workflows (id, name, queue, priority, inputs, status, output, error, attempt,"
    "  attempt_base, max_attempts, timeout, parent_id, traceparent, started_at, finished_at)"
    " SELECT %(new)s || substr(c.id, length(%(old)s) + 1), c.name, c.queue, c.priority, c.inputs,"
    "  c.status, c.output, c.error, c.attempt, c.attempt_base, c.max_attempts, c.timeout, %(new)s,"
    "  c.traceparent, c.started_at, c.finished_at FROM {s}.workflows c"
    " WHERE c.parent_id = %(old)s AND c.status IN ('succeeded', 'failed', 'cancelled')"
    "  AND left(c.id, length(%(old)s) + 1) = %(old)s || '.'"
    "  AND substr(c.id, length(%(old)s) + 2) ~ '^[0-9]{1,9}([.][0-9]{1,9})?$'"
    "  AND split_part(substr(c.id, length(%(old)s) + 2), '.', 1)::int < %(n)s"
    " ON CONFLICT (id) DO NOTHING", row=None, params=Forked)
FORK_CHUNKS = Sql(
    "WITH copied AS (SELECT i.id, i.key, (last.stream_ends ->> i.key)::int AS upto"
    "   FROM {s}.stream_ids i"
    "   JOIN LATERAL (SELECT stream_ends FROM {s}.steps WHERE workflow_id = %(old)s"
    "    AND position < %(n)s ORDER BY position DESC LIMIT 1) last ON true"
    "   WHERE i.workflow_id = %(old)s AND (last.stream_ends ->> i.key)::int > 0),"
    " named AS (INSERT INTO {s}.stream_ids (workflow_id, key) SELECT %(new)s, key FROM copied"
    "   ORDER BY key RETURNING id, key)"
    " INSERT INTO {s}.chunks (stream_id, position, value)"
    " SELECT named.id, c.position, c.value FROM copied JOIN named ON named.key = copied.key"
    " JOIN {s}.chunks c ON c.stream_id = copied.id AND c.position < copied.upto", row=None, params=Forked)



class Pruning(NamedTuple):
    older_than: float  # seconds since it finished
    batch: int


# Up to a batch of workflows that finished long enough ago deleted, with what hangs off them; how many.
PRUNE = Sql(
    "WITH doomed AS (SELECT id FROM {s}.workflows"
    "   WHERE status IN ('succeeded', 'failed', 'cancelled')"
    "   AND finished_at < {s}.clock_now() - make_interval(secs => %s)"
    "   ORDER BY finished_at LIMIT %s FOR UPDATE SKIP LOCKED),"
    " named AS (DELETE FROM {s}.stream_ids WHERE workflow_id = ANY(ARRAY(SELECT id FROM doomed))),"
    " tries AS (DELETE FROM {s}.step_attempts WHERE workflow_id = ANY(ARRAY(SELECT id FROM doomed))),"
    " errors AS (DELETE FROM {s}.step_errors WHERE workflow_id = ANY(ARRAY(SELECT id FROM doomed))),"
    " gone AS (DELETE FROM {s}.workflows WHERE id = ANY(ARRAY(SELECT id FROM doomed)) RETURNING 1)"
    " SELECT count(*) FROM gone", row=tuple[int], params=Pruning)


class Management(Overview):
    """Listing workflows, looking into one, resuming, forking and pruning them; and (``Overview``) the fleet."""

    async def list_workflows(self, status: str | None, name: str | None, queue: str | None,
                             created_after: datetime | None, created_before: datetime | None, limit: int,
                             newest_first: bool) -> list[RecordRow]:
        """Light records of the workflows that match every filter given, by creation time."""
        return await self.db.rows(LIST_NEWEST_FIRST if newest_first else LIST_OLDEST_FIRST, status=status,
                                  name=name, queue=queue, after=created_after, before=created_before, limit=limit)

    async def info(self, workflow_id: str) -> tuple[RecordRow, list[StepRow], list[tuple[str, int, bool]]] | None:
        """The record, the step records and the streams (key, chunks, closed) of one workflow, from
        one snapshot; None when there is no such workflow."""
        async with self.db.session() as s, s.transaction():
            await s.run(SNAPSHOT)
            record = await s.row(INFO_RECORD, workflow_id)
            if record is None:
                return None
            return record, await s.rows(INFO_STEPS, workflow_id), await s.rows(INFO_STREAMS, workflow_id)

    async def children(self, workflow_id: str, limit: int) -> tuple[list[ChildRow], int, int]:
        """The workflows ``workflow_id``'s body started, from one snapshot: the first ``limit`` by
        journal position (those with ids of their own last), how many there are, and how many
        positions its journal has: one past the highest that a step record or a child took, which
        is what ``fork(from_step=N)`` counts (a child's start writes no step record)."""
        async with self.db.session() as s, s.transaction():
            await s.run(SNAPSHOT)
            rows = await s.rows(CHILDREN, id=workflow_id, limit=limit)
            counted = await s.row(CHILDREN_COUNT, id=workflow_id) or ChildrenCount(0, -1, -1)
            return rows, counted.children, max(counted.last_child, counted.last_step) + 1

    async def resume(self, workflow_id: str) -> tuple[str, str] | None:
        """Queue a failed or cancelled workflow again from its first step record that holds an error
        (every record when none does): that record and every later one go, the others stay. Both its
        budgets start afresh, the runs ``max_attempts`` counts and the retries of its retry policy (a
        workflow whose policy was spent would otherwise fail again at its first failure).
        Returns the status it had and its queue (None: no such workflow); only "failed" and
        "cancelled" resume."""
        async with self.db.session() as s, s.transaction():
            row = await s.row(RESUMING, workflow_id)
            if row is None:
                return None
            if row[0] not in (Status.FAILED, Status.CANCELLED):
                return row
            await s.run(FORGET_FROM_ERROR, id=workflow_id)
            # Attempts of steps that ended unrecorded (cut short by a cancellation, a timeout)
            # are not carried into the new run's count, nor their errors into its steps'.
            await s.run(FORGET_ATTEMPTS, workflow_id)
            await s.run(FORGET_STEP_ERRORS, workflow_id)
            await s.run(REQUEUE, workflow_id)
            return row

    async def fork(self, workflow_id: str, new_id: str, from_step: int) -> str | None:
        """A new queued workflow with the same name, queue and arguments, whose journal holds copies of
        the first ``from_step`` step records, its events those records published, its streams the
        chunks those steps had seen written, and its children the ended children those positions
        started; the queue of the new one (None: no such workflow)."""
        async with self.db.session() as s, s.transaction():
            # Born with attempt 1 (and counted from there): an execution of attempt 1 skips reading
            # a journal, since a new workflow has none; a fork has one.
            row = await s.row(FORK, new_id, workflow_id)
            if row is None:
                return None
            await s.run(FORK_STEPS, new_id, workflow_id, from_step)
            # The events its copied entries had published, each key's last: a replay publishes nothing.
            await s.run(FORK_EVENTS, new_id, workflow_id, from_step)
            # The children that the copied positions started and that have ended, under the ids the
            # fork's replay derives for them (<new id>.<position>, and .<n> for start_many): the
            # replay finds them ended instead of starting them again. (A child with an id of its own
            # is found under that id; one still running is started anew by the fork.)
            await s.run(FORK_CHILDREN, new=new_id, old=workflow_id, n=from_step)
            # The chunks written before the last copied step ended: a replay of the copied steps
            # skips exactly those positions, so the fork's streams have no gap.
            await s.run(FORK_CHUNKS, new=new_id, old=workflow_id, n=from_step)
            return row[0]

    async def prune(self, older_than: float, batch: int) -> int:
        """Delete up to ``batch`` workflows that finished more than ``older_than`` seconds ago, with
        their steps, step attempts' notes and errors and the names of their streams, in one short
        statement; how many went. The chunks are not deleted one by one: unreachable without their
        stream's name, they go with their partition (``drop_chunk_partitions``)."""
        row = await self.db.row(PRUNE, older_than, batch)
        return row[0] if row else 0
