"""The SQL of streams: reading the ends once per execution, group-committed writes, shared reads."""

from __future__ import annotations

from typing import Any

from psycopg_pool import AsyncConnectionPool


class StreamStatements:
    """The stream statements of ``Store`` (which provides the pool and the schema)."""

    pool: AsyncConnectionPool[Any]

    def _sql(self, template: str) -> str:
        raise NotImplementedError

    async def stream_ends(self, workflow_id: str) -> dict[str, int]:
        """The next free position of each of a workflow's streams: read once per execution, so
        positions are then assigned in memory rather than by a max()+1 query per write."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(self._sql(
                "SELECT key, max(position) + 1 FROM {s}.streams WHERE workflow_id = %s GROUP BY key"
            ), (workflow_id,))
            return {str(key): int(end) for key, end in await cur.fetchall()}

    async def write_chunks(
        self, workflow_ids: list[str], attempts: list[int], keys: list[str], positions: list[int],
        values: list[bytes | None],
    ) -> tuple[set[tuple[str, int]], set[str]]:
        """Insert a batch of chunks from many executions in one autocommit statement (no transaction
        left open around it, so a writer paused mid-batch holds no lock).

        Each chunk is written only if its execution still holds its workflow (fencing). Returns the
        (workflow id, attempt) pairs that were fenced out and the ids whose cancellation was requested.
        """
        async with self.pool.connection() as conn:
            cur = await conn.execute(self._sql(
                "WITH batch AS (SELECT * FROM unnest(%b::text[], %b::int[], %b::text[], %b::int[],"
                "   %b::bytea[]) AS b(workflow_id, attempt, key, position, value)),"
                " owners AS (SELECT w.id, w.attempt, w.cancel_requested FROM {s}.workflows w"
                "   WHERE w.id = ANY(%s::text[]) AND w.status = 'running'"
                "   ORDER BY w.id FOR SHARE),"
                " written AS (INSERT INTO {s}.streams (workflow_id, key, position, value)"
                "   SELECT b.workflow_id, b.key, b.position, b.value FROM batch b"
                "   JOIN owners o ON o.id = b.workflow_id AND o.attempt = b.attempt"
                "   ON CONFLICT DO NOTHING RETURNING 1)"
                " SELECT b.workflow_id, b.attempt, o.id IS NULL, coalesce(o.cancel_requested, false)"
                " FROM (SELECT DISTINCT workflow_id, attempt FROM batch) b"
                " LEFT JOIN owners o ON o.id = b.workflow_id AND o.attempt = b.attempt"
            ), (workflow_ids, attempts, keys, positions, values, sorted(set(workflow_ids))))
            rows = await cur.fetchall()
        fenced = {(str(r[0]), int(r[1])) for r in rows if r[2]}
        cancelled = {str(r[0]) for r in rows if r[3]}
        return fenced, cancelled

    async def read_streams(
        self, workflow_ids: list[str], keys: list[str], offsets: list[int], limit: int,
    ) -> list[tuple[str | None, bool, list[tuple[int, bytes | None]]]]:
        """For each (workflow, key, offset) asked: the workflow's status (None when there is no such
        workflow), whether the stream is closed, and up to ``limit`` chunks from the offset on, all in
        one query.

        Status and chunks come from one snapshot: a workflow seen ended has every chunk it wrote
        visible too, so a reader that finds no chunks and an ended workflow knows the stream is over.
        """
        async with self.pool.connection() as conn:
            cur = await conn.execute(self._sql(
                "SELECT r.i, w.status, coalesce(last.closed, false), c.position, c.value"
                " FROM unnest(%b::text[], %b::text[], %b::int[]) WITH ORDINALITY AS r(workflow_id, key, start, i)"
                " LEFT JOIN {s}.workflows w ON w.id = r.workflow_id"
                # The close marker is always a stream's last chunk.
                " LEFT JOIN LATERAL (SELECT value IS NULL AS closed FROM {s}.streams"
                "   WHERE workflow_id = r.workflow_id AND key = r.key ORDER BY position DESC LIMIT 1) last ON true"
                " LEFT JOIN LATERAL (SELECT position, value FROM {s}.streams"
                "   WHERE workflow_id = r.workflow_id AND key = r.key AND position >= r.start"
                "   ORDER BY position LIMIT %s) c ON true"
                " ORDER BY r.i, c.position"
            ), (workflow_ids, keys, offsets, limit), binary=True)
            found: list[tuple[str | None, bool, list[tuple[int, bytes | None]]]] = [
                (None, False, []) for _ in workflow_ids
            ]
            for i, status, closed, position, value in await cur.fetchall():
                chunks = found[i - 1][2]
                if position is not None:
                    chunks.append((int(position), value))
                found[i - 1] = (status, bool(closed), chunks)
            return found
