"""The claim statement's SQL, in each of its variants (``claims.py`` runs them): a claim takes due and
orphaned workflows under a lease, within each queue's limits."""

from __future__ import annotations

from .key_limits import keyed_queued

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
    " expired_first AS (SELECT id, lease_owner AS owner, crashes, live.heartbeat_at IS NULL AS died"
    "   FROM {s}.workflows w LEFT JOIN LATERAL (SELECT k.heartbeat_at FROM {s}.workers k WHERE k.id = w.lease_owner"
    "    AND k.heartbeat_at > now() - make_interval(secs => k.lease)) live ON true"
    "   WHERE status = 'running' AND lease_expires_at < now() AND queue = ANY(%(queues)s) AND name = ANY(%(names)s)"
    # (a worker heard from within its lease may be alive: its run is left until it has been silent a
    # lease, or, alive and silent about this run, until the lease ran out a lease ago)
    "   AND (live.heartbeat_at IS NULL OR lease_expires_at < now() - make_interval(secs => coalesce("
    "    (SELECT k.lease FROM {s}.workers k WHERE k.id = w.lease_owner), 0)))"
    f"   ORDER BY lease_expires_at LIMIT {RESCUE_AT_MOST} FOR UPDATE OF w SKIP LOCKED),"
    # A dead worker's other runs go with the first of its leases to run out, whatever their own lease
    # (one claimed after its last heartbeat runs out later): rescued one by one, the last would look
    # alone, and be charged for a crash it only shared.
    # (a one-time filter first: without a dead worker, no running row is read)
    " crewmates AS (SELECT id, lease_owner AS owner, crashes, true AS died FROM {s}.workflows w"
    "   WHERE (SELECT coalesce(bool_or(died), false) FROM expired_first)"
    "   AND status = 'running' AND lease_owner = ANY(ARRAY(SELECT owner FROM expired_first WHERE died))"
    "   AND id <> ALL(ARRAY(SELECT id FROM expired_first)) FOR UPDATE OF w SKIP LOCKED),"
    " expired AS (SELECT * FROM expired_first UNION ALL SELECT * FROM crewmates),"
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
KEYED_CLAIM = _claim(full=False, keyed=True)
FULL_KEYED_CLAIM = _claim(full=True, keyed=True)
