"""The SQL of waiting workflows: journaled wake-up times, and giving a waiting workflow's slot back."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import NamedTuple

from ..status import Status
from .database import Port, Sql
from .fencing import HOLDS, OWNER_LOCKED, Fence, Fenced, Journaled, Receipt, Requeued, Wake
from .statement import ById, Id


class Sleeping(Journaled):
    seconds: float


class Woken(NamedTuple):
    """A sleep's wake-up as journaled (``RECORD_WAKE``): whether a cancellation was asked for (None:
    the claim no longer holds the workflow), and when it wakes, ``left`` seconds from the statement."""

    cancel_requested: bool | None
    wake_at: datetime | None
    left: float | None


# A sleep's wake-up journaled for the execution holding its claim, unless one is already (then that one).
RECORD_WAKE = Sql(
    "WITH " + OWNER_LOCKED + ","
    " written AS (INSERT INTO {s}.steps (workflow_id, position, name, attempts, attempt, wake_at)"
    "  SELECT %(id)s, %(position)s, %(name)s, 1, %(attempt)s,"
    "   {s}.clock_now() + make_interval(secs => %(seconds)s) FROM owner"
    "  ON CONFLICT (workflow_id, position) DO NOTHING RETURNING wake_at),"
    " wake AS (SELECT wake_at FROM written UNION ALL SELECT wake_at FROM {s}.steps"
    "  WHERE workflow_id = %(id)s AND position = %(position)s AND NOT EXISTS (SELECT FROM written))"
    " SELECT (SELECT cancel_requested FROM owner), w.wake_at,"
    "  extract(epoch FROM w.wake_at - {s}.clock_now())::float8"
    " FROM (SELECT 1) AS one LEFT JOIN wake w ON true", row=Woken, params=Sleeping)


class Suspending(ById):
    topic: str | None
    until: datetime


# A running workflow's slot given back until it is due again (``Waits.suspend``), under that lock.
SUSPEND = Sql(
    "UPDATE {s}.workflows SET"
    " status = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'queued' END,"
    " finished_at = CASE WHEN cancel_requested THEN {s}.clock_now() END,"
    " due_at = CASE WHEN EXISTS (SELECT FROM {s}.messages WHERE workflow_id = %(id)s"
    "  AND topic = %(topic)s AND consumed_at IS NULL) THEN {s}.clock_now()"
    "  ELSE least(%(until)s, deadline_at) END,"
    " waiting_for = %(topic)s, uncounted = true,"
    " lease_owner = NULL, lease_expires_at = NULL"
    " WHERE id = %(id)s RETURNING queue, status", row=tuple[str, str], params=Suspending)


class Topic(ById):
    topic: str


class Message(Topic):
    value: bytes
    key: str | None  # its idempotency key


# A message stored for a workflow (once per idempotency key), with the workflow's queue.
STORE_MESSAGE = Sql(
    "INSERT INTO {s}.messages (workflow_id, topic, value, idempotency_key)"
    " SELECT id, %(topic)s, %(value)s, %(key)s FROM {s}.workflows WHERE id = %(id)s"
    " ON CONFLICT (workflow_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING"
    " RETURNING (SELECT queue FROM {s}.workflows WHERE id = %(id)s)", row=tuple[str], params=Message)
# Whether the workflow gave its slot back to wait for this topic, its row locked.
WAITING_FOR = Sql(
    "SELECT status = 'queued' AND waiting_for = %(topic)s FROM {s}.workflows WHERE id = %(id)s FOR NO KEY UPDATE",
    row=tuple[bool], params=Topic)
# A workflow due now; the queue of a workflow.
DUE_NOW = Sql("UPDATE {s}.workflows SET due_at = {s}.clock_now() WHERE id = %s", row=None, params=Id)
QUEUE_OF = Sql("SELECT queue FROM {s}.workflows WHERE id = %s", row=tuple[str], params=Id)


class Receiving(Journaled):
    topic: str
    timeout: float
    final: bool


class Received(NamedTuple):
    """What a receive found (``RECEIVE``): whether a cancellation was asked for (None: the claim no longer
    holds the workflow), whether a message was ``taken`` and its ``value``, and the entry's deadline,
    ``left`` seconds from the statement."""

    cancel_requested: bool | None
    taken: bool
    value: bytes | None
    deadline: datetime | None
    left: float | None


# A receive: the oldest unconsumed message of the topic taken and journaled, or the entry waiting.
RECEIVE = Sql(
    "WITH " + OWNER_LOCKED + ","
    " msg AS (SELECT id FROM {s}.messages WHERE workflow_id = %(id)s AND topic = %(topic)s"
    "  AND consumed_at IS NULL AND EXISTS (SELECT FROM owner) AND NOT EXISTS (SELECT FROM {s}.steps"
    "   WHERE workflow_id = %(id)s AND position = %(position)s AND NOT waiting)"
    "  ORDER BY id LIMIT 1 FOR UPDATE),"
    " taken AS (UPDATE {s}.messages m SET consumed_at = {s}.clock_now(), consumed_position = %(position)s"
    "  FROM msg WHERE m.id = msg.id RETURNING m.value),"
    " entry AS (INSERT INTO {s}.steps AS st"
    "  (workflow_id, position, name, output, attempts, attempt, wake_at, waiting)"
    "  SELECT %(id)s, %(position)s, %(name)s, (SELECT value FROM taken), 1, %(attempt)s,"
    "   {s}.clock_now() + make_interval(secs => %(timeout)s), NOT EXISTS (SELECT FROM taken) AND NOT %(final)s"
    "  FROM owner"
    "  ON CONFLICT (workflow_id, position) DO UPDATE SET output = excluded.output, waiting = excluded.waiting,"
    "   attempt = excluded.attempt, finished_at = {s}.clock_now()"
    "   WHERE st.waiting AND NOT excluded.waiting"
    "  RETURNING wake_at),"
    " deadline AS (SELECT coalesce((SELECT wake_at FROM entry), (SELECT wake_at FROM {s}.steps"
    "  WHERE workflow_id = %(id)s AND position = %(position)s)) AS at)"
    " SELECT (SELECT cancel_requested FROM owner), EXISTS (SELECT FROM taken), (SELECT value FROM taken),"
    "  at, extract(epoch FROM at - {s}.clock_now())::float8 FROM deadline", row=Received, params=Receiving)


class Publishing(Journaled):
    key: str
    value: bytes


# An event published and journaled at its position in one statement (a position journaled publishes nothing).
SET_EVENT = Sql(
    "WITH " + OWNER_LOCKED + ","
    " written AS (INSERT INTO {s}.steps (workflow_id, position, name, output, attempts, attempt)"
    "  SELECT %(id)s, %(position)s, %(name)s, %(value)s, 1, %(attempt)s FROM owner"
    "  ON CONFLICT (workflow_id, position) DO NOTHING RETURNING 1),"
    " published AS (INSERT INTO {s}.events (workflow_id, key, value)"
    "  SELECT %(id)s, %(key)s, %(value)s FROM written"
    "  ON CONFLICT (workflow_id, key) DO UPDATE SET value = excluded.value, set_at = {s}.clock_now()"
    "  RETURNING 1)"
    " SELECT (SELECT cancel_requested FROM owner), (SELECT count(*) FROM published)",
    row=tuple[bool | None, int], params=Publishing)


class EventOf(NamedTuple):
    key: str
    id: str


# An event's value (NULL: none under that key) and its workflow's status; no row: no such workflow.
GET_EVENT = Sql(
    "SELECT e.value, w.status FROM {s}.workflows w"
    " LEFT JOIN {s}.events e ON e.workflow_id = w.id AND e.key = %s WHERE w.id = %s",
    row=tuple[bytes | None, str], params=EventOf)


class Waits(Port):
    """The statements of ``Engine`` for sleeps and suspensions (the pool and schema come from it)."""

    async def record_wake(self, workflow_id: str, attempt: int, lease_token: int, position: int, name: str,
                          seconds: float) -> Fenced[Wake]:
        """Journal a wake-up ``seconds`` from now, on the server's clock, for the execution holding
        ``attempt`` under ``lease_token``; the wake-up as journaled (by this call or an earlier one)."""
        row = await self.db.row(RECORD_WAKE, id=workflow_id, attempt=attempt, lease=lease_token, position=position,
                                name=name, seconds=seconds)
        assert row is not None
        cancel = row.cancel_requested
        return Fenced(cancel is not None, bool(cancel), Wake(row.left or 0.0, row.wake_at or datetime.now(UTC)))

    async def suspend(self, workflow_id: str, lease_token: int, until: datetime,
                      topic: str | None = None) -> Requeued | None:
        """Give a running workflow's slot back until ``until`` (or its timeout's deadline, if that
        comes first, when the claim fails it): queued again, due then, its lease released; its
        next claim begins no new attempt (``uncounted``: migration 0028).
        A workflow waiting for a message on ``topic`` that is already there is due at once,
        and a cancellation asked for meanwhile ends it as cancelled instead. Returns its queue and
        status now, or None when ``lease_token`` no longer holds the workflow.

        The row is locked before the messages are looked at, by a statement of its own: a send that
        stores a message locks the row too, so either the send committed first and this look sees its
        message, or the send waits for this commit and then finds the workflow waiting for its topic.
        (fencing.HOLDS_LOCKED)"""
        async with self.db.session() as s, s.transaction():
            if await s.row(HOLDS, workflow_id, lease_token) is None:
                return None
            row = await s.row(SUSPEND, id=workflow_id, topic=topic, until=until)
        return None if row is None else Requeued(row[0], Status(row[1]))

    async def send(self, workflow_id: str, topic: str, value: bytes,
                   idempotency_key: str | None) -> tuple[bool, str, bool] | None:
        """Engine a message for a workflow (one per idempotency key); make the workflow due now when
        it gave its slot back to wait for this topic. Returns (stored now, its queue, made due), or
        None when no such workflow exists. (See ``suspend`` for why the row is locked once the
        message is stored; a message stored before leaves the row alone, so a duplicate send cannot
        make a claim skip it.)"""
        async with self.db.session() as s, s.transaction():
            stored = await s.row(STORE_MESSAGE, topic=topic, value=value, key=idempotency_key, id=workflow_id)
            if stored is None:
                found = await s.row(QUEUE_OF, workflow_id)
                return None if found is None else (False, found[0], False)
            waiting = await s.row(WAITING_FOR, topic=topic, id=workflow_id)
            if waiting is not None and waiting[0]:
                await s.run(DUE_NOW, workflow_id)
        return True, stored[0], bool(waiting is not None and waiting[0])

    async def receive(self, workflow_id: str, attempt: int, lease_token: int, position: int, name: str, topic: str,
                      timeout: float, final: bool) -> Fenced[Receipt]:
        """For the execution holding ``attempt``: take the oldest unconsumed message of ``topic`` and
        journal it at ``position``, in one statement, so a message is consumed exactly when its
        receipt is recorded. Without one, the entry is journaled as waiting (its deadline ``timeout``
        seconds from the first call), or, when ``final``, as timed out.

        """
        row = await self.db.row(RECEIVE, id=workflow_id, attempt=attempt, lease=lease_token, position=position,
                                name=name, topic=topic, timeout=timeout, final=final)
        assert row is not None
        cancel = row.cancel_requested
        # (no deadline: the claim no longer holds the workflow, and nothing was journaled)
        deadline = row.deadline or datetime.now(UTC)
        return Fenced(cancel is not None, bool(cancel), Receipt(row.taken, row.value, row.left or 0.0, deadline))

    async def set_event(self, workflow_id: str, attempt: int, lease_token: int, position: int, name: str,
                        key: str, value: bytes) -> Fence:
        """Publish ``value`` under ``key`` for the execution holding ``attempt``, and journal it at
        ``position`` in the same statement (a position already journaled publishes nothing)."""
        row = await self.db.row(SET_EVENT, id=workflow_id, attempt=attempt, lease=lease_token, position=position,
                                name=name, key=key, value=value)
        assert row is not None
        return Fence(row[0] is not None, bool(row[0]))

    async def get_event(self, workflow_id: str, key: str) -> tuple[bytes | None, str] | None:
        """(the value under ``key`` or None, the workflow's status); None: no such workflow."""
        return await self.db.row(GET_EVENT, key, workflow_id)
