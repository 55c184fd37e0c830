"""The SQL of debounced starts (``with_options(debounce=..., debounce_key=...)``): the starts of one
workflow name and key that come within the window collapse into one queued run, and the clean-up of
the keys whose run has left the queue.

Why a transaction of its own, with an advisory lock: two starters of one key that each looked for
the key's pending run in one statement could both find none and both insert one. The lock
(transaction-level, on a hash of the schema, the name and the key: nothing to release, and nothing
held past the commit, so it is safe through a transaction-mode pooler) serialises them, and the
statement that follows it takes its snapshot after the previous holder committed, so it sees that
holder's run. The run's row itself is locked (``FOR UPDATE``) while its arguments and due time change:
a worker's claim (``FOR UPDATE SKIP LOCKED``) never takes it half-changed, and a claim that locked it
first wins: the start, after waiting for that claim, finds the run no longer queued and begins a new
one. Starts of other keys never wait for each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, TypedDict

from .channel import Pings, Riding, ping_parameters, riding
from .database import Port, Sql
from .starts import BORN, EXPIRES, NewWorkflows, Options
from .statement import Batch


@dataclass(frozen=True, slots=True)
class Debounce:
    """How a start is debounced: its ``key`` (starts of one workflow name and key collapse), the
    quiet ``window`` in seconds it waits for, and ``most``, the seconds from the burst's first start
    after which the run is due however busy the key stays."""

    key: str
    window: float
    most: float


class Debounced(NamedTuple):
    """What a debounced start found: the ``id`` of the key's run, whether this start ``created`` it
    (False: it joined the pending run, whose arguments are now this start's), and the run's birth
    (``starts.BORN``)."""

    id: str
    created: bool
    born: int


# Transaction-level, so it ends with the transaction that takes it; the two-key form lives apart
# from the one-key advisory locks pgflow takes elsewhere (maintenance, migrations).
class KeyLock(TypedDict):
    space: str  # the schema's
    name: str
    key: str


LOCK_KEY = Sql("SELECT pg_advisory_xact_lock(hashtext(%(space)s), hashtext(%(name)s || chr(10) || %(key)s))",
               row=tuple[None], params=KeyLock)

_DUE_LATEST = ("least({s}.clock_now() + make_interval(secs => %(window)s),"
               " p.first_at + make_interval(secs => %(most)s))")

# Under the key's lock: the pending run (queued and never claimed) joined, or a new one begun and the
# key pointed at it. A joined run's due time only moves later (``greatest``): a run already due keeps
# its place in the queue (a claim's floor never sees a due time go back), and it never passes
# first_at + most. Its arguments, expiry and trace become this start's; its queue, priority, key and
# limits stay those of the start that created it.
DEBOUNCE = (
    "WITH pending AS MATERIALIZED (SELECT w.id, d.first_at FROM {s}.debounces d"
    "  JOIN {s}.workflows w ON w.id = d.workflow_id"
    "  WHERE d.name = %(name)s AND d.key = %(key)s AND w.status = 'queued' AND w.started_at IS NULL"
    "  FOR UPDATE OF w),"
    " joined AS (UPDATE {s}.workflows w SET inputs = %(inputs)s,"
    f"  due_at = greatest(w.due_at, {_DUE_LATEST}),"
    f"  expires_at = {EXPIRES}, traceparent = coalesce(%(traceparent)s, w.traceparent)"
    f"  FROM pending p WHERE w.id = p.id RETURNING w.id, {BORN} AS born),"
    " new AS (INSERT INTO {s}.workflows"
    "  (id, name, queue, priority, inputs, due_at, max_attempts, timeout, parent_id, traceparent, expires_at, key)"
    "  SELECT %(id)s, %(name)s, %(queue)s, %(priority)s, %(inputs)s,"
    "   {s}.clock_now() + make_interval(secs => %(window)s), %(max_attempts)s, %(timeout)s, %(parent)s,"
    f"   %(traceparent)s, {EXPIRES}, coalesce(%(start_key)s, '')"
    "  WHERE NOT EXISTS (SELECT FROM pending)"
    f"  ON CONFLICT (id) DO NOTHING RETURNING id, {BORN} AS born),"
    " pointed AS (INSERT INTO {s}.debounces (name, key, workflow_id, first_at)"
    "  SELECT %(name)s, %(key)s, id, {s}.clock_now() FROM new"
    "  ON CONFLICT (name, key) DO UPDATE SET workflow_id = excluded.workflow_id, first_at = excluded.first_at)"
    " SELECT id, false, born FROM joined UNION ALL SELECT id, true, born FROM new"
)


class Debouncing(Options, Riding):
    id: str
    inputs: bytes
    start_key: str | None
    key: str  # the debounce's
    window: float
    most: float


DEBOUNCING = Sql(DEBOUNCE + riding(3), row=Debounced, params=Debouncing)  # (with the start's pings)

# Keys whose run is no longer pending: claimed, ended, cancelled or pruned. The delete matches the
# pointer it read, so a key that a start moved on to a new run meanwhile (the delete waits for that
# start's row lock, then re-reads the row) is left alone.
STALE = Sql(
    "WITH stale AS (SELECT d.name, d.key, d.workflow_id FROM {s}.debounces d"
    "  WHERE NOT EXISTS (SELECT FROM {s}.workflows w WHERE w.id = d.workflow_id"
    "   AND w.status = 'queued' AND w.started_at IS NULL) LIMIT %(batch)s),"
    " gone AS (DELETE FROM {s}.debounces d USING stale s"
    "  WHERE d.name = s.name AND d.key = s.key AND d.workflow_id = s.workflow_id RETURNING 1)"
    " SELECT count(*) FROM gone", row=tuple[int], params=Batch)


class Debounces(Port):
    """The debounce statements of ``Engine`` (which provides the pool and the schema)."""

    async def enqueue_debounced(self, id: str, inputs: bytes, new: NewWorkflows, debounce: Debounce,
                                pings: Pings) -> Debounced:
        """Join the key's pending run with these arguments, or begin a new one under ``id``, due
        ``debounce.window`` seconds from now. ``new.when`` gives the expiry only (a debounced start's
        due time is the debounce's). ``pings`` go out with the commit.

        Three round trips besides BEGIN and COMMIT would be one with a pipeline, but a
        transaction-mode pooler may not take one, and a debounced start is no hot path: it waits a
        window by design."""
        async with self.db.session() as s, s.transaction():
            await s.run(LOCK_KEY, space=f"pgflow.debounce {self.db.schema}", name=new.name, key=debounce.key)
            row = await s.row(DEBOUNCING, id=id, inputs=inputs, **new.options(), start_key=new.key,
                              key=debounce.key, window=debounce.window, most=debounce.most,
                              **ping_parameters(s.conn, pings))
        if row is None:
            # Only an id that exists already inserts nothing, and ids here are new (a uuid): a
            # debounced start takes no chosen id (checks.check_debounce).
            raise LookupError(f"workflow id {id!r} exists already; a debounced start needs a new one")
        return row

    async def prune_debounces(self, batch: int) -> int:
        """Delete up to ``batch`` keys whose run is no longer pending; how many went. (The key's next
        start would replace its row anyway: this keeps the table to about the keys with a run
        waiting, rather than every key ever debounced.)"""
        row = await self.db.row(STALE, batch=batch)
        return row[0] if row else 0
