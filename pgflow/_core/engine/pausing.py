"""The SQL of pausing queues: a row in ``paused_queues`` per paused queue, which the claims read
(``claims.py``: a paused queue's workflows are not claimed)."""

from __future__ import annotations

from datetime import datetime
from typing import NamedTuple, TypedDict

from .database import Port, Sql


class OfQueue(TypedDict):
    name: str


class Queue(NamedTuple):
    name: str


# A queue paused (again: nothing changes), and since when it is.
PAUSE = Sql(
    "WITH added AS (INSERT INTO {s}.paused_queues (name) VALUES (%(name)s)"
    "  ON CONFLICT (name) DO NOTHING RETURNING paused_at)"
    " SELECT paused_at FROM added UNION ALL SELECT paused_at FROM {s}.paused_queues WHERE name = %(name)s"
    " LIMIT 1", row=tuple[datetime], params=OfQueue)
# A queue resumed (its name back: it was paused); every paused queue.
RESUME = Sql("DELETE FROM {s}.paused_queues WHERE name = %s RETURNING name", row=tuple[str], params=Queue)
PAUSED = Sql("SELECT name, paused_at FROM {s}.paused_queues ORDER BY name", row=tuple[str, datetime])
# Whether the fleet knows a queue: work queued or running there, limits, a worker serving it, a pause.
KNOWN = Sql(
    "SELECT EXISTS (SELECT FROM {s}.workflows WHERE queue = %(name)s AND status = 'queued')"
    " OR EXISTS (SELECT FROM {s}.workflows WHERE queue = %(name)s AND status = 'running')"
    " OR EXISTS (SELECT FROM {s}.queues WHERE name = %(name)s)"
    " OR EXISTS (SELECT FROM {s}.workers WHERE %(name)s = ANY(queues))"
    " OR EXISTS (SELECT FROM {s}.paused_queues WHERE name = %(name)s)", row=tuple[bool], params=OfQueue)


class Pausing(Port):
    async def pause_queue(self, name: str) -> datetime:
        """Pause ``name`` (again: nothing changes); since when it is paused."""
        row = await self.db.row(PAUSE, name=name)
        assert row is not None
        return row[0]

    async def resume_queue(self, name: str) -> bool:
        """Resume ``name``; whether it was paused."""
        row = await self.db.row(RESUME, name)
        return row is not None

    async def paused_queues(self) -> dict[str, datetime]:
        """Every paused queue, with since when."""
        return dict(await self.db.rows(PAUSED))

    async def queue_known(self, name: str) -> bool:
        """Whether ``name`` is a queue the fleet knows: one with work queued or running, limits, a
        worker serving it, or paused (a pause of a misspelt name would otherwise stop nothing,
        silently). (Finished work is not asked about: no index finds it by queue.)"""
        row = await self.db.row(KNOWN, name=name)
        return bool(row and row[0])
