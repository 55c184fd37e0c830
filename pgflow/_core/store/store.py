"""Every SQL statement pgflow runs against its tables, one method each.

The store knows rows, not workflows: it takes and returns bytes, strings and numbers, and leaves
encoding and the meaning of a step to the layers above. Writes made on behalf of an execution carry its
attempt number and only touch a row still held by that attempt (fencing), so a worker that lost its
lease cannot overwrite the work of the worker that took over.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import msgspec
import psycopg
from psycopg import AsyncConnection
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from . import migrations
from .streams import StreamStatements

log = logging.getLogger("pgflow.store")
T = TypeVar("T")


# NOTIFY payloads sent by the statement that carries them, on commit: (channel, payloads).
Pings = tuple[str, list[str]]
NO_PINGS: Pings = ("", [])
# A subquery that sends them; a statement that has nothing to announce passes NO_PINGS.
SEND_PINGS = "(SELECT count(pg_notify(%s, p)) AS sent FROM unnest(%b::text[]) AS p) AS pings"


# Claiming: each queue read by its own scan of the queued index in priority and due order, the scans
# merged, so a worker serving many queues reads no more rows than one serving one; and, in the same
# round trip, when the next delayed workflow falls due. (tests/test_claims.py checks the plan.)
CLAIM = (
    "WITH queued AS (SELECT c.id, c.priority, c.due_at FROM unnest(%(queues)s::text[]) AS q(queue)"
    "   CROSS JOIN LATERAL (SELECT id, priority, due_at FROM {s}.workflows"
    "    WHERE status = 'queued' AND queue = q.queue AND due_at <= now() AND name = ANY(%(names)s)"
    "    ORDER BY priority DESC, due_at LIMIT %(limit)s FOR UPDATE SKIP LOCKED) c),"
    " expired AS (SELECT id, priority, due_at FROM {s}.workflows"
    "   WHERE status = 'running' AND lease_expires_at < now() AND queue = ANY(%(queues)s)"
    "   AND name = ANY(%(names)s)"
    "   ORDER BY lease_expires_at LIMIT %(limit)s FOR UPDATE SKIP LOCKED),"
    " chosen AS (SELECT id FROM (SELECT * FROM queued UNION ALL SELECT * FROM expired) c"
    "   ORDER BY priority DESC, due_at LIMIT %(limit)s),"
    # A claim lost in a server crash harms nothing (the row is claimable again), so its
    # commit does not wait for the disk: only starts and finishes must.
    " lazy AS (SELECT set_config('synchronous_commit', 'off', true)),"
    " claimed AS (UPDATE {s}.workflows w SET status = 'running', attempt = w.attempt + 1,"
    "  lease_owner = %(owner)s, lease_expires_at = now() + make_interval(secs => %(lease)s),"
    "  started_at = coalesce(w.started_at, now()),"
    "  deadline_at = coalesce(w.deadline_at, now() + make_interval(secs => w.timeout))"
    "  FROM chosen WHERE w.id = chosen.id AND EXISTS (SELECT FROM lazy)"
    "  RETURNING w.id, w.name, w.inputs, w.attempt, w.max_attempts,"
    "   extract(epoch FROM w.deadline_at - now())::float8 AS seconds_left)"
    " SELECT id, name, inputs, attempt, max_attempts, seconds_left, NULL::float8 FROM claimed"
    " UNION ALL SELECT NULL, NULL, NULL, NULL, NULL, NULL,"
    "  extract(epoch FROM min(d.due_at) - now())::float8 FROM unnest(%(queues)s::text[]) AS q(queue)"
    "  CROSS JOIN LATERAL (SELECT due_at FROM {s}.workflows WHERE status = 'queued'"
    "   AND queue = q.queue AND due_at > now() AND name = ANY(%(names)s) ORDER BY due_at LIMIT 1) d"
)


@dataclass(frozen=True, slots=True)
class Claimed:
    """A workflow this worker now holds a lease on."""

    id: str
    name: str
    inputs: bytes
    attempt: int
    max_attempts: int | None
    seconds_left: float | None  # until the workflow's timeout; None without one


@dataclass(frozen=True, slots=True)
class StepRecord:
    position: int
    name: str
    output: bytes | None
    error: dict[str, Any] | None
    exception: bytes | None
    stream_ends: dict[str, int] | None


@dataclass(frozen=True, slots=True)
class WorkflowRow:
    id: str
    name: str
    status: str
    output: bytes | None
    error: dict[str, Any] | None


class Store(StreamStatements):
    """The SQL layer over one schema, using a pool of autocommit connections."""

    def __init__(self, pool: AsyncConnectionPool[Any], schema: str) -> None:
        self.pool = pool
        self.schema = schema
        self._s = quote_identifier(schema)

    def _sql(self, template: str) -> str:
        return template.replace("{s}", self._s)

    async def migrate(self) -> list[migrations.Migration]:
        async with self.pool.connection() as conn:
            return await migrations.migrate(conn, self._s)

    async def schema_version(self) -> int:
        async with self.pool.connection() as conn:
            return await migrations.applied_version(conn, self._s)

    # -- starting and looking at workflows ------------------------------------------------------------

    async def enqueue(
        self, id: str, name: str, queue: str, priority: int, inputs: bytes, delay: float,
        max_attempts: int | None, timeout: float | None = None, pings: Pings = NO_PINGS,
    ) -> tuple[bool, str]:
        """Insert a queued workflow unless the id exists; return (created, name of the row's workflow).
        ``pings`` go out with the commit."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(self._sql(
                "WITH new AS ("
                " INSERT INTO {s}.workflows"
                "  (id, name, queue, priority, inputs, due_at, max_attempts, timeout)"
                " VALUES (%s, %s, %s, %s, %s, now() + make_interval(secs => %s), %s, %s)"
                " ON CONFLICT (id) DO NOTHING RETURNING name)"
                " SELECT true, name FROM new"
                " UNION ALL SELECT false, name FROM {s}.workflows WHERE id = %s AND NOT EXISTS (SELECT FROM new)"
                " UNION ALL SELECT NULL, NULL FROM " + SEND_PINGS + " WHERE sent < 0"
            ), (id, name, queue, priority, inputs, delay, max_attempts, timeout, id, *pings))
            row = await cur.fetchone()
        if row is None:
            # The row was inserted by a concurrent start whose commit we could not see yet; ours
            # waited on its unique index entry, so it is committed now.
            return False, await self._name_of(id)
        return bool(row[0]), str(row[1])

    async def _name_of(self, id: str) -> str:
        row = await self._fetchone("SELECT name FROM {s}.workflows WHERE id = %s", (id,))
        if row is None:
            raise LookupError(id)
        return str(row[0])

    async def workflow(self, id: str) -> WorkflowRow | None:
        row = await self._fetchone(
            "SELECT id, name, status, output, error FROM {s}.workflows WHERE id = %s", (id,)
        )
        return None if row is None else WorkflowRow(*row)

    async def request_cancel(self, id: str) -> str | None:
        """Cancel a queued workflow at once, or flag a running one; return its status afterwards."""
        row = await self._fetchone(
            "UPDATE {s}.workflows SET"
            " status = CASE WHEN status = 'queued' THEN 'cancelled' ELSE status END,"
            " finished_at = CASE WHEN status = 'queued' THEN now() ELSE finished_at END,"
            " cancel_requested = status IN ('queued', 'running')"
            " WHERE id = %s RETURNING status",
            (id,),
        )
        return None if row is None else str(row[0])

    # -- claiming and leases ---------------------------------------------------------------------------

    async def claim(self, owner: str, queues: Sequence[str], names: Sequence[str], limit: int,
                    lease: float) -> tuple[list[Claimed], float | None]:
        """Take up to ``limit`` due workflows, queued or with an expired lease, best priority first.

        Only workflows named in ``names`` are taken: a worker never claims one it cannot run. Also
        returns in how many seconds the next delayed one falls due (None when none waits).
        """
        async with self.pool.connection() as conn:
            return await self._claim(conn, owner, queues, names, limit, lease)

    async def claim_limited(self, owner: str, queue: str, names: Sequence[str], limit: int,
                            lease: float) -> tuple[list[Claimed], float | None, float | None]:
        """Claim from a queue with limits, holding its row lock so the limits hold across workers:
        at most ``concurrency`` live leases at once, and starts paced by a token bucket.

        Returns the claimed workflows, the seconds until the next delayed one falls due (see
        ``claim``), and, when the bucket ran dry, the seconds until its next token.
        """
        async with self.pool.connection() as conn, conn.transaction():
            # Lock first, count after: the count's snapshot must include the claims of whoever held
            # the lock before us (a count taken in the locking statement would predate them).
            cur = await conn.execute(self._sql(
                "SELECT concurrency, rate_limit, rate_period,"
                "  least(rate_limit, tokens + rate_limit * extract(epoch FROM now() - refilled_at) / rate_period)"
                " FROM {s}.queues WHERE name = %s FOR UPDATE"
            ), (queue,))
            row = await cur.fetchone()
            if row is None:
                return (*await self._claim(conn, owner, [queue], names, limit, lease), None)
            concurrency, rate_limit, period, tokens = row
            if concurrency is not None:
                cur = await conn.execute(self._sql(
                    "SELECT count(*) FROM {s}.workflows"
                    " WHERE queue = %s AND status = 'running' AND lease_expires_at >= now()"
                ), (queue,))
                running = await cur.fetchone()
                limit = min(limit, concurrency - int(running[0] if running else 0))
            if rate_limit is not None:
                limit = min(limit, int(tokens))
            claimed, due = await self._claim(conn, owner, [queue], names, limit, lease) if limit > 0 else ([], None)
            if rate_limit is None:
                return claimed, due, None
            left = float(tokens) - len(claimed)
            await conn.execute(self._sql(
                "UPDATE {s}.queues SET tokens = %s, refilled_at = now() WHERE name = %s"
            ), (left, queue))
            return claimed, due, (1 - left) * float(period) / rate_limit if left < 1 else None

    async def _claim(self, conn: AsyncConnection[Any], owner: str, queues: Sequence[str],
                     names: Sequence[str], limit: int, lease: float) -> tuple[list[Claimed], float | None]:
        """Claim up to ``limit`` (see ``claim``); also say in how many seconds the next delayed
        workflow of these queues falls due (None when none waits), in the same round trip.

        Each queue is read by its own scan of the queued index, in priority and due order, and the
        scans are merged: a worker serving many queues reads no more rows than one serving one."""
        cur = await conn.execute(self._sql(CLAIM
        ), {"queues": list(queues), "names": list(names), "limit": limit, "owner": owner,
            "lease": lease})
        rows = await cur.fetchall()
        due = rows[-1][6]
        claimed = [Claimed(id, name, inputs, attempt, max_attempts, None if left is None else float(left))
                   for id, name, inputs, attempt, max_attempts, left, _ in rows[:-1]]
        return claimed, None if due is None else max(0.0, float(due))

    async def declare_queue(self, name: str, concurrency: int | None, rate_limit: int | None,
                            rate_period: float) -> None:
        """Record a queue's limits (the bucket starts full), or forget them when there are none."""
        async with self.pool.connection() as conn:
            if concurrency is None and rate_limit is None:
                await conn.execute(self._sql("DELETE FROM {s}.queues WHERE name = %s"), (name,))
                return
            await conn.execute(self._sql(
                "INSERT INTO {s}.queues AS q (name, concurrency, rate_limit, rate_period, tokens)"
                " VALUES (%(name)s, %(concurrency)s, %(rate)s, %(period)s, coalesce(%(rate)s, 0))"
                " ON CONFLICT (name) DO UPDATE SET concurrency = excluded.concurrency,"
                "  rate_limit = excluded.rate_limit, rate_period = excluded.rate_period,"
                "  tokens = least(q.tokens, coalesce(excluded.rate_limit, 0))"
            ), {"name": name, "concurrency": concurrency, "rate": rate_limit, "period": rate_period})

    # -- the worker registry ---------------------------------------------------------------------------

    async def register_worker(self, id: str, host: str, pid: int, queues: Sequence[str],
                              version: str) -> None:
        async with self.pool.connection() as conn:
            await conn.execute(self._sql(
                "INSERT INTO {s}.workers (id, host, pid, queues, version) VALUES (%s, %s, %s, %s, %s)"
            ), (id, host, pid, list(queues), version))

    async def unregister_worker(self, id: str) -> None:
        async with self.pool.connection() as conn:
            await conn.execute(self._sql("DELETE FROM {s}.workers WHERE id = %s"), (id,))

    async def heartbeat(self, owner: str, lease: float, host: str, pid: int, queues: Sequence[str],
                        version: str) -> list[tuple[str, int, bool]]:
        """Say this worker lives and extend every lease ``owner`` holds, in one statement; return
        (id, attempt, cancel requested) per lease. A heartbeat lost in a crash harms nothing (the
        leases simply run out), so it does not wait for the disk."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(self._sql(
                # An upsert: a worker the others forgot (it was cut off for a while) comes back.
                "WITH alive AS (INSERT INTO {s}.workers (id, host, pid, queues, version)"
                "   VALUES (%(owner)s, %(host)s, %(pid)s, %(queues)s, %(version)s)"
                "   ON CONFLICT (id) DO UPDATE SET heartbeat_at = now()),"
                " lazy AS (SELECT set_config('synchronous_commit', 'off', true))"
                # Rows are locked in id order, as stream batches lock them, so the two cannot deadlock.
                " UPDATE {s}.workflows SET lease_expires_at = now() + make_interval(secs => %(lease)s)"
                " WHERE id IN (SELECT id FROM {s}.workflows WHERE lease_owner = %(owner)s"
                "  AND status = 'running' ORDER BY id FOR UPDATE) AND EXISTS (SELECT FROM lazy)"
                " RETURNING id, attempt, cancel_requested"
            ), {"owner": owner, "lease": lease, "host": host, "pid": pid,
                "queues": list(queues), "version": version})
            return [(str(r[0]), int(r[1]), bool(r[2])) for r in await cur.fetchall()]

    async def forget_workers(self, silent_for: float) -> int:
        """Forget the workers whose heartbeat has been silent for ``silent_for`` seconds."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(self._sql(
                "DELETE FROM {s}.workers WHERE heartbeat_at < now() - make_interval(secs => %s)"
            ), (silent_for,))
            return int(cur.rowcount)

    async def release(self, id: str, attempt: int) -> bool:
        """Give a workflow back to the queue now, so another worker resumes it without waiting."""
        row = await self._fetchone(
            "UPDATE {s}.workflows SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL"
            " WHERE id = %s AND attempt = %s AND status = 'running' RETURNING 1",
            (id, attempt),
        )
        return row is not None

    # -- the journal -----------------------------------------------------------------------------------

    async def journal(self, workflow_id: str) -> dict[int, StepRecord]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(self._sql(
                "SELECT position, name, output, error, exception, stream_ends FROM {s}.steps"
                " WHERE workflow_id = %s"
            ), (workflow_id,))
            return {row[0]: StepRecord(*row) for row in await cur.fetchall()}

    async def steps(self, workflow_id: str) -> list[tuple[int, str, str | None, int, Any]]:
        """(position, name, error type or None, attempts, finished_at) of each recorded step, in order."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(self._sql(
                "SELECT position, name, error->>'type', attempts, finished_at FROM {s}.steps"
                " WHERE workflow_id = %s ORDER BY position"
            ), (workflow_id,))
            return [tuple(row) for row in await cur.fetchall()]

    async def record_step(
        self, workflow_id: str, attempt: int, position: int, name: str, output: bytes | None,
        error: dict[str, Any] | None, exception: bytes | None, attempts: int,
        stream_ends: dict[str, int] | None = None,
    ) -> tuple[bool, bool]:
        """Record a finished step for the execution holding ``attempt``.

        Returns (still owner, cancel requested). The workflow row is share-locked for the insert, so a
        takeover cannot slip in between the fencing check and the write.
        """
        row = await self._fetchone(
            "WITH owner AS (SELECT cancel_requested FROM {s}.workflows"
            "  WHERE id = %(id)s AND attempt = %(attempt)s AND status = 'running' FOR SHARE),"
            " written AS (INSERT INTO {s}.steps"
            "  (workflow_id, position, name, output, error, exception, attempts, attempt, stream_ends)"
            "  SELECT %(id)s, %(position)s, %(name)s, %(output)s, %(error)s, %(exception)s,"
            "   %(attempts)s, %(attempt)s, %(stream_ends)s FROM owner"
            "  ON CONFLICT (workflow_id, position) DO NOTHING RETURNING 1)"
            " SELECT (SELECT cancel_requested FROM owner), (SELECT count(*) FROM written)",
            {"id": workflow_id, "attempt": attempt, "position": position, "name": name,
             "output": output, "error": _jsonb(error), "exception": exception, "attempts": attempts,
             "stream_ends": _jsonb(stream_ends or None)},
        )
        assert row is not None
        return row[0] is not None, bool(row[0])

    async def finish(
        self, workflow_id: str, attempt: int, status: str, output: bytes | None,
        error: dict[str, Any] | None, pings: Pings = NO_PINGS,
    ) -> bool:
        """Record the end of an execution; False when the attempt no longer owns the workflow.
        ``pings`` go out with the commit."""
        row = await self._fetchone(
            "WITH done AS (UPDATE {s}.workflows SET status = %s, output = %s, error = %s,"
            "  finished_at = now(), lease_owner = NULL, lease_expires_at = NULL"
            "  WHERE id = %s AND attempt = %s AND status = 'running' RETURNING 1)"
            " SELECT (SELECT count(*) FROM done), (SELECT sent FROM " + SEND_PINGS + ")",
            (status, output, _jsonb(error), workflow_id, attempt, *pings),
        )
        return row is not None and bool(row[0])

    async def _fetchone(self, template: str, params: Any) -> tuple[Any, ...] | None:
        async with self.pool.connection() as conn:
            cur = await conn.execute(self._sql(template), params)
            row: tuple[Any, ...] | None = await cur.fetchone()
            return row


def _jsonb(value: dict[str, Any] | None) -> Jsonb | None:
    return None if value is None else Jsonb(value, dumps=lambda v: msgspec.json.encode(v).decode())


def quote_identifier(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


# Server states that pass: it is shutting down or starting (a restart, a failover), it ended the
# session, or it has no connection slot free right now.
_PASSING_STATES = frozenset({"57P01", "57P02", "57P03", "53300"})


def unreachable(exc: BaseException) -> bool:
    """True when the server could not be reached or went away, which waiting may mend. Every other
    error (a value the server refuses, a statement over one of its limits) comes back the same however
    often the statement is tried."""
    if not isinstance(exc, psycopg.OperationalError):
        return False
    state = exc.sqlstate
    return state is None or state.startswith("08") or state in _PASSING_STATES


async def retrying(operation: Callable[[], Awaitable[T]], what: str, patience: float = 10.0) -> T:
    """Run an idempotent database operation, trying again while the server cannot be reached (a
    restart, a failover) for up to ``patience`` seconds; then the last error propagates. Errors that
    trying again cannot mend propagate at once."""
    deadline = anyio.current_time() + patience
    delay = 0.05
    while True:
        try:
            return await operation()
        except psycopg.OperationalError as exc:
            if not unreachable(exc) or anyio.current_time() + delay > deadline:
                raise
            log.warning("%s failed (%s); trying again in %.2fs", what, exc, delay)
            await anyio.sleep(delay)
            delay = min(delay * 2, 1.0)
