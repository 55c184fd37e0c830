"""The SQL of ``pgflow.testing``: moving the schema's clock, and reading what a test asserts on.

Nothing in a worker or a caller runs these; production never pays for them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime
from typing import NamedTuple, TypedDict

from .database import Port, Sql
from .statement import Id

# Seconds the schema's clock is ahead of the server's.
CLOCK_OFFSET = Sql("SELECT extract(epoch FROM {s}.clock_now() - now())::float8", row=tuple[float])


class Serving(TypedDict):
    queues: list[str]
    names: list[str]


class Activity(NamedTuple):
    """What a worker serving some queues and names has to do (``ACTIVITY``)."""

    due: int  # workflows due now
    running: list[str]  # the running ones' ids
    next_due: float | None  # seconds until the next queued one falls due


class Message(NamedTuple):
    topic: str
    value: bytes
    sent_at: datetime
    consumed_at: datetime | None


class StreamOf(NamedTuple):
    workflow_id: str
    key: str

# What a worker serving some queues and names has to do: how many workflows are due now, the ids of
# the running ones, and the seconds until the next queued one falls due.
ACTIVITY = Sql(
    "SELECT (SELECT count(*) FROM {s}.workflows WHERE status = 'queued' AND due_at <= {s}.clock_now()"
    "   AND queue = ANY(%(queues)s) AND name = ANY(%(names)s)),"
    " ARRAY(SELECT id FROM {s}.workflows WHERE status = 'running' ORDER BY id),"
    " (SELECT extract(epoch FROM min(due_at) - {s}.clock_now())::float8 FROM {s}.workflows"
    "   WHERE status = 'queued' AND due_at > {s}.clock_now() AND queue = ANY(%(queues)s)"
    "   AND name = ANY(%(names)s))", row=Activity, params=Serving)
# What a test asserts on: a workflow's events (each key's last value), the messages sent to it, and
# the chunks a stream of it holds now.
EVENTS_OF = Sql("SELECT key, value FROM {s}.events WHERE workflow_id = %s ORDER BY key", row=tuple[str, bytes],
                params=Id)
MESSAGES_OF = Sql("SELECT topic, value, sent_at, consumed_at FROM {s}.messages WHERE workflow_id = %s ORDER BY id",
                  row=Message, params=Id)
CHUNKS_OF = Sql(
    "SELECT c.value FROM {s}.stream_ids i JOIN {s}.chunks c ON c.stream_id = i.id"
    " WHERE i.workflow_id = %s AND i.key = %s ORDER BY c.position", row=tuple[bytes | None], params=StreamOf)


class Testing(Port):
    """The port of ``pgflow.testing``: a test's clock and the reads its assertions make."""

    async def set_clock(self, offset: float) -> None:
        """Make ``<schema>.clock_now()`` the server's ``now()`` plus ``offset`` seconds (migration 0019
        made it ``now()``). The body is replaced, not a row read by it: the function stays one
        expression the planner inlines, and plans that inlined the old body are invalidated."""
        if not (isinstance(offset, float | int) and math.isfinite(offset) and offset >= 0):
            raise ValueError(f"the clock's offset is a finite number of seconds >= 0, got {offset!r}")
        body = "SELECT pg_catalog.now()" if offset == 0 else (
            f"SELECT pg_catalog.now() + ''{float(offset):.6f} seconds''::pg_catalog.interval")
        # (A statement of its own for each offset: a function's body is no parameter.)
        await self.db.run(Sql("CREATE OR REPLACE FUNCTION {s}.clock_now() RETURNS timestamptz"
                              f" LANGUAGE sql STABLE PARALLEL SAFE AS '{body}'", row=None))

    async def clock_offset(self) -> float:
        """Seconds the schema's clock is ahead of the server's."""
        row = await self.db.row(CLOCK_OFFSET)
        assert row is not None
        return row[0]

    async def activity(self, queues: Sequence[str], names: Sequence[str]) -> tuple[int, list[str], float | None]:
        """What a worker serving ``queues`` and ``names`` has to do: how many workflows are due now,
        the ids of the running ones, and the seconds until the next queued one falls due."""
        row = await self.db.row(ACTIVITY, queues=list(queues), names=list(names))
        assert row is not None
        return row.due, row.running, row.next_due

    async def events_of(self, workflow_id: str) -> list[tuple[str, bytes]]:
        """The events a workflow has set (the last value of each key), by key."""
        return await self.db.rows(EVENTS_OF, workflow_id)

    async def messages_of(self, workflow_id: str) -> list[Message]:
        """The messages sent to a workflow, oldest first: (topic, value, sent_at, consumed_at)."""
        return await self.db.rows(MESSAGES_OF, workflow_id)

    async def chunks_of(self, workflow_id: str, key: str) -> tuple[list[bytes], bool]:
        """Every chunk a stream holds now, in order, and whether it is closed; no wait."""
        values = [value for value, in await self.db.rows(CHUNKS_OF, workflow_id, key)]
        closed = bool(values) and values[-1] is None
        return [bytes(v) for v in values if v is not None], closed
