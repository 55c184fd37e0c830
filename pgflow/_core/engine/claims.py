"""The SQL of claiming: taking due and orphaned workflows under a lease, within each queue's limits."""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Sequence
from datetime import datetime
from typing import NamedTuple, TypedDict, cast

from . import wire
from .claim_sql import CLAIM, CRASHES_ALONE, FULL_CLAIM, FULL_KEYED_CLAIM, KEYED_CLAIM, SUSPECT_CLAIM
from .claimed import Claimed, ClaimRow, Round, claimed_of
from .database import Database, Port, Session, Sql
from .fencing import HOLDS_LOCKED, Holding
from .key_limits import NEXT_TOKEN

__all__ = ["CLAIM", "CRASHES_ALONE", "FULL_CLAIM", "Claims"]


class Claiming(TypedDict):
    """What every claim is run with (``claim_sql._claim``)."""

    queues: wire.Texts
    names: wire.Texts
    owner: wire.Text
    lease: wire.Float8
    token: wire.Int8
    commit: wire.Text  # synchronous_commit: "off" but for a rate-limited queue's


class Bounded(Claiming):
    floors: wire.Timestamptzs  # per queue, the floor of its scan (None: a full claim's, with none)
    limit: wire.Int4


class Keyed(Claiming):
    queue: wire.Text
    limit: wire.Int4


# Each claimed workflow's row, then one row of NULLs but for when the next delayed one falls due and
# whether suspects wait (``claimed.ClaimRow``): plain tuples, as psycopg reads them, which ``claimed_of``
# makes Claimed (no NamedTuple in between: +170 ns a row, benchmarks/row_types.py).
_ROW = cast("type[ClaimRow]", ClaimRow)
CLAIMING = wire.Statement(CLAIM, row=_ROW, params=Bounded)
FULL_CLAIMING = wire.Statement(FULL_CLAIM, row=_ROW, params=Bounded)
SUSPECT_CLAIMING = wire.Statement(SUSPECT_CLAIM, row=_ROW, params=Claiming)
KEYED_CLAIMING = wire.Statement(KEYED_CLAIM, row=_ROW, params=Keyed)
FULL_KEYED_CLAIMING = wire.Statement(FULL_KEYED_CLAIM, row=_ROW, params=Keyed)

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


class Flooring(TypedDict):
    queues: list[str]
    names: list[str]
    margin: float


FLOORING = Sql(FLOORS, row=tuple[str, datetime], params=Flooring)  # (as the executor runs it: (queue, floor))


class Limits(NamedTuple):
    """A limited queue's limits (``LIMITS``), and its bucket's ``tokens`` now."""

    concurrency: int | None
    rate_limit: int | None
    rate_period: float | None
    tokens: float | None
    keyed: bool  # it has per-key limits
    key_rated: bool  # per-key rates among them


class OfQueue(TypedDict):
    queue: str


class OfName(TypedDict):
    name: str


# A limited queue's limits and its bucket's tokens now, its row locked for the claim that follows.
# Whether it has per-key limits, and per-key rates (``key_limits.py``).
LIMITS = Sql(
    "SELECT concurrency, rate_limit, rate_period,"
    "  least(rate_limit, tokens + rate_limit * extract(epoch FROM now() - refilled_at) / rate_period),"
    "  key_concurrency IS NOT NULL OR key_rate_limit IS NOT NULL, key_rate_limit IS NOT NULL"
    " FROM {s}.queues WHERE name = %(queue)s FOR UPDATE", row=Limits, params=OfQueue)
# The places of a queue's concurrency taken: its running rows whatever their lease, and its queued
# suspects (a dead worker's runs keep their places until they ran again: see ``claim_limited``).
HELD = Sql(
    "SELECT (SELECT count(*) FROM {s}.workflows WHERE queue = %(queue)s AND status = 'running')"
    " + (SELECT count(*) FROM {s}.workflows WHERE queue = %(queue)s AND status = 'queued'"
    "  AND crashes IS NOT NULL)", row=tuple[int], params=OfQueue)


class Spent(OfQueue):
    tokens: float


class Unclaiming(NamedTuple):
    """Per claim undone: the workflow's id, the claim's token, and what the claim did (see ``Claimed``)."""

    ids: list[str]
    leases: list[int]
    set_start: list[bool]
    set_deadline: list[bool]
    free: list[bool]
    give_up: list[bool]


# A limited queue's bucket after a claim took its tokens.
SPENT = Sql("UPDATE {s}.queues SET tokens = %(tokens)s, refilled_at = now() WHERE name = %(queue)s",
            row=None, params=Spent)
# Claims undone (``Claims.unclaim``): each workflow queued again as it was before its claim.
UNCLAIM = Sql(
    "UPDATE {s}.workflows w SET status = 'queued', attempt = w.attempt - 1, lease_owner = NULL,"
    "  lease_expires_at = NULL, started_at = CASE WHEN u.set_start THEN NULL ELSE w.started_at END,"
    "  deadline_at = CASE WHEN u.set_deadline THEN NULL ELSE w.deadline_at END,"
    # (a claim that began no attempt moved the base with the attempt: both go back)
    "  attempt_base = w.attempt_base - (u.free OR u.give_up)::int, uncounted = u.free"
    " FROM unnest(%s::text[], %s::int8[], %s::bool[], %s::bool[], %s::bool[], %s::bool[])"
    "  AS u(id, lease, set_start, set_deadline, free, give_up)"
    " WHERE w.id = u.id AND w.lease_token = u.lease AND w.status = 'running' RETURNING w.id",
    row=tuple[str], params=Unclaiming)


class DeclareQueue(TypedDict):
    name: str
    concurrency: int | None
    rate: int | None
    period: float
    key_concurrency: int | None
    key_rate: int | None


# A queue without limits forgets them; one with limits records them (the bucket starts full).
FORGET_QUEUE = Sql("DELETE FROM {s}.queues WHERE name = %(name)s", row=None, params=OfName)
DECLARE_QUEUE = Sql(
    "INSERT INTO {s}.queues AS q (name, concurrency, rate_limit, rate_period, tokens, key_concurrency,"
    "  key_rate_limit)"
    " VALUES (%(name)s, %(concurrency)s, %(rate)s, %(period)s, coalesce(%(rate)s, 0), %(key_concurrency)s,"
    "  %(key_rate)s)"
    " ON CONFLICT (name) DO UPDATE SET concurrency = excluded.concurrency,"
    "  rate_limit = excluded.rate_limit, rate_period = excluded.rate_period,"
    "  tokens = least(q.tokens, coalesce(excluded.rate_limit, 0)),"
    "  key_concurrency = excluded.key_concurrency, key_rate_limit = excluded.key_rate_limit",
    row=None, params=DeclareQueue)
# A workflow given back to the queue by the claim that holds it (``Claims.release``); with ``fence_cut``,
# the fence of the worker whose batch was cut off moved on in the same statement.
_RELEASE = (" held AS (" + HOLDS_LOCKED + ")"
            " UPDATE {s}.workflows SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL"
            " WHERE id = (SELECT id FROM held) RETURNING 1")
RELEASE = Sql("WITH" + _RELEASE, row=tuple[int], params=Holding)


class CutHolding(NamedTuple):
    worker: str  # the fence moved on
    id: str
    lease: int


RELEASE_FENCE_CUT = Sql("WITH moved AS (UPDATE {s}.worker_fences SET epoch = epoch + 1 WHERE worker = %s RETURNING 1),"
                        + _RELEASE, row=tuple[int], params=CutHolding)


class Claims(Port):
    """The port that claims due workflows for a worker and gives them back."""

    def __init__(self, db: Database) -> None:
        super().__init__(db)
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
        found = await self.claim_round(owner, queues, names, limit, lease_seconds)
        return found.claimed, found.due

    async def claim_round(self, owner: str, queues: Sequence[str], names: Sequence[str], limit: int,
                          lease_seconds: float) -> Round:
        """``claim``, also telling whether suspects wait to be run alone (see ``claim_suspect``)."""
        async with self.db.session() as s:
            return await self._claim(s, owner, queues, names, limit, lease_seconds)

    async def claim_suspect(self, owner: str, queues: Sequence[str], names: Sequence[str],
                            lease_seconds: float) -> Claimed | None:
        """Claim one suspect of a crash (migration 0028), for a worker that runs nothing else and will
        claim nothing beside it until its run ends; None when no suspect is due. A queue's limits are
        not consulted: the suspect held its place in them when its worker died."""
        rows = await self.db.rows(SUSPECT_CLAIMING, queues=queues, names=names, owner=owner, lease=lease_seconds,
                                  token=(token := secrets.randbits(63)), commit="off")
        claimed = claimed_of(rows[:-1], owner, token)
        return claimed[0] if claimed else None

    async def claim_limited(self, owner: str, queue: str, names: Sequence[str], limit: int,
                            lease_seconds: float) -> Round:
        """Claim from a queue with limits, holding its row lock so the limits hold across workers:
        at most ``concurrency`` running at once, and starts paced by a token bucket; per key too, when
        the queue has per-key limits (``key_limits.py``).

        A dead worker's runs keep their places, until a full claim rescues them and then, as suspects,
        until they run again (alone, and without a look at the limits, in the place they held):
        counting live leases alone, new runs took those places once the leases ran out, and the
        suspects ran beside them (tests/test_key_limits.py saw 3 at once at a limit of 2). So the
        claim runs with no slot free too: its full claims rescue what holds the places.

        Returns what ``claim_round`` does, and, when the bucket ran dry, the seconds until its next token.
        """
        async with self.db.session() as s, s.transaction():
            # Lock first, count after: the count's snapshot must include the claims of whoever held
            # the lock before us (a count taken in the locking statement would predate them).
            limits = await s.row(LIMITS, queue=queue)
            if limits is None:
                return await self._claim(s, owner, [queue], names, limit, lease_seconds, durable=True)
            if limits.concurrency is not None:
                held = await s.row(HELD, queue=queue)
                limit = min(limit, limits.concurrency - (held[0] if held else 0))
            rate_limit, period, tokens = limits.rate_limit, limits.rate_period, limits.tokens
            if rate_limit is not None:
                assert period is not None and tokens is not None  # (a rate comes with its period and bucket)
                limit = min(limit, int(tokens))
            limit = max(0, limit)
            # (its commit waits for the disk only for a bucket's sake, as a plain claim's does not: a
            # claim lost in a crash of the server gives the row back, and fences its execution out)
            found = await self._claim(s, owner, [queue], names, limit, lease_seconds,
                                      durable=rate_limit is not None or limits.key_rated, keyed=limits.keyed)
            if limits.key_rated and 0 < limit and len(found.claimed) < limit:  # short: perhaps for a key's tokens
                next_token = await s.row(NEXT_TOKEN, queue=queue, names=list(names))
                if next_token is not None and next_token[0] is not None:
                    found = found._replace(refill=max(0.0, next_token[0]))
            if rate_limit is None:
                return found
            assert period is not None and tokens is not None
            left = tokens - len(found.claimed)
            await s.run(SPENT, tokens=left, queue=queue)
            refill = (1 - left) * period / rate_limit if left < 1 else None
            return found._replace(refill=refill if found.refill is None or refill is None
                                  else min(refill, found.refill))

    async def _claim(self, s: Session, owner: str, queues: Sequence[str],
                     names: Sequence[str], limit: int, lease_seconds: float,
                     durable: bool = False, keyed: bool = False) -> Round:
        """Claim up to ``limit`` (see ``claim``); also say in how many seconds the next delayed
        workflow of these queues falls due (None when none waits), in the same round trip.

        Each queue is read by its own scan of the queued index, in priority and due order, and the
        scans are merged: a worker serving many queues reads no more rows than one serving one.
        ``queues`` are distinct (the worker's are): a queue's second scan would find the rows its
        first just locked (a transaction's own locks do not make it skip them) and hand them out twice."""
        served, floors = frozenset(names), self._floors
        if keyed:  # (one queue, read by the walk over its keys: no floors)
            return await self._claim_keyed(s, owner, queues[0], names, limit, lease_seconds, durable)
        full = time.monotonic() - self._full_claim_at.get((frozenset(queues), served), -math.inf) >= FULL_CLAIM_EVERY \
            or any((queue, served) not in floors for queue in queues)
        if full:
            self._full_claim_at[frozenset(queues), served] = time.monotonic()
            floors.update({(queue, served): floor for queue, floor in await s.rows(
                FLOORING, queues=list(queues), names=list(names), margin=FLOOR_MARGIN)})
        rows = await s.rows(
            FULL_CLAIMING if full else CLAIMING, queues=queues,
            floors=[None if full else floors[queue, served] for queue in queues], names=names, limit=limit,
            owner=owner, lease=lease_seconds, token=(token := secrets.randbits(63)), commit="on" if durable else "off")
        due, suspects = rows[-1][-2:]
        return Round(claimed_of(rows[:-1], owner, token), None if due is None else max(0.0, due), suspects)

    async def _claim_keyed(self, s: Session, owner: str, queue: str, names: Sequence[str],
                           limit: int, lease_seconds: float, durable: bool) -> Round:
        """``_claim`` from a queue with per-key limits, under its lock (``key_limits.py``)."""
        at, claims = time.monotonic(), (frozenset([queue]), frozenset(names))
        full = at - self._full_claim_at.get(claims, -math.inf) >= FULL_CLAIM_EVERY
        if full:
            self._full_claim_at[claims] = at
        rows = await s.rows(
            FULL_KEYED_CLAIMING if full else KEYED_CLAIMING, queue=queue, queues=[queue], names=names, limit=limit,
            owner=owner, lease=lease_seconds, token=(token := secrets.randbits(63)), commit="on" if durable else "off")
        due, suspects = rows[-1][-2:]
        return Round(claimed_of(rows[:-1], owner, token), None if due is None else max(0.0, due), suspects)

    async def unclaim(self, claimed: Sequence[Claimed]) -> list[str]:
        """Undo claims whose workflows were not run (their worker began to stop while the claim ran):
        queued again as they were before it, the attempt not counted, so giving them back costs them
        nothing. (A limited queue's token spent on the claim is not refunded.) Returns the ids given back."""
        rows = await self.db.rows(
            UNCLAIM, [c.id for c in claimed], [c.lease_token for c in claimed], [c.set_start for c in claimed],
            [c.set_deadline for c in claimed], [c.uncounted for c in claimed], [c.give_up for c in claimed])
        return [id for id, in rows]

    async def declare_queue(self, name: str, concurrency: int | None, rate_limit: int | None,
                            rate_period: float, key_concurrency: int | None = None,
                            key_rate_limit: int | None = None) -> None:
        """Record a queue's limits (the bucket starts full), or forget them when there are none."""
        if concurrency is None and rate_limit is None and key_concurrency is None and key_rate_limit is None:
            await self.db.run(FORGET_QUEUE, name=name)
            return
        await self.db.run(DECLARE_QUEUE, name=name, concurrency=concurrency, rate=rate_limit, period=rate_period,
                          key_concurrency=key_concurrency, key_rate=key_rate_limit)

    async def release(self, id: str, lease_token: int, fence_cut: str | None = None) -> bool:
        """Give a workflow back to the queue now, so another worker resumes it without waiting.
        ``fence_cut``: a batch of the run's chunks under that worker's fence was cut off and may still
        run; the release moves the fence on in its own statement, so it commits only after that batch
        (which does not lock this row) has ended, and one not yet past the fence is refused."""
        if fence_cut is None:
            row = await self.db.row(RELEASE, id, lease_token)
        else:
            row = await self.db.row(RELEASE_FENCE_CUT, fence_cut, id, lease_token)
        return row is not None
