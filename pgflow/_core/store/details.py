"""The SQL of what is kept for the people who look at a workflow afterwards (``pgflow workflows show``,
the dashboard): every failed attempt's error, and one workflow read in full."""

from __future__ import annotations

from typing import Any

import msgspec
from psycopg.types.json import Jsonb

from .statements import Statements

KEEP_ATTEMPT_ERRORS = 10  # per step: the latest ones (a step retried 1000 times keeps 10 rows)

_ROW = ("id, name, queue, status, attempt - attempt_base, priority, created_at, started_at, finished_at,"
        " CASE WHEN status = 'queued' THEN due_at END, CASE WHEN status = 'queued' THEN waiting_for END,"
        " parent_id, lease_owner, lease_expires_at, cancel_requested, max_attempts, timeout, deadline_at,"
        " inputs, output, error")

# The statements of one details read, each by a primary key or the streams' (workflow_id, key) index
# (tests/test_cli_show.py checks their generic plans); their parameters are positional, in order.
WORKFLOW = f"SELECT {_ROW} FROM {{s}}.workflows WHERE id = %s"  # (id)
STEPS = ("SELECT position, name, started_at, finished_at, attempts, output, error, wake_at, waiting"
         " FROM {s}.steps WHERE workflow_id = %s ORDER BY position LIMIT %s")  # (id, limit)
STEP_COUNT = "SELECT count(*) FROM {s}.steps WHERE workflow_id = %s"  # (id)
ATTEMPT_ERRORS = ("SELECT position, run, step_attempt, failed_at, error FROM {s}.step_errors"
                  " WHERE workflow_id = %s AND (%s OR position <= %s)"
                  " ORDER BY position, run, step_attempt")  # (id, every step listed, last position listed)
BEGUN = ("SELECT a.position, sum(a.tries)::int, (array_agg(a.started_at ORDER BY a.attempt DESC))[1]"
         " FROM {s}.step_attempts a WHERE a.workflow_id = %s AND NOT EXISTS (SELECT FROM {s}.steps s"
         "  WHERE s.workflow_id = a.workflow_id AND s.position = a.position)"
         " GROUP BY a.position ORDER BY a.position")  # (id)
# A stream's length from its last chunk (positions are dense), not a count of all of them.
STREAMS = ("SELECT i.key, coalesce(last.position + 1, 0) - CASE WHEN last.closed THEN 1 ELSE 0 END,"
           " coalesce(last.closed, false) FROM {s}.stream_ids i LEFT JOIN LATERAL (SELECT c.position,"
           "  c.value IS NULL AS closed FROM {s}.chunks c WHERE c.stream_id = i.id"
           "  ORDER BY c.position DESC LIMIT 1) last ON true"
           " WHERE i.workflow_id = %s ORDER BY i.key")  # (id)
DETAILS = {"workflow": WORKFLOW, "steps": STEPS, "step_count": STEP_COUNT, "attempt_errors": ATTEMPT_ERRORS,
           "begun": BEGUN, "streams": STREAMS}


# Keeps one retried attempt's error, fenced by the claim, and lets the step's oldest beyond the bound go.
NOTE_ERROR = (
    "WITH owner AS (SELECT cancel_requested FROM {s}.workflows"
    "  WHERE id = %(id)s AND lease_token = %(lease)s AND status = 'running'),"
    " noted AS (INSERT INTO {s}.step_errors (workflow_id, position, run, step_attempt, error, failed_at)"
    "  SELECT %(id)s, %(position)s, %(run)s, %(try)s, %(error)s, {s}.clock_now() FROM owner"
    "  ON CONFLICT (workflow_id, position, run, step_attempt)"
    "  DO UPDATE SET error = excluded.error, failed_at = excluded.failed_at),"
    # (The statement's snapshot does not see the row it inserts: the newest keep - 1 stay.)
    " old AS (DELETE FROM {s}.step_errors WHERE workflow_id = %(id)s AND position = %(position)s"
    "  AND EXISTS (SELECT FROM owner) AND (run, step_attempt) IN (SELECT run, step_attempt"
    "   FROM {s}.step_errors WHERE workflow_id = %(id)s AND position = %(position)s"
    "   ORDER BY run DESC, step_attempt DESC OFFSET %(keep)s))"
    " SELECT (SELECT cancel_requested FROM owner)"
)


class DetailStatements(Statements):
    async def note_step_error(self, workflow_id: str, lease: int, position: int, run: int, step_attempt: int,
                              error: dict[str, Any]) -> tuple[bool, bool]:
        """Keep the error of a step attempt that is retried, for the execution holding the claim
        ``lease`` (fenced: one that lost it writes nothing). The step's oldest rows beyond
        KEEP_ATTEMPT_ERRORS go in the same statement. Returns (still owner, cancel requested)."""
        row = await self._fetchone(
            NOTE_ERROR,
            {"id": workflow_id, "lease": lease, "position": position, "run": run, "try": step_attempt,
             "error": Jsonb(error, dumps=lambda v: msgspec.json.encode(v).decode()),
             "keep": KEEP_ATTEMPT_ERRORS - 1},
        )
        assert row is not None
        return row[0] is not None, bool(row[0])

    async def details(self, workflow_id: str, steps_limit: int) -> tuple[
            tuple[Any, ...], list[tuple[Any, ...]], int, list[tuple[Any, ...]], list[tuple[Any, ...]],
            list[tuple[str, int, bool]]] | None:
        """One workflow from one snapshot: its row (``_ROW``), its first ``steps_limit`` step records
        (position, name, started_at, finished_at, attempts, output, error, wake_at, waiting), how many
        it has in all, the kept errors of their failed attempts (position, run, step attempt, failed
        at, error), the steps begun and not recorded (position, tries, started_at of the latest
        execution's note), and its streams (key, chunks, closed). None: no such workflow. Every read
        goes by the primary key of its table, or the streams' (workflow_id, key) index."""
        async with self.pool.connection() as conn, conn.transaction():
            await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            cur = await conn.execute(self._sql(WORKFLOW), (workflow_id,))
            record = await cur.fetchone()
            if record is None:
                return None
            cur = await conn.execute(self._sql(STEPS), (workflow_id, steps_limit))
            steps = list(await cur.fetchall())
            total = len(steps)
            if total == steps_limit:
                cur = await conn.execute(self._sql(STEP_COUNT), (workflow_id,))
                counted = await cur.fetchone()
                total = int(counted[0]) if counted else total
            # The kept errors of the steps listed, and of the steps begun and not recorded yet.
            listed_all, last = total == len(steps), steps[-1][0] if steps else -1
            cur = await conn.execute(self._sql(ATTEMPT_ERRORS), (workflow_id, listed_all, last))
            errors = list(await cur.fetchall())
            cur = await conn.execute(self._sql(BEGUN), (workflow_id,))
            begun = list(await cur.fetchall())
            cur = await conn.execute(self._sql(STREAMS), (workflow_id,))
            streams = [(str(k), int(n), bool(c)) for k, n, c in await cur.fetchall()]
            return tuple(record), steps, total, errors, begun, streams
