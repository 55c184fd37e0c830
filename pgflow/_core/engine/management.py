"""The SQL of operations: listing workflows, looking into one, resuming and forking."""

from __future__ import annotations

from datetime import datetime
from typing import Any, NamedTuple

from ..status import Status
from .database import SNAPSHOT, Port, Sql

# The light record of a workflow (``pgflow.records.WorkflowRecord``): each of its fields, in order, and
# the column that gives it. The record's class checks on import that its fields are these.
RECORD_COLUMNS: tuple[tuple[str, str], ...] = (
    ("id", "id"), ("name", "name"), ("queue", "queue"), ("status", "status"),
    ("attempt", "attempt - attempt_base"), ("created_at", "created_at"), ("started_at", "started_at"),
    ("finished_at", "finished_at"), ("error_type", "error->>'type'"), ("parent_id", "parent_id"),
    ("due_at", "CASE WHEN status = 'queued' THEN due_at END"),
    ("waiting_for", "CASE WHEN status = 'queued' THEN waiting_for END"), ("retries", "retries"),
    ("expires_at", "expires_at"),
)
RECORD_FIELDS = tuple(field for field, _ in RECORD_COLUMNS)
RECORD = ", ".join(column for _, column in RECORD_COLUMNS)
# A recorded step as ``info`` reads it (``pgflow.records.StepInfo``), in the same way.
STEP_COLUMNS: tuple[tuple[str, str], ...] = (
    ("position", "position"), ("name", "name"), ("error_type", "error->>'type'"), ("attempts", "attempts"),
    ("finished_at", "finished_at"), ("started_at", "started_at"),
)
STEP_FIELDS = tuple(field for field, _ in STEP_COLUMNS)
# A child's id is its parent's, a dot and the journal position that started it, and for start_many a
# dot and its index (``workflow.new_id``); a child started with an id of its own takes no position.
_DERIVED = ("left(id, length(%(id)s) + 1) = %(id)s || '.'"
            " AND substr(id, length(%(id)s) + 2) ~ '^[0-9]{1,9}([.][0-9]{1,9})?$'")
_PART = "split_part(substr(id, length(%(id)s) + 2), '.', {})"
# A child as ``pgflow workflows show`` lists it (``pgflow.records.ChildInfo``), in the same way.
CHILD_COLUMNS: tuple[tuple[str, str], ...] = (
    ("id", "id"), ("name", "name"), ("status", "status"),
    ("position", f"CASE WHEN {_DERIVED} THEN {_PART.format(1)}::int END"),
    ("index", f"CASE WHEN {_DERIVED} THEN nullif({_PART.format(2)}, '')::int END"),
    ("attempt", "attempt - attempt_base"), ("created_at", "created_at"), ("started_at", "started_at"),
    ("finished_at", "finished_at"), ("error_type", "error->>'type'"),
)
CHILD_FIELDS = tuple(field for field, _ in CHILD_COLUMNS)
_CHILDREN = (f"SELECT {', '.join(f'{column} AS {field}' for field, column in CHILD_COLUMNS)}"
             " FROM {s}.workflows WHERE parent_id = %(id)s")  # by the workflows_parent index


class QueueRow(NamedTuple):
    """A queue with work or limits, as ``queues_overview`` reads it (the columns of its SELECT, in order)."""

    queue: str
    queued: int
    due: int
    waited: float | None  # seconds the oldest due one has waited
    running: int
    concurrency: int | None
    rate_limit: int | None
    rate_period: float | None
    paused_at: datetime | None


class WorkerRow(NamedTuple):
    """A registered worker, as ``workers_overview`` reads it (the columns of its SELECT, in order)."""

    id: str
    host: str
    pid: int
    queues: list[str]
    version: str
    heartbeat_age: float  # seconds since its heartbeat
    running: int  # workflows it holds
    names: list[str]
    lease_seconds: float | None  # None: a worker of a version that did not record it


class WaitingRow(NamedTuple):
    """A queue with work waiting for a worker now, as ``health`` reads it."""

    queue: str
    due: int  # queued workflows that are due
    orphaned: int  # running ones whose lease ran out
    oldest_due_waited: float | None  # seconds since the oldest due one fell due


class HealthRead(NamedTuple):
    """What ``health`` reads: the NOTIFY queue's usage, queued workflow names that no live worker runs
    with their counts, sessions of this database idle in a transaction for long, the oldest open
    transactions of the cluster while the NOTIFY queue holds anything (one of them that listens holds
    it back), and the queues with work waiting."""

    notification_queue_usage: float
    unserved: list[tuple[str, int]]
    stuck: list[tuple[Any, ...]]
    holders: list[tuple[Any, ...]]
    waiting: list[WaitingRow]


def _listing(order: str) -> Sql[tuple[Any, ...], ...]:
    """The light records of the workflows that match every filter given, by creation time in ``order``."""
    return Sql(
        f"SELECT {RECORD} FROM {{s}}.workflows"
        " WHERE (%(status)s::text IS NULL OR status = %(status)s)"
        " AND (%(name)s::text IS NULL OR name = %(name)s)"
        " AND (%(queue)s::text IS NULL OR queue = %(queue)s)"
        " AND (%(after)s::timestamptz IS NULL OR created_at > %(after)s)"
        " AND (%(before)s::timestamptz IS NULL OR created_at < %(before)s)"
        f" ORDER BY created_at {order}, id LIMIT %(limit)s")


LIST_OLDEST_FIRST, LIST_NEWEST_FIRST = _listing("ASC"), _listing("DESC")

# One workflow as ``info`` reads it: its record, its step records, its streams (key, chunks, closed).
INFO_RECORD = Sql(f"SELECT {RECORD} FROM {{s}}.workflows WHERE id = %s")
INFO_STEPS = Sql(f"SELECT {', '.join(column for _, column in STEP_COLUMNS)} FROM {{s}}.steps"
                 " WHERE workflow_id = %s ORDER BY position")
INFO_STREAMS = Sql(
    "SELECT key, count(*) FILTER (WHERE value IS NOT NULL), bool_or(value IS NULL) FROM {s}.streams"
    " WHERE workflow_id = %s GROUP BY key ORDER BY key")
# A workflow's children, the first %(limit)s by journal position; then how many there are, and the
# highest position a child or a step record took.
CHILDREN = Sql(f"SELECT * FROM ({_CHILDREN}) c ORDER BY position NULLS LAST, index NULLS FIRST, created_at, id"
               " LIMIT %(limit)s")
CHILDREN_COUNT = Sql(
    "SELECT count(*), coalesce(max(position), -1),"
    " coalesce((SELECT max(position) FROM {s}.steps WHERE workflow_id = %(id)s), -1)"
    f" FROM ({_CHILDREN}) c")

# A resume (``Management.resume``): the row locked, then its journal from the first error on, its
# attempts' notes, the errors of steps no longer recorded, and the row queued again.
RESUMING = Sql("SELECT status, queue FROM {s}.workflows WHERE id = %s FOR UPDATE")
FORGET_FROM_ERROR = Sql(
    "DELETE FROM {s}.steps WHERE workflow_id = %(id)s AND position >= coalesce("
    " (SELECT min(position) FROM {s}.steps WHERE workflow_id = %(id)s AND error IS NOT NULL),"
    " 2147483647)")
FORGET_ATTEMPTS = Sql("DELETE FROM {s}.step_attempts WHERE workflow_id = %s")
FORGET_STEP_ERRORS = Sql(
    "DELETE FROM {s}.step_errors e WHERE workflow_id = %s AND NOT EXISTS (SELECT FROM {s}.steps s"
    " WHERE s.workflow_id = e.workflow_id AND s.position = e.position)")
REQUEUE = Sql(
    "UPDATE {s}.workflows SET status = 'queued', attempt_base = attempt, retries = 0, due_at = {s}.clock_now(),"
    " output = NULL, error = NULL, finished_at = NULL, cancel_requested = false,"
    " deadline_at = NULL, lease_owner = NULL, lease_expires_at = NULL WHERE id = %s")

# A fork (``Management.fork``): the new row, then copies of the first steps' records, the events they
# published, the ended children they started and the chunks written before the last of them ended.
FORK = Sql(
    "INSERT INTO {s}.workflows (id, name, queue, priority, inputs, max_attempts, timeout,"
    "  attempt, attempt_base)"
    " SELECT %s, name, queue, priority, inputs, max_attempts, timeout, 1, 1 FROM {s}.workflows"
    " WHERE id = %s RETURNING queue")
FORK_STEPS = Sql(
    "INSERT INTO {s}.steps (workflow_id, position, name, output, error, attempts,"
    "  attempt, stream_ends, wake_at, waiting)"
    " SELECT %s, position, name, output, error, attempts, 0, stream_ends, wake_at, waiting"
    " FROM {s}.steps WHERE workflow_id = %s AND position < %s")
FORK_EVENTS = Sql(
    "INSERT INTO {s}.events (workflow_id, key, value)"
    " SELECT DISTINCT ON (name) %s, substr(name, length('pgflow.set_event:') + 1), output"
    " FROM {s}.steps WHERE workflow_id = %s AND position < %s AND name LIKE 'pgflow.set\\_event:%%'"
    " ORDER BY name, position DESC")
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
    " ON CONFLICT (id) DO NOTHING")
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
    " JOIN {s}.chunks c ON c.stream_id = copied.id AND c.position < copied.upto")

# Every queue with work, limits or a pause; every registered worker (``pgflow status``).
QUEUES_OVERVIEW = Sql(
    "WITH live AS (SELECT queue, count(*) FILTER (WHERE status = 'queued') AS queued,"
    "   count(*) FILTER (WHERE status = 'queued' AND due_at <= {s}.clock_now()) AS due,"
    "   extract(epoch FROM {s}.clock_now() - min(due_at) FILTER (WHERE status = 'queued'"
    "    AND due_at <= {s}.clock_now()))"
    "    AS waited,"
    "   count(*) FILTER (WHERE status = 'running') AS running"
    "  FROM {s}.workflows WHERE status IN ('queued', 'running') GROUP BY queue)"
    " SELECT coalesce(l.queue, q.name, p.name), coalesce(l.queued, 0), coalesce(l.due, 0), l.waited,"
    "  coalesce(l.running, 0), q.concurrency, q.rate_limit, q.rate_period, p.paused_at"
    " FROM live l FULL JOIN {s}.queues q ON q.name = l.queue"
    " FULL JOIN {s}.paused_queues p ON p.name = coalesce(l.queue, q.name) ORDER BY 1")
WORKERS_OVERVIEW = Sql(
    "SELECT w.id, w.host, w.pid, w.queues, w.version, extract(epoch FROM now() - w.heartbeat_at),"
    " (SELECT count(*) FROM {s}.workflows f WHERE f.lease_owner = w.id AND f.status = 'running'),"
    " w.names, w.lease FROM {s}.workers w ORDER BY w.started_at")

# What ``health`` reads, in one checkout.
QUEUE_USAGE = Sql("SELECT pg_notification_queue_usage()")
QUEUED_UNSERVED_BY = Sql(
    "SELECT name, count(*) FROM {s}.workflows WHERE status = 'queued' AND name <> ALL(%s::text[])"
    " GROUP BY name ORDER BY name")
_SESSIONS = ("SELECT pid, datname, application_name, state,"
             " extract(epoch FROM now() - xact_start)::float8 FROM pg_stat_activity"
             " WHERE xact_start IS NOT NULL AND pid <> pg_backend_pid()"
             " AND backend_type = 'client backend'")
STUCK = Sql(_SESSIONS + " AND datname = current_database() AND state LIKE 'idle in transaction%%'"
            " AND state_change < now() - make_interval(secs => %s) ORDER BY pid")
OLDEST_TRANSACTIONS = Sql(_SESSIONS + " ORDER BY xact_start LIMIT 5")
# The queues with work waiting for a worker now: due queued workflows (a delayed or sleeping one waits
# for its time, not for a worker), and running ones whose lease ran out (their worker died, and the
# next live worker of the queue takes them).
WAITING = Sql(
    "SELECT queue, count(*) FILTER (WHERE status = 'queued'), count(*) FILTER (WHERE status = 'running'),"
    " extract(epoch FROM {s}.clock_now() - min(due_at) FILTER (WHERE status = 'queued'))::float8"
    " FROM {s}.workflows WHERE (status = 'queued' AND due_at <= {s}.clock_now())"
    "  OR (status = 'running' AND lease_expires_at < now())"
    " GROUP BY queue ORDER BY queue")
# Who holds each of these advisory locks in this database (a bigint key shows in pg_locks as its high
# and low 32 bits: classid, objid).
LOCK_HOLDERS = Sql(
    "WITH asked AS (SELECT name, hashtext(name)::bigint AS key FROM unnest(%s::text[]) AS n(name))"
    " SELECT a.name, l.pid, s.usename, s.application_name,"
    "  extract(epoch FROM now() - s.backend_start)::float8"
    " FROM asked a JOIN pg_locks l ON l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
    "  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    "  AND l.classid = ((a.key >> 32) & 4294967295)::oid AND l.objid = (a.key & 4294967295)::oid"
    " LEFT JOIN pg_stat_activity s ON s.pid = l.pid ORDER BY a.name")
# Queued workflow names no worker heard from lately runs, with their counts.
UNSERVED = Sql(
    "SELECT name, count(*) FROM {s}.workflows WHERE status = 'queued' AND name <> ALL(coalesce("
    " (SELECT array_agg(DISTINCT n) FROM {s}.workers, unnest(names) AS n"
    "  WHERE heartbeat_at > now() - make_interval(secs => %s)), '{}'))"
    " GROUP BY name ORDER BY name")
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
    " SELECT count(*) FROM gone")


class Management(Port):
    async def list_workflows(self, status: str | None, name: str | None, queue: str | None,
                             created_after: datetime | None, created_before: datetime | None, limit: int,
                             newest_first: bool) -> list[tuple[Any, ...]]:
        """Light records of the workflows that match every filter given, by creation time."""
        return await self.db.rows(LIST_NEWEST_FIRST if newest_first else LIST_OLDEST_FIRST, {
            "status": status, "name": name, "queue": queue, "after": created_after, "before": created_before,
            "limit": limit})

    async def info(self, workflow_id: str) -> tuple[tuple[Any, ...], list[tuple[Any, ...]],
                                                    list[tuple[str, int, bool]]] | None:
        """The record, the step records and the streams (key, chunks, closed) of one workflow, from
        one snapshot; None when there is no such workflow."""
        async with self.db.session() as s, s.transaction():
            await s.run(SNAPSHOT)
            record = await s.row(INFO_RECORD, (workflow_id,))
            if record is None:
                return None
            steps = await s.rows(INFO_STEPS, (workflow_id,))
            streams = [(str(k), int(n), bool(c)) for k, n, c in await s.rows(INFO_STREAMS, (workflow_id,))]
            return tuple(record), steps, streams

    async def children(self, workflow_id: str, limit: int) -> tuple[list[tuple[Any, ...]], int, int]:
        """The workflows ``workflow_id``'s body started, from one snapshot: the first ``limit`` by
        journal position (those with ids of their own last), how many there are, and how many
        positions its journal has: one past the highest that a step record or a child took, which
        is what ``fork(from_step=N)`` counts (a child's start writes no step record)."""
        async with self.db.session() as s, s.transaction():
            await s.run(SNAPSHOT)
            params = {"id": workflow_id, "limit": limit}
            rows = await s.rows(CHILDREN, params)
            counted = await s.row(CHILDREN_COUNT, params)
            total, last_child, last_step = counted if counted else (0, -1, -1)
            return rows, int(total), max(int(last_child), int(last_step)) + 1

    async def resume(self, workflow_id: str) -> tuple[str, str] | None:
        """Queue a failed or cancelled workflow again from its first step record that holds an error
        (every record when none does): that record and every later one go, the others stay. Both its
        budgets start afresh, the runs ``max_attempts`` counts and the retries of its retry policy (a
        workflow whose policy was spent would otherwise fail again at its first failure).
        Returns the status it had and its queue (None: no such workflow); only "failed" and
        "cancelled" resume."""
        async with self.db.session() as s, s.transaction():
            row = await s.row(RESUMING, (workflow_id,))
            if row is None:
                return None
            if row[0] not in (Status.FAILED, Status.CANCELLED):
                return str(row[0]), str(row[1])
            await s.run(FORGET_FROM_ERROR, {"id": workflow_id})
            # Attempts of steps that ended unrecorded (cut short by a cancellation, a timeout)
            # are not carried into the new run's count, nor their errors into its steps'.
            await s.run(FORGET_ATTEMPTS, (workflow_id,))
            await s.run(FORGET_STEP_ERRORS, (workflow_id,))
            await s.run(REQUEUE, (workflow_id,))
            return str(row[0]), str(row[1])

    async def fork(self, workflow_id: str, new_id: str, from_step: int) -> str | None:
        """A new queued workflow with the same name, queue and arguments, whose journal holds copies of
        the first ``from_step`` step records, its events those records published, its streams the
        chunks those steps had seen written, and its children the ended children those positions
        started; the queue of the new one (None: no such workflow)."""
        async with self.db.session() as s, s.transaction():
            # Born with attempt 1 (and counted from there): an execution of attempt 1 skips reading
            # a journal, since a new workflow has none; a fork has one.
            row = await s.row(FORK, (new_id, workflow_id))
            if row is None:
                return None
            await s.run(FORK_STEPS, (new_id, workflow_id, from_step))
            # The events its copied entries had published, each key's last: a replay publishes nothing.
            await s.run(FORK_EVENTS, (new_id, workflow_id, from_step))
            # The children that the copied positions started and that have ended, under the ids the
            # fork's replay derives for them (<new id>.<position>, and .<n> for start_many): the
            # replay finds them ended instead of starting them again. (A child with an id of its own
            # is found under that id; one still running is started anew by the fork.)
            await s.run(FORK_CHILDREN, {"new": new_id, "old": workflow_id, "n": from_step})
            # The chunks written before the last copied step ended: a replay of the copied steps
            # skips exactly those positions, so the fork's streams have no gap.
            await s.run(FORK_CHUNKS, {"new": new_id, "old": workflow_id, "n": from_step})
            return str(row[0])

    async def queues_overview(self) -> list[QueueRow]:
        """Every queue with work, limits or a pause."""
        return [QueueRow._make(row) for row in await self.db.rows(QUEUES_OVERVIEW)]

    async def workers_overview(self) -> list[WorkerRow]:
        """Every registered worker."""
        return [WorkerRow._make(row) for row in await self.db.rows(WORKERS_OVERVIEW)]

    async def health(self, served_names: list[str], stuck_after: float) -> HealthRead:
        """What ``pgflow status`` reads in one checkout (see HealthRead): ``served_names`` are the
        workflow names the live workers run, as the caller found them. Sessions are (pid, database,
        application name, state, seconds the transaction has been open); a role without
        pg_read_all_stats sees the transactions of its own sessions only."""
        async with self.db.session() as s:
            row = await s.row(QUEUE_USAGE)
            usage = float(row[0]) if row else 0.0
            orphans = [(str(n), int(c)) for n, c in await s.rows(QUEUED_UNSERVED_BY, (served_names,))]
            stuck = await s.rows(STUCK, (stuck_after,))
            holders = await s.rows(OLDEST_TRANSACTIONS) if usage > 0 else []
            waiting = [WaitingRow(str(q), int(d), int(o), None if w is None else float(w))
                       for q, d, o, w in await s.rows(WAITING)]
            return HealthRead(usage, orphans, stuck, holders, waiting)

    async def lock_holders(self, locks: list[str]) -> list[tuple[Any, ...]]:
        """Who holds each of these advisory locks (``pg_advisory_lock(hashtext(name))``) in this
        database: (name, pid, role, application name, seconds the session has lived). A bigint key shows in
        pg_locks as its high and low 32 bits (classid, objid)."""
        return await self.db.rows(LOCK_HOLDERS, (locks,))

    async def unserved(self, silent_after: float) -> list[tuple[str, int]]:
        """Queued workflow names no worker with a heartbeat in the last ``silent_after`` seconds
        runs, with their counts."""
        return [(str(n), int(c)) for n, c in await self.db.rows(UNSERVED, (silent_after,))]

    async def prune(self, older_than: float, batch: int) -> int:
        """Delete up to ``batch`` workflows that finished more than ``older_than`` seconds ago, with
        their steps, step attempts' notes and errors and the names of their streams, in one short
        statement; how many went. The chunks are not deleted one by one: unreachable without their
        stream's name, they go with their partition (``drop_chunk_partitions``)."""
        row = await self.db.row(PRUNE, (older_than, batch))
        return int(row[0]) if row else 0
