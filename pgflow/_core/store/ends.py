"""The SQL of workflow ends recorded many at once (see ``_core/finisher.py``)."""

from __future__ import annotations

from typing import Any

import msgspec

from .statements import Statements

_ERRORS = msgspec.json.Encoder()


class EndStatements(Statements):
    """The end statements of ``Store`` (which provides the pool and the schema)."""

    async def finish_many(
        self, workflow_ids: list[str], attempts: list[int], statuses: list[str], outputs: list[bytes | None],
        errors: list[dict[str, Any] | None], channel: str, pings: list[str],
    ) -> set[tuple[str, int]]:
        """Record the ends of many executions in one autocommit statement, and send ``pings`` on
        ``channel`` with its commit. An end is recorded only while its attempt still holds the
        workflow (fencing); returns the (id, attempt) pairs that were.

        The rows are locked in id order, the order every statement that locks several workflow rows
        takes them in (heartbeats, stream batches), so two batches cannot deadlock. A batch tried
        again after a lost connection that had in fact committed finds its workflows ended: that
        reads as a lost lease, and nothing is recorded twice.
        """
        async with self.pool.connection() as conn:
            cur = await conn.execute(self._sql(
                "WITH ends AS (SELECT * FROM unnest(%b::text[], %b::int[], %b::text[], %b::bytea[], %b::text[])"
                "   AS e(id, attempt, status, output, error)),"
                " owned AS (SELECT w.id FROM {s}.workflows w JOIN ends e ON w.id = e.id AND w.attempt = e.attempt"
                "   WHERE w.status = 'running' ORDER BY w.id FOR UPDATE OF w),"
                " done AS (UPDATE {s}.workflows w SET status = e.status, output = e.output, error = e.error::jsonb,"
                "   finished_at = now(), lease_owner = NULL, lease_expires_at = NULL"
                "   FROM ends e WHERE w.id = e.id AND w.attempt = e.attempt AND w.id IN (SELECT id FROM owned)"
                "   RETURNING w.id, w.attempt)"
                " SELECT id, attempt FROM done"
                # A branch that returns nothing but is always run: the pings go out with the commit.
                " UNION ALL SELECT NULL, NULL FROM (SELECT count(pg_notify(%s, p)) AS n"
                "   FROM unnest(%b::text[]) AS p) pinged WHERE pinged.n < 0"
            ), (workflow_ids, attempts, statuses, outputs,
                [None if e is None else _ERRORS.encode(e).decode() for e in errors], channel, pings))
            return {(str(id), int(attempt)) for id, attempt in await cur.fetchall()}
