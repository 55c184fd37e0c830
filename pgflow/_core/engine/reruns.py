"""The SQL of a workflow retry policy: a failed body given back to the queue, to run again later."""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec
from psycopg.types.json import Jsonb

from ..status import Status
from .database import Port, Sql
from .fencing import HOLDS
from .management import FORGET_ATTEMPTS, FORGET_FROM_ERROR
from .statement import ById


class RetryLater(ById):
    delay: float
    error: Jsonb


# A failed body given back to the queue, under the lock its claim took (``Reruns.retry_later``): its
# journal from the first error on forgotten with its attempts' notes, as a resume does, then the row
# queued again.
RETRY_LATER = Sql(
    "UPDATE {s}.workflows SET"
    " status = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'queued' END,"
    " finished_at = CASE WHEN cancel_requested THEN {s}.clock_now() END,"
    " due_at = least({s}.clock_now() + make_interval(secs => %(delay)s), deadline_at),"
    " retries = retries + 1, uncounted = true, error = %(error)s,"
    " lease_owner = NULL, lease_expires_at = NULL"
    " WHERE id = %(id)s RETURNING queue, status, retries", row=tuple[str, str, int], params=RetryLater)


class Rerun(NamedTuple):
    """A failed body given back: its ``queue``, its ``status`` now (queued, or cancelled when that was
    asked for meanwhile), and ``retries`` so far."""

    queue: str
    status: Status
    retries: int


class Reruns(Port):
    """The statements of ``Engine`` for workflow retries (the pool and schema come from it)."""

    async def retry_later(self, workflow_id: str, lease_token: int, delay: float,
                          error: dict[str, Any]) -> Rerun | None:
        """Queue a workflow whose body failed again, due in ``delay`` seconds (or at its timeout's
        deadline, if that comes first), for the execution holding ``lease_token``. As ``resume``
        does, the journal loses the first step record that holds an error and every later one, so
        that step runs again while those before it replay; the failure stays in ``error`` until the
        workflow ends, and ``retries`` counts it. The failed run costs nothing of ``max_attempts``
        (which counts runs cut short). A cancellation asked for meanwhile ends it as cancelled.
        None when the claim no longer holds it."""
        async with self.db.session() as s, s.transaction():
            if await s.row(HOLDS, workflow_id, lease_token) is None:
                return None
            await s.run(FORGET_FROM_ERROR, id=workflow_id)
            await s.run(FORGET_ATTEMPTS, workflow_id)
            row = await s.row(RETRY_LATER, id=workflow_id, delay=delay,
                              error=Jsonb(error, dumps=lambda v: msgspec.json.encode(v).decode()))
        if row is None:
            return None
        queue, status, retries = row
        return Rerun(queue, Status(status), retries)
