"""The SQL of streams: reading the ends once per execution, group-committed writes, shared reads."""

from __future__ import annotations

import msgspec

from .statements import Statements


class _Chunk(msgspec.Struct, array_like=False):
    w: str
    a: int
    k: str
    p: int
    v: bytes | None


class _Owner(msgspec.Struct, array_like=False):
    id: str
    attempt: int


class _Ask(msgspec.Struct, array_like=False):
    i: int
    workflow_id: str
    key: str
    start: int


_ROWS = _ASKS = msgspec.json.Encoder()

# The fence of a batch of chunks, the one place that says whose chunks may be written: the workflow
# rows the writers named (``asked``: id, attempt) that are still running under the same execution,
# locked FOR SHARE (in id order, as rows are locked everywhere) so no claim can take a workflow over
# between this check and the commit. ``token`` is what a writer's execution is compared on.
_FENCE = (
    " fence AS (SELECT w.id, w.attempt AS token, w.cancel_requested FROM asked a JOIN {s}.workflows w ON w.id = a.id"
    "   WHERE w.status = 'running' ORDER BY w.id FOR SHARE OF w),"
)


class StreamStatements(Statements):
    """The stream statements of ``Store`` (which provides the pool and the schema)."""

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
        values: list[bytes | None], channel: str, pings: list[str], again: bool = False,
    ) -> tuple[set[tuple[str, int]], set[str]]:
        """Insert a batch of chunks from many executions in one autocommit statement (no transaction
        left open around it, so a writer paused mid-batch holds no lock), and send the batch's
        ``pings`` (NOTIFY payloads) on ``channel`` with its commit: one NOTIFY per batch, no second
        transaction.

        Each chunk is written only if its execution still holds its workflow (fencing). Returns the
        (workflow id, attempt) pairs that were fenced out and the ids whose cancellation was requested.
        A position is only ever written by the execution holding the lease, so a first attempt is a
        plain insert; only ``again`` (a retry after a lost connection, which may have committed)
        skips chunks already there, at the price of a speculative insertion per row.
        """
        document = _ROWS.encode([_Chunk(*chunk) for chunk in zip(workflow_ids, attempts, keys, positions, values,
                                                              strict=True)])
        owners = _ROWS.encode([_Owner(w, a) for w, a in sorted(set(zip(workflow_ids, attempts, strict=True)))])
        async with self.pool.connection() as conn:
            cur = await conn.execute(self._sql(
                # Two JSON documents, the chunks and their owners: msgspec encodes them far faster
                # than psycopg dumps arrays element by element (in Python, for binary arrays).
                "WITH asked AS MATERIALIZED (SELECT * FROM json_to_recordset(%b::json) AS o(id text, attempt int)),"
                + _FENCE +
                " written AS (INSERT INTO {s}.streams (workflow_id, key, position, value)"
                "   SELECT b.w, b.k, b.p, decode(b.v, 'base64')"
                "   FROM json_to_recordset(%b::json) AS b(w text, a int, k text, p int, v text)"
                "   JOIN fence f ON f.id = b.w AND f.token = b.a"
                f"  {'ON CONFLICT DO NOTHING' if again else ''} RETURNING 1)"
                " SELECT a.id, a.attempt, f.id IS NULL, coalesce(f.cancel_requested, false)"
                " FROM asked a LEFT JOIN fence f ON f.id = a.id AND f.token = a.attempt"
                " WHERE f.id IS NULL OR f.cancel_requested"
                # A branch that returns nothing but is always run: the pings go out with the commit.
                " UNION ALL SELECT NULL, NULL, NULL, NULL FROM (SELECT count(pg_notify(%s, p)) AS n"
                "   FROM unnest(%b::text[]) AS p) pinged WHERE pinged.n < 0"
            ), (owners.decode(), document.decode(), channel, pings))
            rows = await cur.fetchall()
        fenced = {(str(r[0]), int(r[1])) for r in rows if r[2]}
        cancelled = {str(r[0]) for r in rows if r[3]}
        return fenced, cancelled

    async def read_streams(
        self, workflow_ids: list[str], keys: list[str], offsets: list[int], limit: int,
    ) -> list[tuple[str | None, bool, list[tuple[int, bytes | None]]]]:
        """For each (workflow, key, offset) asked: up to ``limit`` chunks from the offset on, and when
        there are none, the workflow's status (None when there is no such workflow) and whether the
        stream is closed; all in one query. (With chunks, the status is "running" as far as the reader
        cares: it asks again.)

        Status and chunks come from one snapshot: a workflow seen ended has every chunk it wrote
        visible too, so a reader that finds no chunks and an ended workflow knows the stream is over.
        """
        async with self.pool.connection() as conn:
            cur = await conn.execute(self._sql(
                # Only a read that found nothing needs the workflow's status and whether the stream
                # was closed before its offset (the close marker is always a stream's last chunk):
                # scalar subqueries under CASE, so the others skip both lookups, and the planner
                # cannot turn them into a scan of the whole workflows table.
                "SELECT r.i,"
                " CASE WHEN c.position IS NULL THEN"
                "  (SELECT status FROM {s}.workflows WHERE id = r.workflow_id) END,"
                " CASE WHEN c.position IS NULL THEN coalesce((SELECT value IS NULL FROM {s}.streams"
                "  WHERE workflow_id = r.workflow_id AND key = r.key ORDER BY position DESC LIMIT 1), false)"
                "  ELSE false END,"
                " c.position, c.value"
                " FROM json_to_recordset(%b::json) AS r(i int, workflow_id text, key text, start int)"
                " LEFT JOIN LATERAL (SELECT position, value FROM {s}.streams"
                "   WHERE workflow_id = r.workflow_id AND key = r.key AND position >= r.start"
                "   ORDER BY position LIMIT %s) c ON true"
                " ORDER BY r.i, c.position"
            ), (_ASKS.encode([_Ask(i, *ask) for i, ask in enumerate(zip(workflow_ids, keys, offsets, strict=True), 1)])
                .decode(), limit), binary=True)
            found: list[tuple[str | None, bool, list[tuple[int, bytes | None]]]] = [
                (None, False, []) for _ in workflow_ids
            ]
            for i, status, closed, position, value in await cur.fetchall():
                chunks = found[i - 1][2]
                if position is None:
                    found[i - 1] = (status, bool(closed), chunks)
                else:
                    chunks.append((int(position), value))
                    found[i - 1] = ("running", False, chunks)
            return found
