"""The SQL of claiming: taking due and orphaned workflows under a lease, within each queue's limits."""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg import AsyncConnection

from ..pool import Pool
from . import wire
from .statements import Statements

# Claiming: each queue read by its own scan of the queued index in priority and due order, the scans
# merged, so a worker serving many queues reads no more rows than one serving one; and, in the same
# round trip, when the next delayed workflow falls due. (tests/test_claims.py checks the plan.)
#
# A claim's scans start at the oldest entries of their indexes, and while a long transaction anywhere
# on the server holds vacuum back, those are entries of row versions that are dead but cannot be
# removed (nor marked so by the scans that pass them): every claim then visits the heap for each of
# the thousands its predecessors left (benchmarks/long_transaction.py: 0.1 ms became 31 ms at 40K).
# So most claims are bounded: a queue's scan skips entries older than the queue's floor, checked in
# the index itself, without a visit to the heap; and the scan for expired leases (whose dead entries,
# left by every claim and heartbeat, lie all in the range it reads) runs only on the full claims.
# A full claim, without bounds, runs at least every FULL_CLAIM_EVERY seconds per store, after the
# floors are computed again, so nothing a floor could leave out (see FLOORS) waits longer than that.
#
# The workflows a full claim takes over from workers whose lease ran out, and the fences of those
# workers, locked in one order (the trigger of migration 0026 moves them on in the order of the rows:
# two claims taking over the workflows of the same two workers could each wait for the other).
_TAKING_OVER = (
    " expired AS (SELECT id, priority, due_at, lease_expires_at AS ready_at, lease_owner FROM {s}.workflows"
    "   WHERE status = 'running' AND lease_expires_at < now() AND queue = ANY(%(queues)s)"
    "   AND name = ANY(%(names)s)"
    "   ORDER BY lease_expires_at LIMIT %(limit)s FOR UPDATE SKIP LOCKED),"
    " chosen AS (SELECT id, ready_at, owner FROM (SELECT * FROM queued UNION ALL SELECT * FROM expired) c"
    "   ORDER BY priority DESC, due_at LIMIT %(limit)s),"
    " fenced AS MATERIALIZED (SELECT worker FROM {s}.worker_fences"
    "   WHERE worker = ANY(ARRAY(SELECT owner FROM chosen WHERE owner IS NOT NULL))"
    "   ORDER BY worker FOR NO KEY UPDATE),"
)
# (Only a full claim, once a second, takes workflows over: the others carry none of its parts, which
# the executor would set up for every claim even where they ran no scan.)
_QUEUED_ONLY = " chosen AS (SELECT id, ready_at, owner FROM queued ORDER BY priority DESC, due_at LIMIT %(limit)s),"


def _claim(full: bool) -> str:
    """The claim statement: a full one also takes over workflows whose lease ran out."""
    return (
        "WITH queued AS (SELECT c.id, c.priority, c.due_at, c.due_at AS ready_at, NULL::text AS owner"
        "   FROM unnest(%(queues)s::text[], %(floors)s::timestamptz[]) AS q(queue, floor)"
        "   CROSS JOIN LATERAL (SELECT id, priority, due_at FROM {s}.workflows"
        "    WHERE status = 'queued' AND queue = q.queue AND due_at <= {s}.clock_now() AND name = ANY(%(names)s)"
        "    AND due_at >= coalesce(q.floor, '-infinity')"
        "    ORDER BY priority DESC, due_at LIMIT %(limit)s FOR UPDATE SKIP LOCKED) c),"
        + (_TAKING_OVER if full else _QUEUED_ONLY)
        # A plain claim does not wait for the disk: one lost in a crash leaves the row claimable again,
        # and the lost claim's execution, should it run on, is fenced out by its token (``lease_token``,
        # new with every claim; the attempt number is handed out again). A limited queue's claim does
        # wait, for its token bucket's sake.
        + " lazy AS (SELECT set_config('synchronous_commit', %(commit)s, true)),"
        " claimed AS (UPDATE {s}.workflows w SET status = 'running', attempt = w.attempt + 1,"
        "  lease_token = %(token)s,"
        "  lease_owner = %(owner)s, lease_expires_at = now() + make_interval(secs => %(lease)s),"
        "  started_at = coalesce(w.started_at, {s}.clock_now()),"
        "  deadline_at = coalesce(w.deadline_at, {s}.clock_now() + make_interval(secs => w.timeout))"
        # The rows are found by the primary key, one probe per chosen row, with its ready time carried
        # along. Matched against an array of the chosen ids instead, a generic plan made while the
        # table was small (a new schema, before its first ANALYZE) scanned the whole table on every
        # claim for as long as the connection kept the plan: a claim of one workflow read 5,000 rows
        # after 5,000 runs.
        "  FROM chosen ch WHERE w.id = ch.id AND EXISTS (SELECT FROM lazy)"
        + ("  AND (SELECT count(*) FROM fenced) >= 0" if full else "")
        + "  RETURNING w.id, w.name, w.inputs, w.attempt, w.max_attempts + w.attempt_base AS max_attempts,"
        "   extract(epoch FROM w.deadline_at - {s}.clock_now())::float8 AS seconds_left,"
        "   w.attempt - w.attempt_base AS run, w.queue, w.traceparent,"
        "   (extract(epoch FROM w.created_at) * 1000000)::int8 AS born,"
        # Past its expiry and never started before this claim (which set started_at to the clock's now).
        "   (w.expires_at <= {s}.clock_now() AND w.started_at = {s}.clock_now()) IS TRUE AS expired, w.retries,"
        # What this claim set rather than kept (for ``unclaim``).
        "   (w.started_at = {s}.clock_now()) IS TRUE AS set_start, ch.ready_at,"
        "   (w.deadline_at = {s}.clock_now() + make_interval(secs => w.timeout)) IS TRUE AS set_deadline)"
        # (with each claimed row, the claimer's fence epoch: see migration 0026)
        " SELECT c.id, name, inputs, attempt, max_attempts, seconds_left, run, queue, traceparent,"
        "  extract(epoch FROM {s}.clock_now() - c.ready_at)::float8 AS waited, born, expired, retries, set_start,"
        "  set_deadline, (SELECT epoch FROM {s}.worker_fences WHERE worker = %(owner)s), NULL::float8"
        "  FROM claimed c"
        " UNION ALL SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,"
        "  NULL, extract(epoch FROM min(d.due_at) - {s}.clock_now())::float8"
        "  FROM unnest(%(queues)s::text[]) AS q(queue)"
        "  CROSS JOIN LATERAL (SELECT due_at FROM {s}.workflows WHERE status = 'queued'"
        "   AND queue = q.queue AND due_at > {s}.clock_now() AND name = ANY(%(names)s) ORDER BY due_at LIMIT 1) d"
    )


CLAIM = _claim(full=False)
FULL_CLAIM = _claim(full=True)
_PARAMETERS = {"queues": wire.TEXTS, "floors": wire.TIMESTAMPTZS, "names": wire.TEXTS, "limit": wire.INT4,
               "owner": wire.TEXT, "lease": wire.FLOAT8, "token": wire.INT8, "commit": wire.TEXT}
CLAIMING = wire.Statement(CLAIM, **_PARAMETERS)
FULL_CLAIMING = wire.Statement(FULL_CLAIM, **_PARAMETERS)

FULL_CLAIM_EVERY = 1.0  # seconds between the claims that read whole queues and look for expired leases
FLOOR_MARGIN = 2.0  # seconds a floor stays below the oldest due time it saw: for the starts in flight

# Per queue, the lowest due time a workflow this worker can claim there may have from now on, less a
# margin: the oldest due time of those queued now, or now when none is (a start, a wake-up or a resume
# dues a workflow at its statement's clock_now() or later). What a floor can leave out (a workflow given
# back to the queue with its old due time, a start whose statement took longer than the margin) is
# left to the next full claim, at most FULL_CLAIM_EVERY later.
FLOORS = (
    "SELECT q.queue, least({s}.clock_now(), (SELECT min(due_at) FROM {s}.workflows"
    "   WHERE status = 'queued' AND queue = q.queue AND name = ANY(%(names)s)))"
    "  - make_interval(secs => %(margin)s)"
    " FROM unnest(%(queues)s::text[]) AS q(queue)"
)


@dataclass(slots=True, eq=False)
class Claimed:
    """A workflow this worker now holds a lease on, as its claim read it (nothing assigns to one: not
    frozen only because a frozen one's ``__init__`` sets each field through ``object.__setattr__``,
    1.6 µs more per claimed workflow)."""

    id: str
    name: str
    inputs: bytes
    attempt: int
    max_attempts: int | None
    seconds_left: float | None  # until the workflow's timeout; None without one
    queue: str
    traceparent: str | None  # the caller's trace, when it had one
    waited: float  # seconds from being due (or its lease running out) to this claim
    claim_token: int  # never handed out twice: it fences every write of the execution
    born: int  # the row's created_at in microseconds (what binds news of its end to this workflow)
    # The attempt counted against the workflow's budget (``pgflow.attempt()``): 1 on its first run,
    # one more per run a crash or a stop interrupted; resuming after a sleep or a resume() costs none.
    run: int = 1
    expired: bool = False  # claimed past its ``expires=`` without having started: ends cancelled, unrun
    retries: int = 0  # runs of the body that failed and were retried under its workflow's retry policy
    set_start: bool = False  # this claim set the row's started_at (its first start), and
    set_deadline: bool = False  # its deadline_at (the first start's, or a rerun's): ``unclaim`` clears them
    # The claimer's fence (worker id, epoch) when it had one: chunk batches are fenced by it, not by the row.
    fence: tuple[str, int] | None = None


class ClaimStatements(Statements):
    """The claim statements of ``Store`` (which provides the pool and the schema)."""

    def __init__(self, pool: Pool, schema: str) -> None:
        super().__init__(pool, schema)
        # By the names claimed (two workers of one loop may serve a queue's different workflows):
        # FLOORS as the last full claim found them, per queue; the time.monotonic() of the last full
        # claim, per set of queues.
        self._floors: dict[tuple[str, frozenset[str]], datetime] = {}
        self._full_claim_at: dict[tuple[frozenset[str], frozenset[str]], float] = {}


    async def claim(self, owner: str, queues: Sequence[str], names: Sequence[str], limit: int,
                    lease_seconds: float) -> tuple[list[Claimed], float | None]:
        """Take up to ``limit`` due workflows, queued or with an expired lease, best priority first.

        Only workflows named in ``names`` are taken: a worker never claims one it cannot run. Also
        returns in how many seconds the next delayed one falls due (None when none waits).
        """
        async with self.pool.connection() as conn:
            return await self._claim(conn, owner, queues, names, limit, lease_seconds)

    async def claim_limited(self, owner: str, queue: str, names: Sequence[str], limit: int,
                            lease_seconds: float) -> tuple[list[Claimed], float | None, float | None]:
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
                return (*await self._claim(conn, owner, [queue], names, limit, lease_seconds, durable=True), None)
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
            claimed, due = (await self._claim(conn, owner, [queue], names, limit, lease_seconds, durable=True)
                            if limit > 0 else ([], None))
            if rate_limit is None:
                return claimed, due, None
            left = float(tokens) - len(claimed)
            await conn.execute(self._sql(
                "UPDATE {s}.queues SET tokens = %s, refilled_at = now() WHERE name = %s"
            ), (left, queue))
            return claimed, due, (1 - left) * float(period) / rate_limit if left < 1 else None

    async def _claim(self, conn: AsyncConnection[Any], owner: str, queues: Sequence[str],
                     names: Sequence[str], limit: int, lease_seconds: float,
                     durable: bool = False) -> tuple[list[Claimed], float | None]:
        """Claim up to ``limit`` (see ``claim``); also say in how many seconds the next delayed
        workflow of these queues falls due (None when none waits), in the same round trip.

        Each queue is read by its own scan of the queued index, in priority and due order, and the
        scans are merged: a worker serving many queues reads no more rows than one serving one.
        ``queues`` are distinct (the worker's are): a queue's second scan would find the rows its
        first just locked (a transaction's own locks do not make it skip them) and hand them out twice."""
        served, floors = frozenset(names), self._floors
        full = time.monotonic() - self._full_claim_at.get((frozenset(queues), served), -math.inf) >= FULL_CLAIM_EVERY \
            or any((queue, served) not in floors for queue in queues)
        if full:
            self._full_claim_at[frozenset(queues), served] = time.monotonic()
            cur = await conn.execute(self._sql(FLOORS), {"queues": list(queues), "names": list(names),
                                                         "margin": FLOOR_MARGIN})
            floors.update({(str(queue), served): floor for queue, floor in await cur.fetchall()})
        rows = await wire.fetch(conn, FULL_CLAIMING if full else CLAIMING, self._s, {
            "queues": queues, "floors": [None if full else floors[queue, served] for queue in queues],
            "names": names, "limit": limit, "owner": owner, "lease": lease_seconds,
            "token": (token := secrets.randbits(63)), "commit": "on" if durable else "off"}, prepare=self.pool.prepares)
        due = rows[-1][-1]
        claimed = [Claimed(id=id, name=name, inputs=inputs, attempt=attempt, max_attempts=max_attempts,
                           seconds_left=None if left is None else float(left), queue=queue, traceparent=traceparent,
                           waited=float(waited), claim_token=token, born=born, run=run, expired=bool(expired),
                           retries=retries, set_start=set_start, set_deadline=set_deadline,
                           fence=None if epoch is None else (owner, epoch))
                   for id, name, inputs, attempt, max_attempts, left, run, queue, traceparent, waited, born, expired,
                   retries, set_start, set_deadline, epoch, _ in rows[:-1]]
        return claimed, None if due is None else max(0.0, float(due))

    async def unclaim(self, claimed: Sequence[Claimed]) -> list[str]:
        """Undo claims whose workflows were not run (their worker began to stop while the claim ran):
        queued again as they were before it, the attempt not counted, so giving them back costs them
        nothing. (A limited queue's token spent on the claim is not refunded.) Returns the ids given back."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(self._sql(
                "UPDATE {s}.workflows w SET status = 'queued', attempt = w.attempt - 1, lease_owner = NULL,"
                "  lease_expires_at = NULL, started_at = CASE WHEN u.set_start THEN NULL ELSE w.started_at END,"
                "  deadline_at = CASE WHEN u.set_deadline THEN NULL ELSE w.deadline_at END"
                " FROM unnest(%s::text[], %s::int8[], %s::bool[], %s::bool[]) AS u(id, lease, set_start, set_deadline)"
                " WHERE w.id = u.id AND w.lease_token = u.lease AND w.status = 'running' RETURNING w.id"
            ), ([c.id for c in claimed], [c.claim_token for c in claimed], [c.set_start for c in claimed],
                [c.set_deadline for c in claimed]))
            return [str(row[0]) for row in await cur.fetchall()]

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
