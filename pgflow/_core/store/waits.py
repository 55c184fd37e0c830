"""The SQL of waiting workflows: journaled wake-up times, and giving a waiting workflow's slot back."""

from __future__ import annotations

from datetime import datetime

from .statements import Statements


class WaitStatements(Statements):
    """The statements of ``Store`` for sleeps and suspensions (the pool and schema come from it)."""

    async def record_wake(self, workflow_id: str, attempt: int, position: int, name: str,
                          seconds: float) -> tuple[bool, bool, float, datetime]:
        """Journal a wake-up ``seconds`` from now, on the server's clock, for the execution holding
        ``attempt``. Returns (still owner, cancel requested, seconds left, the wake-up time)."""
        row = await self._fetchone(
            "WITH owner AS (SELECT cancel_requested FROM {s}.workflows"
            "  WHERE id = %(id)s AND attempt = %(attempt)s AND status = 'running' FOR SHARE),"
            " written AS (INSERT INTO {s}.steps (workflow_id, position, name, attempts, attempt, wake_at)"
            "  SELECT %(id)s, %(position)s, %(name)s, 1, %(attempt)s,"
            "   now() + make_interval(secs => %(seconds)s) FROM owner"
            "  ON CONFLICT (workflow_id, position) DO NOTHING RETURNING wake_at),"
            " wake AS (SELECT wake_at FROM written UNION ALL SELECT wake_at FROM {s}.steps"
            "  WHERE workflow_id = %(id)s AND position = %(position)s AND NOT EXISTS (SELECT FROM written))"
            " SELECT (SELECT cancel_requested FROM owner), w.wake_at, extract(epoch FROM w.wake_at - now())::float8"
            " FROM (SELECT 1) AS one LEFT JOIN wake w ON true",
            {"id": workflow_id, "attempt": attempt, "position": position, "name": name, "seconds": seconds},
        )
        assert row is not None
        owner = row[0] is not None and row[1] is not None
        return owner, bool(row[0]), float(row[2] or 0.0), row[1]

    async def suspend(self, workflow_id: str, attempt: int, until: datetime) -> tuple[str, str] | None:
        """Give a running workflow's slot back until ``until``: queued again, due then, its lease
        released; its next claim does not count against its attempt budget (``attempt_base`` moves
        with it). A cancellation asked for meanwhile ends it as cancelled instead. Returns (queue,
        status now), or None when ``attempt`` no longer holds the workflow."""
        row = await self._fetchone(
            "UPDATE {s}.workflows SET"
            " status = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'queued' END,"
            " finished_at = CASE WHEN cancel_requested THEN now() END,"
            " due_at = %s, attempt_base = attempt_base + 1, lease_owner = NULL, lease_expires_at = NULL"
            " WHERE id = %s AND attempt = %s AND status = 'running' RETURNING queue, status",
            (until, workflow_id, attempt),
        )
        return None if row is None else (str(row[0]), str(row[1]))

    async def set_event(self, workflow_id: str, attempt: int, position: int, name: str, key: str,
                        value: bytes) -> tuple[bool, bool]:
        """Publish ``value`` under ``key`` for the execution holding ``attempt``, and journal it at
        ``position`` in the same statement (a position already journaled publishes nothing).
        Returns (still owner, cancel requested)."""
        row = await self._fetchone(
            "WITH owner AS (SELECT cancel_requested FROM {s}.workflows"
            "  WHERE id = %(id)s AND attempt = %(attempt)s AND status = 'running' FOR SHARE),"
            " written AS (INSERT INTO {s}.steps (workflow_id, position, name, output, attempts, attempt)"
            "  SELECT %(id)s, %(position)s, %(name)s, %(value)s, 1, %(attempt)s FROM owner"
            "  ON CONFLICT (workflow_id, position) DO NOTHING RETURNING 1),"
            " published AS (INSERT INTO {s}.events (workflow_id, key, value)"
            "  SELECT %(id)s, %(key)s, %(value)s FROM written"
            "  ON CONFLICT (workflow_id, key) DO UPDATE SET value = excluded.value, set_at = now() RETURNING 1)"
            " SELECT (SELECT cancel_requested FROM owner), (SELECT count(*) FROM published)",
            {"id": workflow_id, "attempt": attempt, "position": position, "name": name, "key": key,
             "value": value},
        )
        assert row is not None
        return row[0] is not None, bool(row[0])

    async def get_event(self, workflow_id: str, key: str) -> tuple[bytes | None, str] | None:
        """(the value under ``key`` or None, the workflow's status); None: no such workflow."""
        row = await self._fetchone(
            "SELECT e.value, w.status FROM {s}.workflows w"
            " LEFT JOIN {s}.events e ON e.workflow_id = w.id AND e.key = %s WHERE w.id = %s",
            (key, workflow_id),
        )
        return None if row is None else (row[0], str(row[1]))
