"""Looking at workflows and cancelling them: the rows as callers and handles see them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from .database import Port, Sql
from .fencing import held
from .starts import BORN
from .statement import ById, Id


class WorkflowRow(NamedTuple):
    """A workflow as callers and handles see it (the row of ``WORKFLOW``)."""

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


class Ids(NamedTuple):
    ids: list[str]


# Which ids name workflows; one workflow as callers and handles see it.
EXISTING = Sql("SELECT id FROM {s}.workflows WHERE id = ANY(%s)", row=tuple[str], params=Ids)
WORKFLOW = Sql(f"SELECT {WORKFLOW_ROW} FROM {{s}}.workflows WHERE id = %s", row=WorkflowRow, params=Id)
# A workflow and every workflow its body started (children, theirs, ...) cancelled when queued, flagged
# when running; the asked one's row first (none: no such workflow).
REQUEST_CANCEL = Sql(
    "WITH RECURSIVE tree AS (SELECT id FROM {s}.workflows WHERE id = %(id)s"
    "  UNION SELECT w.id FROM {s}.workflows w JOIN tree ON w.parent_id = tree.id),"
    " asked AS (UPDATE {s}.workflows SET"
    "  status = CASE WHEN status = 'queued' THEN 'cancelled' ELSE status END,"
    "  finished_at = CASE WHEN status = 'queued' THEN {s}.clock_now() ELSE finished_at END,"
    "  cancel_requested = status IN ('queued', 'running')"
    "  WHERE id IN (SELECT id FROM tree) AND (id = %(id)s OR status IN ('queued', 'running'))"
    "  RETURNING id, status)"
    " SELECT id, status FROM asked ORDER BY id = %(id)s DESC", row=tuple[str, str], params=ById)
# Those of the running workflows asked about whose cancellation was asked for.
CANCELS_REQUESTED = Sql(
    "WITH " + held("cancelling", "(SELECT unnest(%s::text[]) AS id)", "w.id", by="w.cancel_requested")
    + " SELECT id FROM cancelling", row=tuple[str], params=Ids)


class Workflows(Port):
    """The port that finds workflows by id and cancels them, with everything they started."""

    async def existing(self, ids: list[str]) -> set[str]:
        """Which of ``ids`` name workflows."""
        return {id for id, in await self.db.rows(EXISTING, ids)}

    async def workflow(self, id: str) -> WorkflowRow | None:
        return await self.db.row(WORKFLOW, id)

    async def request_cancel(self, id: str) -> Cancelled | None:
        """Cancel a queued workflow at once, or flag a running one, and the same for every workflow
        its body started (children, theirs, ...) that has not ended. None: no such workflow."""
        rows = await self.db.rows(REQUEST_CANCEL, id=id)
        if not rows or rows[0][0] != id:
            return None
        return Cancelled(rows[0][1], [descendant for descendant, _ in rows[1:]])

    async def cancels_requested(self, ids: Sequence[str]) -> list[str]:
        """Those of ``ids`` still running whose cancellation was asked for."""
        return [id for id, in await self.db.rows(CANCELS_REQUESTED, list(ids))]
