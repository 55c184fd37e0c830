"""The SQL of ``pgflow check-replay``: what it reads of unfinished workflows, on a connection of its
own inside one read-only transaction (a consistent snapshot, and nothing it runs can write)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from psycopg import AsyncConnection

from .database import quote_identifier
from .journal import JOURNAL, StepRecord, journal_of
from .workflows import WORKFLOW_ROW, WorkflowRow

# The journal as the workers read it, without the schema's clock: a check runs against the schema as it
# is before a deploy, which may lack the clock's migration, and needs no sleep's time left (every
# recorded sleep counts as over: the body goes on to the next record, or stops where there is none).
CHECK_JOURNAL = JOURNAL.replace("{s}.clock_now()", "now()")


class ReplayReads:
    """Reads over one read-only connection; the caller owns the connection and its transaction."""

    def __init__(self, conn: AsyncConnection[Any], schema: str) -> None:
        self.conn = conn
        self._s = quote_identifier(schema)

    def _sql(self, template: str) -> str:
        return template.replace("{s}", self._s)

    async def unfinished(self, statuses: Sequence[str], limit: int) -> list[tuple[str, str, str, bytes]]:
        """(id, name, status, inputs) of up to ``limit`` workflows in ``statuses``, oldest first."""
        cur = await self.conn.execute(self._sql(
            "SELECT id, name, status, inputs FROM {s}.workflows WHERE status = ANY(%s)"
            " ORDER BY created_at, id LIMIT %s"), (list(statuses), limit))
        return [(str(r[0]), str(r[1]), str(r[2]), bytes(r[3])) for r in await cur.fetchall()]

    async def journal(self, workflow_id: str) -> tuple[dict[int, StepRecord], int]:
        """As ``Engine.journal``: the records, and the highest position reached (children included)."""
        cur = await self.conn.execute(self._sql(CHECK_JOURNAL), {"id": workflow_id})
        return journal_of(await cur.fetchall())

    async def workflow(self, id: str) -> WorkflowRow | None:
        cur = await self.conn.execute(self._sql(
            f"SELECT {WORKFLOW_ROW} FROM {{s}}.workflows WHERE id = %s"), (id,))
        row = await cur.fetchone()
        return None if row is None else WorkflowRow(*row)
