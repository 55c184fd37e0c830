"""Every SQL statement pgflow runs against its tables, one method each.

The store knows rows, not workflows: it takes and returns bytes, strings and numbers, and leaves
encoding and the meaning of a step to the layers above. Writes made on behalf of an execution carry its
attempt number and only touch a row still held by that attempt (fencing), so a worker that lost its
lease cannot overwrite the work of the worker that took over.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, NamedTuple, TypeVar

import anyio
import msgspec
import psycopg
from psycopg.types.json import Jsonb
from psycopg_pool import PoolClosed

from . import migrations
from .channel import ChannelStatements
from .claims import ClaimStatements
from .clock import ClockStatements
from .debounces import DebounceStatements
from .details import DetailStatements
from .ends import EndStatements
from .fencing import HOLDS_LOCKED, OWNER_LOCKED, Fence, StepStart, held
from .management import ManagementStatements
from .partitions import PartitionStatements
from .pausing import PausingStatements
from .reruns import RerunStatements
from .starts import BORN, StartStatements
from .streams import StreamStatements
from .waits import WaitStatements

log = logging.getLogger("pgflow.store")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StepRecord:
    position: int
    name: str
    output: bytes | None
    error: dict[str, Any] | None
    stream_ends: dict[str, int] | None
    wake_at: datetime | None = None  # a sleep's wake-up time
    remaining: float | None = None  # seconds until wake_at when the journal was read
    waiting: bool = False  # a receive that has no message yet (wake_at is its deadline)



# A journal's records, their columns in StepRecord's order (``journal_of`` builds them by position),
# and one more row (its name NULL) holding the highest position from which the body started a child: a
# child's id is its parent's, a dot and the position (and for start_many a dot and its index), so a run
# that started one there reached that position without a record.
_RECORD_COLUMNS = {"remaining": "extract(epoch FROM wake_at - {s}.clock_now())::float8"}
JOURNAL = (
    f"SELECT {', '.join(_RECORD_COLUMNS.get(f.name, f.name) for f in fields(StepRecord))}"
    " FROM {s}.steps WHERE workflow_id = %(id)s"
    " UNION ALL SELECT max(split_part(substr(id, length(%(id)s) + 2), '.', 1)::int), NULL, NULL, NULL, NULL,"
    "  NULL, NULL, false FROM {s}.workflows WHERE parent_id = %(id)s"
    "  AND left(id, length(%(id)s) + 1) = %(id)s || '.'"
    "  AND substr(id, length(%(id)s) + 2) ~ '^[0-9]{1,9}([.][0-9]+)?$'"
)


def journal_of(rows: Sequence[tuple[Any, ...]]) -> tuple[dict[int, StepRecord], int]:
    """``JOURNAL``'s rows as the records by position, and the horizon."""
    journal = {row[0]: StepRecord(*row) for row in rows if row[1] is not None}
    children = max((row[0] for row in rows if row[1] is None and row[0] is not None), default=-1)
    return journal, max(children, max(journal, default=-1))


@dataclass(frozen=True, slots=True)
class WorkflowRow:
    id: str
    name: str
    status: str
    attempt: int  # claims so far: an end read of attempt N is newer than a row read before it ran
    output: bytes | None
    error: dict[str, Any] | None
    born: int  # its created_at in microseconds: a workflow started again under a pruned one's id is another


WORKFLOW_ROW = f"id, name, status, attempt, output, error, {BORN}"  # WorkflowRow's fields, in order


class Cancelled(NamedTuple):
    """What ``request_cancel`` did: the workflow's ``status`` afterwards, and the ids of the
    ``descendants`` it cancelled or flagged."""

    status: str
    descendants: list[str]


class Held(NamedTuple):
    """A lease a heartbeat extended: on the workflow ``id``, claim number ``attempt``."""

    id: str
    attempt: int
    cancel_requested: bool


def new_fence(worker: str) -> str:
    """The worker's fence (migration 0026) if it has none, with a new epoch; ``worker``: its id's parameter."""
    return (f"INSERT INTO {{s}}.worker_fences (worker, epoch) VALUES (%({worker})s, (random() * 4e18)::int8)"
            " ON CONFLICT (worker) DO NOTHING")


class Store(StartStatements, ClaimStatements, EndStatements, StreamStatements, ManagementStatements, WaitStatements,
            ChannelStatements, DetailStatements, ClockStatements, RerunStatements, PartitionStatements,
            DebounceStatements, PausingStatements):
    """The SQL layer over one schema, using a pool of autocommit connections."""

    async def migrate(self) -> list[migrations.Migration]:
        # Unbounded: a migration may build an index on a big table, or wait for another process's.
        async with self.pool.connection(within=math.inf) as conn:
            return await migrations.migrate(conn, self._s)

    async def schema_version(self) -> int:
        async with self.pool.connection() as conn:
            return await migrations.applied_version(conn, self._s)

    # -- starting and looking at workflows ------------------------------------------------------------

    async def existing(self, ids: list[str]) -> set[str]:
        """Which of ``ids`` name workflows."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(self._sql("SELECT id FROM {s}.workflows WHERE id = ANY(%s)"), (ids,))
            return {str(row[0]) for row in await cur.fetchall()}

    async def workflow(self, id: str) -> WorkflowRow | None:
        row = await self._fetchone(f"SELECT {WORKFLOW_ROW} FROM {{s}}.workflows WHERE id = %s", (id,))
        return None if row is None else WorkflowRow(*row)

    async def request_cancel(self, id: str) -> Cancelled | None:
        """Cancel a queued workflow at once, or flag a running one, and the same for every workflow
        its body started (children, theirs, ...) that has not ended. None: no such workflow."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(self._sql(
                "WITH RECURSIVE tree AS (SELECT id FROM {s}.workflows WHERE id = %(id)s"
                "  UNION SELECT w.id FROM {s}.workflows w JOIN tree ON w.parent_id = tree.id),"
                " asked AS (UPDATE {s}.workflows SET"
                "  status = CASE WHEN status = 'queued' THEN 'cancelled' ELSE status END,"
                "  finished_at = CASE WHEN status = 'queued' THEN {s}.clock_now() ELSE finished_at END,"
                "  cancel_requested = status IN ('queued', 'running')"
                "  WHERE id IN (SELECT id FROM tree) AND (id = %(id)s OR status IN ('queued', 'running'))"
                "  RETURNING id, status)"
                " SELECT id, status FROM asked ORDER BY id = %(id)s DESC"
            ), {"id": id})
            rows = await cur.fetchall()
        if not rows or rows[0][0] != id:
            return None
        return Cancelled(str(rows[0][1]), [str(r[0]) for r in rows[1:]])

    async def cancels_requested(self, ids: Sequence[str]) -> list[str]:
        """Those of ``ids`` still running whose cancellation was asked for."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(self._sql(
                "WITH " + held("cancelling", "(SELECT unnest(%s::text[]) AS id)", "w.id", by="w.cancel_requested")
                + " SELECT id FROM cancelling"),
                (list(ids),))
            return [str(row[0]) for row in await cur.fetchall()]

    # -- the worker registry ---------------------------------------------------------------------------

    async def register_worker(self, id: str, host: str, pid: int, queues: Sequence[str],
                              version: str, names: Sequence[str], lease_seconds: float | None = None) -> None:
        async with self.pool.connection() as conn:
            await conn.execute(self._sql(
                "WITH fence AS (" + new_fence("id") + ")"
                " INSERT INTO {s}.workers (id, host, pid, queues, version, names, lease)"
                " VALUES (%(id)s, %(host)s, %(pid)s, %(queues)s, %(version)s, %(names)s, %(lease)s)"
            ), {"id": id, "host": host, "pid": pid, "queues": list(queues), "version": version, "names": list(names),
                "lease": lease_seconds})

    async def unregister_worker(self, id: str) -> None:
        async with self.pool.connection() as conn:
            await conn.execute(self._sql(
                "WITH gone AS (DELETE FROM {s}.worker_fences WHERE worker = %(id)s)"
                " DELETE FROM {s}.workers WHERE id = %(id)s"), {"id": id})

    async def heartbeat(self, owner: str, lease_seconds: float, host: str, pid: int, queues: Sequence[str],
                        version: str, names: Sequence[str], running: Sequence[str],
                        within: float) -> list[Held]:
        """Say this worker lives and extend the leases ``owner`` holds on the workflows it is still
        ``running``, in one statement; return each lease extended. (Not every
        lease it holds: one on a workflow it gave up, whose release failed, must run out.)

        A heartbeat lost in a crash harms nothing (the leases simply run out), so it does not wait
        for the disk. One not answered ``within`` seconds is abandoned with its connection: the next
        one, on a fresh link, may still come in time."""
        async with self.pool.connection(within=within) as conn:
            cur = await conn.execute(self._sql(
                # An upsert: a worker the others forgot (it was cut off for a while) comes back.
                "WITH alive AS (INSERT INTO {s}.workers (id, host, pid, queues, version, names, lease)"
                "   VALUES (%(owner)s, %(host)s, %(pid)s, %(queues)s, %(version)s, %(names)s, %(lease)s)"
                "   ON CONFLICT (id) DO UPDATE SET heartbeat_at = now()),"
                # (a fence lost with a crash or a failover is made anew, with another epoch)
                " fence AS (" + new_fence("owner") + "),"
                " lazy AS (SELECT set_config('synchronous_commit', 'off', true)),"
                # (``running`` comes sorted: the rows are locked in id order)
                " " + held("renewed", "(SELECT unnest(%(running)s::text[]) AS id)", "w.id", lock=" FOR UPDATE",
                       by="w.lease_owner = %(owner)s") +
                " UPDATE {s}.workflows SET lease_expires_at = now() + make_interval(secs => %(lease)s)"
                " WHERE id IN (SELECT id FROM renewed) AND EXISTS (SELECT FROM lazy)"
                " RETURNING id, attempt, cancel_requested"
            ), {"owner": owner, "lease": lease_seconds, "host": host, "pid": pid,
                "queues": list(queues), "version": version, "names": list(names), "running": list(running)})
            return [Held(str(r[0]), int(r[1]), bool(r[2])) for r in await cur.fetchall()]

    async def forget_workers(self, silent_for: float) -> int:
        """Forget the workers whose heartbeat has been silent for ``silent_for`` seconds."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(self._sql(
                "WITH forgotten AS (DELETE FROM {s}.workers WHERE heartbeat_at < now() - make_interval(secs => %s)"
                "  RETURNING id),"
                # (their fences locked in the order claims lock them: see claims.CLAIM)
                " doomed AS (SELECT worker FROM {s}.worker_fences WHERE worker IN (SELECT id FROM forgotten)"
                "  ORDER BY worker FOR UPDATE),"
                " gone AS (DELETE FROM {s}.worker_fences WHERE worker IN (SELECT worker FROM doomed))"
                " SELECT count(*) FROM forgotten"
            ), (silent_for,))
            row = await cur.fetchone()
            return int(row[0]) if row else 0

    async def release(self, id: str, claim_token: int, fence_cut: str | None = None) -> bool:
        """Give a workflow back to the queue now, so another worker resumes it without waiting.
        ``fence_cut``: a batch of the run's chunks under that worker's fence was cut off and may still
        run; the release moves the fence on in its own statement, so it commits only after that batch
        (which does not lock this row) has ended, and one not yet past the fence is refused."""
        row = await self._fetchone(
            ("WITH moved AS (UPDATE {s}.worker_fences SET epoch = epoch + 1 WHERE worker = %s RETURNING 1),"
             if fence_cut is not None else "WITH")
            + " held AS (" + HOLDS_LOCKED + ")"
            " UPDATE {s}.workflows SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL"
            " WHERE id = (SELECT id FROM held) RETURNING 1",
            (fence_cut, id, claim_token) if fence_cut is not None else (id, claim_token),
        )
        return row is not None

    # -- the journal -----------------------------------------------------------------------------------

    async def journal(self, workflow_id: str) -> tuple[dict[int, StepRecord], int]:
        """The journal of a workflow, and its horizon: the highest position an earlier run reached,
        by a record or by a child it started from that position (``<id>.<position>[.<n>]``), -1
        when none; one round trip."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(self._sql(JOURNAL), {"id": workflow_id})
            return journal_of(await cur.fetchall())

    async def start_steps(self, notes: Sequence[StepStart]) -> list[Fence]:
        """Note, for each start, that the execution holding its claim token starts that attempt of
        the step, before the step runs, so an attempt cut short by a crash still counts.

        Idempotent (a row keeps the highest count), and not waiting for the disk: a worker's crash
        loses nothing, and only a server crash before the step's record could forget an attempt
        that the crash itself cut short."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(self._sql(
                "WITH asked AS (SELECT * FROM unnest(%s::text[], %s::int[], %s::int8[], %s::int[], %s::int[])"
                "   WITH ORDINALITY AS a(id, attempt, lease, position, tries, n)),"
                " " + held("owner", "asked", "a.*, w.cancel_requested") + ","
                " lazy AS (SELECT set_config('synchronous_commit', 'off', true)),"
                # (started_at on the schema's clock, as the step's finished_at is: see 0019_clock.sql)
                " noted AS (INSERT INTO {s}.step_attempts (workflow_id, position, attempt, tries, started_at)"
                "  SELECT DISTINCT ON (id, position, attempt) id, position, attempt, tries, {s}.clock_now()"
                "  FROM owner, lazy"
                "  ORDER BY id, position, attempt, tries DESC"
                "  ON CONFLICT (workflow_id, position, attempt)"
                "  DO UPDATE SET tries = greatest(step_attempts.tries, excluded.tries))"
                " SELECT a.n, o.cancel_requested FROM asked a LEFT JOIN owner o ON o.n = a.n ORDER BY a.n"),
                [list(column) for column in zip(*notes, strict=True)])
            return [Fence(cancel is not None, bool(cancel)) for _, cancel in await cur.fetchall()]

    async def record_step(
        self, workflow_id: str, attempt: int, claim_token: int, position: int, name: str, output: bytes | None,
        error: dict[str, Any] | None, attempts: int, stream_ends: dict[str, int] | None = None,
    ) -> Fence:
        """Record a finished step for the execution holding ``attempt`` under ``claim_token``.

        The workflow row is share-locked for the insert, so a takeover cannot slip in between the
        fencing check and the write.
        """
        row = await self._fetchone(
            "WITH " + OWNER_LOCKED + ","
            # The attempts every execution started, this one's included: the record counts them all.
            " started AS (DELETE FROM {s}.step_attempts WHERE workflow_id = %(id)s AND position = %(position)s"
            "  AND EXISTS (SELECT FROM owner) RETURNING tries, attempt, started_at),"
            # Its start: this execution's first attempt's (the duration a reader sees is this run's).
            " written AS (INSERT INTO {s}.steps"
            "  (workflow_id, position, name, output, error, attempts, attempt, stream_ends, started_at)"
            "  SELECT %(id)s, %(position)s, %(name)s, %(output)s, %(error)s,"
            "   greatest(%(attempts)s, (SELECT sum(tries) FROM started))::int, %(attempt)s, %(stream_ends)s,"
            "   coalesce((SELECT started_at FROM started WHERE attempt = %(attempt)s),"
            "    (SELECT max(started_at) FROM started))"
            "  FROM owner ON CONFLICT (workflow_id, position) DO NOTHING RETURNING 1)"
            " SELECT (SELECT cancel_requested FROM owner), (SELECT count(*) FROM written)",
            {"id": workflow_id, "attempt": attempt, "lease": claim_token, "position": position, "name": name,
             "output": output, "error": _jsonb(error), "attempts": attempts,
             "stream_ends": _jsonb(stream_ends or None)},
        )
        assert row is not None
        return Fence(row[0] is not None, bool(row[0]))



def _jsonb(value: dict[str, Any] | None) -> Jsonb | None:
    return None if value is None else Jsonb(value, dumps=lambda v: msgspec.json.encode(v).decode())


# Server states that pass: it is shutting down or starting (a restart, a failover), it ended the
# session (for one, because it sat idle in a transaction past query_timeout: the loop was stalled),
# it has no connection slot free right now, it cancelled the statement (a statement_timeout, a DBA's
# pg_cancel_backend), or it picked the statement as a deadlock's or a serialization conflict's victim.
_PASSING_STATES = frozenset({"57P01", "57P02", "57P03", "53300", "25P03", "57014", "40P01", "40001"})


def unreachable(exc: BaseException) -> bool:
    """True when the server could not be reached, went away or gave up on the statement for reasons
    of the moment, which trying again mends. Every other error (a value the server refuses, a
    statement over one of its limits) comes back the same however often the statement is tried."""
    if not isinstance(exc, psycopg.Error) or isinstance(exc, PoolClosed):
        return False  # (a closed pool stays closed: its runtime was closed, and waiting cannot help)
    state = exc.sqlstate
    if state is None:
        return isinstance(exc, psycopg.OperationalError)  # the link failed: no server answer at all
    return state.startswith("08") or state in _PASSING_STATES


async def retrying(operation: Callable[[], Awaitable[T]], what: str, patience: float = 10.0) -> T:
    """Run an idempotent database operation, trying again while the server cannot be reached (a
    restart, a failover) for up to ``patience`` seconds; then the last error propagates. Errors that
    trying again cannot mend propagate at once."""
    deadline = anyio.current_time() + patience
    delay = 0.05
    while True:
        try:
            return await operation()
        except psycopg.Error as exc:
            if not unreachable(exc) or anyio.current_time() + delay > deadline:
                raise
            log.warning("%s failed (%s); trying again in %.2fs", what, exc, delay)
            await anyio.sleep(delay)
            delay = min(delay * 2, 1.0)
