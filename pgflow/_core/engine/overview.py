"""The fleet as ``pgflow status`` and ``pgflow workers`` see it: the queues with work, the registered
workers, and what ``health`` reads (``Management``'s reads of the fleet, apart from its reads and changes
of workflows)."""

from __future__ import annotations

from datetime import datetime
from typing import NamedTuple, cast

from .database import Port, Sql

# A session of the server (``_SESSIONS``): its pid, database, application name, state, and the seconds
# its transaction has been open.
SessionRow = tuple[int, str | None, str | None, str | None, float]
# A session holding an advisory lock (``LOCK_HOLDERS``): the lock's name, the session's pid, role and
# application name, and the seconds it has lived.
LockRow = tuple[str, int, str | None, str | None, float | None]

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
    stuck: list[SessionRow]
    holders: list[SessionRow]
    waiting: list[WaitingRow]


# Every queue with work, limits or a pause; every registered worker (``pgflow status``).
QUEUES_OVERVIEW = Sql(
    "WITH live AS (SELECT queue, count(*) FILTER (WHERE status = 'queued') AS queued,"
    "   count(*) FILTER (WHERE status = 'queued' AND due_at <= {s}.clock_now()) AS due,"
    "   extract(epoch FROM {s}.clock_now() - min(due_at) FILTER (WHERE status = 'queued'"
    "    AND due_at <= {s}.clock_now()))::float8"
    "    AS waited,"
    "   count(*) FILTER (WHERE status = 'running') AS running"
    "  FROM {s}.workflows WHERE status IN ('queued', 'running') GROUP BY queue)"
    " SELECT coalesce(l.queue, q.name, p.name), coalesce(l.queued, 0), coalesce(l.due, 0), l.waited,"
    "  coalesce(l.running, 0), q.concurrency, q.rate_limit, q.rate_period, p.paused_at"
    " FROM live l FULL JOIN {s}.queues q ON q.name = l.queue"
    " FULL JOIN {s}.paused_queues p ON p.name = coalesce(l.queue, q.name) ORDER BY 1", row=QueueRow)
WORKERS_OVERVIEW = Sql(
    "SELECT w.id, w.host, w.pid, w.queues, w.version, extract(epoch FROM now() - w.heartbeat_at)::float8,"
    " (SELECT count(*) FROM {s}.workflows f WHERE f.lease_owner = w.id AND f.status = 'running'),"
    " w.names, w.lease FROM {s}.workers w ORDER BY w.started_at", row=WorkerRow)


class Names(NamedTuple):
    names: list[str]


class Silent(NamedTuple):
    seconds: float


# What ``health`` reads, in one checkout.
QUEUE_USAGE = Sql("SELECT pg_notification_queue_usage()", row=tuple[float])
QUEUED_UNSERVED_BY = Sql(
    "SELECT name, count(*) FROM {s}.workflows WHERE status = 'queued' AND name <> ALL(%s::text[])"
    " GROUP BY name ORDER BY name", row=tuple[str, int], params=Names)
_SESSIONS = ("SELECT pid, datname, application_name, state,"
             " extract(epoch FROM now() - xact_start)::float8 FROM pg_stat_activity"
             " WHERE xact_start IS NOT NULL AND pid <> pg_backend_pid()"
             " AND backend_type = 'client backend'")
STUCK = Sql(_SESSIONS + " AND datname = current_database() AND state LIKE 'idle in transaction%%'"
            " AND state_change < now() - make_interval(secs => %s) ORDER BY pid",
            row=cast("type[SessionRow]", SessionRow), params=Silent)
OLDEST_TRANSACTIONS = Sql(_SESSIONS + " ORDER BY xact_start LIMIT 5", row=cast("type[SessionRow]", SessionRow))
# The queues with work waiting for a worker now: due queued workflows (a delayed or sleeping one waits
# for its time, not for a worker), and running ones whose lease ran out (their worker died, and the
# next live worker of the queue takes them).
WAITING = Sql(
    "SELECT queue, count(*) FILTER (WHERE status = 'queued'), count(*) FILTER (WHERE status = 'running'),"
    " extract(epoch FROM {s}.clock_now() - min(due_at) FILTER (WHERE status = 'queued'))::float8"
    " FROM {s}.workflows WHERE (status = 'queued' AND due_at <= {s}.clock_now())"
    "  OR (status = 'running' AND lease_expires_at < now())"
    " GROUP BY queue ORDER BY queue", row=WaitingRow)
# Who holds each of these advisory locks in this database (a bigint key shows in pg_locks as its high
# and low 32 bits: classid, objid).
LOCK_HOLDERS = Sql(
    "WITH asked AS (SELECT name, hashtext(name)::bigint AS key FROM unnest(%s::text[]) AS n(name))"
    " SELECT a.name, l.pid, s.usename, s.application_name,"
    "  extract(epoch FROM now() - s.backend_start)::float8"
    " FROM asked a JOIN pg_locks l ON l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
    "  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    "  AND l.classid = ((a.key >> 32) & 4294967295)::oid AND l.objid = (a.key & 4294967295)::oid"
    " LEFT JOIN pg_stat_activity s ON s.pid = l.pid ORDER BY a.name", row=cast("type[LockRow]", LockRow),
    params=Names)
# Queued workflow names no worker heard from lately runs, with their counts.
UNSERVED = Sql(
    "SELECT name, count(*) FROM {s}.workflows WHERE status = 'queued' AND name <> ALL(coalesce("
    " (SELECT array_agg(DISTINCT n) FROM {s}.workers, unnest(names) AS n"
    "  WHERE heartbeat_at > now() - make_interval(secs => %s)), '{}'))"
    " GROUP BY name ORDER BY name", row=tuple[str, int], params=Silent)


class Overview(Port):
    """``Management``'s reads of the fleet."""

    async def queues_overview(self) -> list[QueueRow]:
        """Every queue with work, limits or a pause."""
        return await self.db.rows(QUEUES_OVERVIEW)

    async def workers_overview(self) -> list[WorkerRow]:
        """Every registered worker."""
        return await self.db.rows(WORKERS_OVERVIEW)

    async def health(self, served_names: list[str], stuck_after: float) -> HealthRead:
        """What ``pgflow status`` reads in one checkout (see HealthRead): ``served_names`` are the
        workflow names the live workers run, as the caller found them. Sessions are (pid, database,
        application name, state, seconds the transaction has been open); a role without
        pg_read_all_stats sees the transactions of its own sessions only."""
        async with self.db.session() as s:
            row = await s.row(QUEUE_USAGE)
            usage = row[0] if row else 0.0
            orphans = await s.rows(QUEUED_UNSERVED_BY, served_names)
            stuck = await s.rows(STUCK, stuck_after)
            holders = await s.rows(OLDEST_TRANSACTIONS) if usage > 0 else []
            return HealthRead(usage, orphans, stuck, holders, await s.rows(WAITING))

    async def lock_holders(self, locks: list[str]) -> list[LockRow]:
        """Who holds each of these advisory locks (``pg_advisory_lock(hashtext(name))``) in this
        database: (name, pid, role, application name, seconds the session has lived). A bigint key shows in
        pg_locks as its high and low 32 bits (classid, objid)."""
        return await self.db.rows(LOCK_HOLDERS, locks)

    async def unserved(self, silent_after: float) -> list[tuple[str, int]]:
        """Queued workflow names no worker with a heartbeat in the last ``silent_after`` seconds
        runs, with their counts."""
        return await self.db.rows(UNSERVED, silent_after)

