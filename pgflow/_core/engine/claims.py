"""The SQL of claiming: taking due and orphaned workflows under a lease, within each queue's limits."""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Sequence
from datetime import datetime

from . import wire
from .claimed import Claimed, Round, claimed_of
from .database import Database, Port, Session, Sql
from .fencing import HOLDS_LOCKED
from .key_limits import NEXT_TOKEN, keyed_queued

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
# A full claim also rescues the workflows whose lease ran out: they are not run by the claim but
# queued again. Those whose worker died under them (no heartbeat of it for a whole lease: judged by
# the heartbeat's age, not by whether it came after the run's lease was set, since a heartbeat sent
# between a claim and the worker's taking the run on renews nothing, and a worker killed then was
# taken for alive) become suspects (migration 0028), to be run alone. A run that was alone when its worker died
# (a suspect, which only runs alone; or the one workflow its worker held) is charged: its crashes
# count up, and its next claim is a new attempt. One that died beside others is charged nothing. A
# workflow whose worker lives on (it let the lease go: a release that failed, a loop stalled past its
# lease) is no suspect, and its next claim is a new attempt, as any run cut short by a lost lease.
# The rows, and the fences of their workers, are locked in one order (the trigger of migration 0026
# moves the fences on in the order of the rows: two claims rescuing the workflows of the same two
# workers could each wait for the other).
RESCUE_AT_MOST = 256  # expired leases a full claim rescues (a dead worker's all, in one pass)
CRASHES_ALONE = 3  # deaths of its worker while running it alone that give a workflow up (at most max_attempts)
_ALONE = "(e.crashes IS NOT NULL OR c.held = 1) IS TRUE"
_RESCUING = (
    " expired AS (SELECT id, lease_owner AS owner, crashes, live.heartbeat_at IS NULL AS died"
    "   FROM {s}.workflows w LEFT JOIN LATERAL (SELECT k.heartbeat_at FROM {s}.workers k WHERE k.id = w.lease_owner"
    "    AND k.heartbeat_at > now() - make_interval(secs => k.lease)) live ON true"
    "   WHERE status = 'running' AND lease_expires_at < now() AND queue = ANY(%(queues)s) AND name = ANY(%(names)s)"
    # (a worker heard from within its lease may be alive: its run is left until it has been silent a
    # lease, or, alive and silent about this run, until the lease ran out a lease ago)
    "   AND (live.heartbeat_at IS NULL OR lease_expires_at < now() - make_interval(secs => coalesce("
    "    (SELECT k.lease FROM {s}.workers k WHERE k.id = w.lease_owner), 0)))"
    f"   ORDER BY lease_expires_at LIMIT {RESCUE_AT_MOST} FOR UPDATE OF w SKIP LOCKED),"
    " fenced AS MATERIALIZED (SELECT worker FROM {s}.worker_fences"
    "   WHERE worker = ANY(ARRAY(SELECT owner FROM expired WHERE owner IS NOT NULL))"
    "   ORDER BY worker FOR NO KEY UPDATE),"
    # How many workflows each dead worker still held: one alone was the only one it ran.
    " crews AS (SELECT lease_owner AS owner, count(*) AS held FROM {s}.workflows"
    "   WHERE status = 'running' AND lease_owner = ANY(ARRAY(SELECT owner FROM expired)) GROUP BY lease_owner),"
    " rescued AS (UPDATE {s}.workflows w SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL,"
    # (a new token: the trigger of migration 0026 fences the old owner off, and its writes are refused)
    "   lease_token = NULL, due_at = {s}.clock_now(),"
    f"   crashes = CASE WHEN e.died THEN coalesce(w.crashes, 0) + ({_ALONE})::int ELSE w.crashes END,"
    f"   uncounted = e.died AND NOT {_ALONE}"
    "   FROM expired e LEFT JOIN crews c ON c.owner = e.owner"
    # (a rescued row with crashes is a suspect: its worker died under it)
    "   WHERE w.id = e.id AND (SELECT count(*) FROM fenced) >= 0 RETURNING w.id, w.crashes IS NOT NULL AS suspect,"
    "   w.queue),"
)
# Whether the claim begins a new attempt (``uncounted`` since a run began: no; a resume() moves the
# base to the attempt, and its next claim begins attempt 1), and whether the workflow is given up
# instead of run: its worker died under it alone CRASHES_ALONE times (at most max_attempts), or its
# attempts are spent (runs cut short by stops count too). A claim that gives up begins no attempt: the
# attempt shown stays the last one run, never above max_attempts. (Read from the row the scan locked.)
_FREE = "(uncounted AND attempt > attempt_base)"
_VERDICT = (
    f"{_FREE} AS free, (max_attempts IS NOT NULL AND (crashes >= least(max_attempts, {CRASHES_ALONE})"
    f" OR (NOT {_FREE} AND attempt - attempt_base >= max_attempts))) IS TRUE AS give_up"
)


# A paused queue (``pausing.py``) is claimed from by no claim, and its next due time wakes nobody: a
# probe per queue of a table that is almost always empty. (Its expired leases are still rescued: that
# queues them again, which is all a pause asks.)
_NOT_PAUSED = "NOT EXISTS (SELECT FROM {{s}}.paused_queues p WHERE p.name = {queue})"


def _queued(suspect: bool) -> str:
    """The claim's first part: the due rows it may take, locked (a suspect's: one, run alone)."""
    if suspect:
        return (
            "WITH queued AS (SELECT id, priority, due_at, due_at AS ready_at, " + _VERDICT + " FROM {s}.workflows"
            "   WHERE status = 'queued' AND crashes IS NOT NULL AND queue = ANY(%(queues)s)"
            "   AND due_at <= {s}.clock_now() AND name = ANY(%(names)s) AND " + _NOT_PAUSED.format(queue="queue") +
            "   ORDER BY priority DESC, due_at LIMIT 1 FOR UPDATE SKIP LOCKED),"
        )
    return (
        "WITH queued AS (SELECT c.id, c.priority, c.due_at, c.due_at AS ready_at, c.free, c.give_up"
        "   FROM unnest(%(queues)s::text[], %(floors)s::timestamptz[]) AS q(queue, floor)"
        "   CROSS JOIN LATERAL (SELECT id, priority, due_at, " + _VERDICT + " FROM {s}.workflows"
        "    WHERE status = 'queued' AND queue = q.queue AND due_at <= {s}.clock_now() AND name = ANY(%(names)s)"
        # (suspects are skipped with a look at the row the scan fetches anyway, to lock it)
        "    AND due_at >= coalesce(q.floor, '-infinity') AND crashes IS NULL"
        "    ORDER BY priority DESC, due_at LIMIT %(limit)s FOR UPDATE SKIP LOCKED) c"
        "   WHERE " + _NOT_PAUSED.format(queue="q.queue") + "),"
    )


def _claim(full: bool, suspect: bool = False, keyed: bool = False) -> str:
    """The claim statement: a full one also rescues workflows whose lease ran out, and says whether
    suspects wait; a ``suspect`` one claims one suspect, for a worker that runs nothing else; a
    ``keyed`` one claims from one queue with per-key limits (``key_limits.py``)."""
    queued = keyed_queued(_VERDICT, _NOT_PAUSED.format(queue="%(queue)s")) if keyed else _queued(suspect)
    # Suspects wait (due, in these queues, for these names): the full claim's answer, beside the due time.
    waiting = ("EXISTS (SELECT FROM rescued r WHERE r.suspect AND " + _NOT_PAUSED.format(queue="r.queue") + ")"
               " OR EXISTS (SELECT FROM {s}.workflows WHERE status = 'queued'"
               "  AND crashes IS NOT NULL AND queue = ANY(%(queues)s) AND name = ANY(%(names)s)"
               "  AND due_at <= {s}.clock_now() AND " + _NOT_PAUSED.format(queue="queue") + ")"
               ) if full else "NULL::bool"
    return (
        queued
        + (_RESCUING if full else "")
        + " chosen AS (SELECT id, ready_at, free, give_up FROM queued ORDER BY priority DESC, due_at LIMIT "
        + ("1" if suspect else "%(limit)s") + "),"
        # A plain claim does not wait for the disk: one lost in a crash leaves the row claimable again,
        # and the lost claim's execution, should it run on, is fenced out by its token (``lease_token``,
        # new with every claim; the attempt number is handed out again). A rate-limited queue's claim
        # does wait, for its token bucket's sake (a queue's or its keys').
        " lazy AS (SELECT set_config('synchronous_commit', %(commit)s, true)),"
        " claimed AS (UPDATE {s}.workflows w SET status = 'running', attempt = w.attempt + 1,"
        "  attempt_base = w.attempt_base + (ch.free OR ch.give_up)::int, uncounted = false,"
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
        "  RETURNING w.id, w.name, w.inputs, w.attempt, w.max_attempts,"
        "   extract(epoch FROM w.deadline_at - {s}.clock_now())::float8 AS seconds_left,"
        "   w.attempt - w.attempt_base AS run, w.queue, w.traceparent,"
        "   (extract(epoch FROM w.created_at) * 1000000)::int8 AS born,"
        # Past its expiry and never started before this claim (which set started_at to the clock's now).
        "   (w.expires_at <= {s}.clock_now() AND w.started_at = {s}.clock_now()) IS TRUE AS expired, w.retries,"
        # What this claim set rather than kept (for ``unclaim``).
        "   (w.started_at = {s}.clock_now()) IS TRUE AS set_start, ch.ready_at,"
        "   (w.deadline_at = {s}.clock_now() + make_interval(secs => w.timeout)) IS TRUE AS set_deadline,"
        "   ch.give_up, w.crashes, ch.free)"
        # (with each claimed row, the claimer's fence epoch: see migration 0026)
        " SELECT c.id, name, inputs, attempt, max_attempts, seconds_left, run, queue, traceparent,"
        "  extract(epoch FROM {s}.clock_now() - c.ready_at)::float8 AS waited, born, expired, retries, set_start,"
        "  set_deadline, give_up, crashes, free, (SELECT epoch FROM {s}.worker_fences WHERE worker = %(owner)s),"
        "  NULL::float8, NULL::bool"
        "  FROM claimed c"
        " UNION ALL SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,"
        "  NULL, NULL, NULL, NULL, extract(epoch FROM min(d.due_at) - {s}.clock_now())::float8, " + waiting
        + "  FROM unnest(%(queues)s::text[]) AS q(queue)"
        "  CROSS JOIN LATERAL (SELECT due_at FROM {s}.workflows WHERE status = 'queued'"
        "   AND queue = q.queue AND due_at > {s}.clock_now() AND name = ANY(%(names)s) ORDER BY due_at LIMIT 1) d"
        "  WHERE " + _NOT_PAUSED.format(queue="q.queue")
    )


CLAIM = _claim(full=False)
FULL_CLAIM = _claim(full=True)
SUSPECT_CLAIM = _claim(full=False, suspect=True)
_PARAMETERS = {"queues": wire.TEXTS, "floors": wire.TIMESTAMPTZS, "names": wire.TEXTS, "limit": wire.INT4,
               "owner": wire.TEXT, "lease": wire.FLOAT8, "token": wire.INT8, "commit": wire.TEXT}
CLAIMING = wire.Statement(CLAIM, **_PARAMETERS)
FULL_CLAIMING = wire.Statement(FULL_CLAIM, **_PARAMETERS)
SUSPECT_CLAIMING = wire.Statement(SUSPECT_CLAIM, **{name: kind for name, kind in _PARAMETERS.items()
                                                   if name not in ("floors", "limit")})
_KEYED_PARAMETERS = {**{name: kind for name, kind in _PARAMETERS.items() if name != "floors"}, "queue": wire.TEXT}
KEYED_CLAIMING = wire.Statement(_claim(full=False, keyed=True), **_KEYED_PARAMETERS)
FULL_KEYED_CLAIMING = wire.Statement(_claim(full=True, keyed=True), **_KEYED_PARAMETERS)

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
FLOORING = Sql(FLOORS)  # (as the executor runs it)

# A limited queue's limits and its bucket's tokens now, its row locked for the claim that follows.
# Whether it has per-key limits, and per-key rates (``key_limits.py``).
LIMITS = Sql(
    "SELECT concurrency, rate_limit, rate_period,"
    "  least(rate_limit, tokens + rate_limit * extract(epoch FROM now() - refilled_at) / rate_period),"
    "  key_concurrency IS NOT NULL OR key_rate_limit IS NOT NULL, key_rate_limit IS NOT NULL"
    " FROM {s}.queues WHERE name = %s FOR UPDATE"
)
# The places of a queue's concurrency taken: its running rows whatever their lease, and its queued
# suspects (a dead worker's runs keep their places until they ran again: see ``claim_limited``).
HELD = Sql(
    "SELECT (SELECT count(*) FROM {s}.workflows WHERE queue = %(queue)s AND status = 'running')"
    " + (SELECT count(*) FROM {s}.workflows WHERE queue = %(queue)s AND status = 'queued'"
    "  AND crashes IS NOT NULL)"
)
# A limited queue's bucket after a claim took its tokens.
SPENT = Sql("UPDATE {s}.queues SET tokens = %s, refilled_at = now() WHERE name = %s")
# Claims undone (``Claims.unclaim``): each workflow queued again as it was before its claim.
UNCLAIM = Sql(
    "UPDATE {s}.workflows w SET status = 'queued', attempt = w.attempt - 1, lease_owner = NULL,"
    "  lease_expires_at = NULL, started_at = CASE WHEN u.set_start THEN NULL ELSE w.started_at END,"
    "  deadline_at = CASE WHEN u.set_deadline THEN NULL ELSE w.deadline_at END,"
    # (a claim that began no attempt moved the base with the attempt: both go back)
    "  attempt_base = w.attempt_base - (u.free OR u.give_up)::int, uncounted = u.free"
    " FROM unnest(%s::text[], %s::int8[], %s::bool[], %s::bool[], %s::bool[], %s::bool[])"
    "  AS u(id, lease, set_start, set_deadline, free, give_up)"
    " WHERE w.id = u.id AND w.lease_token = u.lease AND w.status = 'running' RETURNING w.id"
)
# A queue without limits forgets them; one with limits records them (the bucket starts full).
FORGET_QUEUE = Sql("DELETE FROM {s}.queues WHERE name = %s")
DECLARE_QUEUE = Sql(
    "INSERT INTO {s}.queues AS q (name, concurrency, rate_limit, rate_period, tokens, key_concurrency,"
    "  key_rate_limit)"
    " VALUES (%(name)s, %(concurrency)s, %(rate)s, %(period)s, coalesce(%(rate)s, 0), %(key_concurrency)s,"
    "  %(key_rate)s)"
    " ON CONFLICT (name) DO UPDATE SET concurrency = excluded.concurrency,"
    "  rate_limit = excluded.rate_limit, rate_period = excluded.rate_period,"
    "  tokens = least(q.tokens, coalesce(excluded.rate_limit, 0)),"
    "  key_concurrency = excluded.key_concurrency, key_rate_limit = excluded.key_rate_limit"
)
# A workflow given back to the queue by the claim that holds it (``Claims.release``); with ``fence_cut``,
# the fence of the worker whose batch was cut off moved on in the same statement.
_RELEASE = (" held AS (" + HOLDS_LOCKED + ")"
            " UPDATE {s}.workflows SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL"
            " WHERE id = (SELECT id FROM held) RETURNING 1")
RELEASE = Sql("WITH" + _RELEASE)
RELEASE_FENCE_CUT = Sql("WITH moved AS (UPDATE {s}.worker_fences SET epoch = epoch + 1 WHERE worker = %s RETURNING 1),"
                        + _RELEASE)


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
        rows = await self.db.rows(SUSPECT_CLAIMING, {
            "queues": queues, "names": names, "owner": owner, "lease": lease_seconds,
            "token": (token := secrets.randbits(63)), "commit": "off"})
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
            row = await s.row(LIMITS, (queue,))
            if row is None:
                return await self._claim(s, owner, [queue], names, limit, lease_seconds, durable=True)
            concurrency, rate_limit, period, tokens, keyed, key_rated = row
            if concurrency is not None:
                held = await s.row(HELD, {"queue": queue})
                limit = min(limit, concurrency - int(held[0] if held else 0))
            if rate_limit is not None:
                limit = min(limit, int(tokens))
            limit = max(0, limit)
            # (its commit waits for the disk only for a bucket's sake, as a plain claim's does not: a
            # claim lost in a crash of the server gives the row back, and fences its execution out)
            found = await self._claim(s, owner, [queue], names, limit, lease_seconds,
                                      durable=rate_limit is not None or key_rated, keyed=keyed)
            if key_rated and 0 < limit and len(found.claimed) < limit:  # short: perhaps for a key's tokens
                next_token = await s.row(NEXT_TOKEN, {"queue": queue, "names": list(names)})
                if next_token is not None and next_token[0] is not None:
                    found = found._replace(refill=max(0.0, float(next_token[0])))
            if rate_limit is None:
                return found
            left = float(tokens) - len(found.claimed)
            await s.run(SPENT, (left, queue))
            refill = (1 - left) * float(period) / rate_limit if left < 1 else None
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
            floors.update({(str(queue), served): floor for queue, floor in await s.rows(FLOORING, {
                "queues": list(queues), "names": list(names), "margin": FLOOR_MARGIN})})
        rows = await s.rows(FULL_CLAIMING if full else CLAIMING, {
            "queues": queues, "floors": [None if full else floors[queue, served] for queue in queues],
            "names": names, "limit": limit, "owner": owner, "lease": lease_seconds,
            "token": (token := secrets.randbits(63)), "commit": "on" if durable else "off"})
        due, suspects = rows[-1][-2:]
        return Round(claimed_of(rows[:-1], owner, token), None if due is None else max(0.0, float(due)), suspects)

    async def _claim_keyed(self, s: Session, owner: str, queue: str, names: Sequence[str],
                           limit: int, lease_seconds: float, durable: bool) -> Round:
        """``_claim`` from a queue with per-key limits, under its lock (``key_limits.py``)."""
        at, claims = time.monotonic(), (frozenset([queue]), frozenset(names))
        full = at - self._full_claim_at.get(claims, -math.inf) >= FULL_CLAIM_EVERY
        if full:
            self._full_claim_at[claims] = at
        rows = await s.rows(FULL_KEYED_CLAIMING if full else KEYED_CLAIMING, {
            "queue": queue, "queues": [queue], "names": names, "limit": limit, "owner": owner, "lease": lease_seconds,
            "token": (token := secrets.randbits(63)), "commit": "on" if durable else "off"})
        due, suspects = rows[-1][-2:]
        return Round(claimed_of(rows[:-1], owner, token), None if due is None else max(0.0, float(due)), suspects)

    async def unclaim(self, claimed: Sequence[Claimed]) -> list[str]:
        """Undo claims whose workflows were not run (their worker began to stop while the claim ran):
        queued again as they were before it, the attempt not counted, so giving them back costs them
        nothing. (A limited queue's token spent on the claim is not refunded.) Returns the ids given back."""
        rows = await self.db.rows(UNCLAIM, (
            [c.id for c in claimed], [c.lease_token for c in claimed], [c.set_start for c in claimed],
            [c.set_deadline for c in claimed], [c.uncounted for c in claimed], [c.give_up for c in claimed]))
        return [str(row[0]) for row in rows]

    async def declare_queue(self, name: str, concurrency: int | None, rate_limit: int | None,
                            rate_period: float, key_concurrency: int | None = None,
                            key_rate_limit: int | None = None) -> None:
        """Record a queue's limits (the bucket starts full), or forget them when there are none."""
        if concurrency is None and rate_limit is None and key_concurrency is None and key_rate_limit is None:
            await self.db.run(FORGET_QUEUE, (name,))
            return
        await self.db.run(DECLARE_QUEUE, {"name": name, "concurrency": concurrency, "rate": rate_limit,
                                          "period": rate_period, "key_concurrency": key_concurrency,
                                          "key_rate": key_rate_limit})

    async def release(self, id: str, lease_token: int, fence_cut: str | None = None) -> bool:
        """Give a workflow back to the queue now, so another worker resumes it without waiting.
        ``fence_cut``: a batch of the run's chunks under that worker's fence was cut off and may still
        run; the release moves the fence on in its own statement, so it commits only after that batch
        (which does not lock this row) has ended, and one not yet past the fence is refused."""
        if fence_cut is None:
            row = await self.db.row(RELEASE, (id, lease_token))
        else:
            row = await self.db.row(RELEASE_FENCE_CUT, (fence_cut, id, lease_token))
        return row is not None
