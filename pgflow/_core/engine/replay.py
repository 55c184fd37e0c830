"""The SQL of ``pgflow check-replay``: what it reads of unfinished workflows, on a connection of its
own inside one read-only transaction (a consistent snapshot, and nothing it runs can write)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from psycopg import AsyncConnection

from .database import Session, Sql, quote_identifier
from .journal import JOURNAL, JournalRow, StepRecord, journal_of
from .statement import ById
from .workflows import WORKFLOW, WorkflowRow

# The journal as the workers read it, without the schema's clock: a check runs against the schema as it
# is before a deploy, which may lack the clock's migration, and needs no sleep's time left (every
# recorded sleep counts as over: the body goes on to the next record, or stops where there is none).
CHECK_JOURNAL = Sql(JOURNAL.replace("{s}.clock_now()", "now()"), row=JournalRow, params=ById)


class Unfinished(NamedTuple):
    statuses: list[str]
    limit: int


# Up to a limit of the workflows in some statuses, oldest first: (id, name, status, inputs).
UNFINISHED = Sql("SELECT id, name, status, inputs FROM {s}.workflows WHERE status = ANY(%s)"
                 " ORDER BY created_at, id LIMIT %s", row=tuple[str, str, str, bytes], params=Unfinished)


class ReplayReads:
    """Reads over one read-only connection; the caller owns the connection and its transaction."""

    def __init__(self, conn: AsyncConnection[Any], schema: str) -> None:
        self._session = Session(conn, quote_identifier(schema))

    async def unfinished(self, statuses: Sequence[str], limit: int) -> list[tuple[str, str, str, bytes]]:
        """(id, name, status, inputs) of up to ``limit`` workflows in ``statuses``, oldest first."""
        return await self._session.rows(UNFINISHED, list(statuses), limit)

    async def journal(self, workflow_id: str) -> tuple[dict[int, StepRecord], int]:
        """As ``Engine.journal``: the records, and the highest position reached (children included)."""
        return journal_of(await self._session.rows(CHECK_JOURNAL, id=workflow_id))

    async def workflow(self, id: str) -> WorkflowRow | None:
        return await self._session.row(WORKFLOW, id)
