"""A workflow's journal: the steps it recorded, the attempts it started, read back on every resume.

Writes made on behalf of an execution carry its claim's lease token and only touch a row still held by
that token (fencing), so a worker that lost its lease cannot overwrite the work of the one that took over.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, NamedTuple

import msgspec
from psycopg.types.json import Jsonb

from .database import Port, Sql
from .fencing import OWNER_LOCKED, Fence, Journaled, StepStart, held
from .statement import ById


@dataclass(frozen=True, slots=True)
class StepRecord:
    position: int
    name: str
    output: bytes | None
    error: dict[str, Any] | None
    stream_ends: dict[str, int] | None
    wake_at: datetime | None = None  # a sleep's wake-up time
    remaining: float | None = None  # seconds until wake_at when the journal was read
    waiting: bool = False  # a receive that has no message yet (wake_at is its deadline)



# A journal's records, their columns in StepRecord's order (``journal_of`` builds them by position),
# and one more row (its name NULL) holding the highest position from which the body started a child: a
# child's id is its parent's, a dot and the position (and for start_many a dot and its index), so a run
# that started one there reached that position without a record.
_RECORD_COLUMNS = {"remaining": "extract(epoch FROM wake_at - {s}.clock_now())::float8"}
JOURNAL = (
    f"SELECT {', '.join(_RECORD_COLUMNS.get(f.name, f.name) for f in fields(StepRecord))}"
    " FROM {s}.steps WHERE workflow_id = %(id)s"
    " UNION ALL SELECT max(split_part(substr(id, length(%(id)s) + 2), '.', 1)::int), NULL, NULL, NULL, NULL,"
    "  NULL, NULL, false FROM {s}.workflows WHERE parent_id = %(id)s"
    "  AND left(id, length(%(id)s) + 1) = %(id)s || '.'"
    "  AND substr(id, length(%(id)s) + 2) ~ '^[0-9]{1,9}([.][0-9]+)?$'"
)


class JournalRow(NamedTuple):
    """A row of ``JOURNAL``: a record (StepRecord's fields), or the children's row (``name`` None)."""

    position: int | None
    name: str | None
    output: bytes | None
    error: dict[str, Any] | None
    stream_ends: dict[str, int] | None
    wake_at: datetime | None
    remaining: float | None
    waiting: bool


READ_JOURNAL = Sql(JOURNAL, row=JournalRow, params=ById)  # (as the executor runs it)


class StepStarts(NamedTuple):
    """Per note (``StepStart``): the workflow, its claim's number and token, the step's position and the
    attempt begun."""

    ids: list[str]
    attempts: list[int]
    leases: list[int]
    positions: list[int]
    tries: list[int]


# The notes of step attempts begun (``Journal.start_steps``), each fenced by its claim, and whether a
# cancellation was asked for each note's workflow (NULL: its claim no longer holds it).
START_STEPS = Sql(
    "WITH asked AS (SELECT * FROM unnest(%s::text[], %s::int[], %s::int8[], %s::int[], %s::int[])"
    "   WITH ORDINALITY AS a(id, attempt, lease, position, tries, n)),"
    " " + held("owner", "asked", "a.*, w.cancel_requested") + ","
    " lazy AS (SELECT set_config('synchronous_commit', 'off', true)),"
    # (started_at on the schema's clock, as the step's finished_at is: see 0019_clock.sql)
    " noted AS (INSERT INTO {s}.step_attempts (workflow_id, position, attempt, tries, started_at)"
    "  SELECT DISTINCT ON (id, position, attempt) id, position, attempt, tries, {s}.clock_now()"
    "  FROM owner, lazy"
    "  ORDER BY id, position, attempt, tries DESC"
    "  ON CONFLICT (workflow_id, position, attempt)"
    "  DO UPDATE SET tries = greatest(step_attempts.tries, excluded.tries))"
    " SELECT a.n, o.cancel_requested FROM asked a LEFT JOIN owner o ON o.n = a.n ORDER BY a.n",
    row=tuple[int, bool | None], params=StepStarts)


class RecordStep(Journaled):
    output: bytes | None
    error: Jsonb | None
    attempts: int
    stream_ends: Jsonb | None


# A finished step recorded for the execution that holds its claim (``Journal.record_step``).
RECORD_STEP = Sql(
    "WITH " + OWNER_LOCKED + ","
    # The attempts every execution started, this one's included: the record counts them all.
    " started AS (DELETE FROM {s}.step_attempts WHERE workflow_id = %(id)s AND position = %(position)s"
    "  AND EXISTS (SELECT FROM owner) RETURNING tries, attempt, started_at),"
    # Its start: this execution's first attempt's (the duration a reader sees is this run's).
    " written AS (INSERT INTO {s}.steps"
    "  (workflow_id, position, name, output, error, attempts, attempt, stream_ends, started_at)"
    "  SELECT %(id)s, %(position)s, %(name)s, %(output)s, %(error)s,"
    "   greatest(%(attempts)s, (SELECT sum(tries) FROM started))::int, %(attempt)s, %(stream_ends)s,"
    "   coalesce((SELECT started_at FROM started WHERE attempt = %(attempt)s),"
    "    (SELECT max(started_at) FROM started))"
    "  FROM owner ON CONFLICT (workflow_id, position) DO NOTHING RETURNING 1)"
    " SELECT (SELECT cancel_requested FROM owner), (SELECT count(*) FROM written)",
    row=tuple[bool | None, int], params=RecordStep)


def journal_of(rows: Sequence[JournalRow]) -> tuple[dict[int, StepRecord], int]:
    """``JOURNAL``'s rows as the records by position, and the horizon."""
    journal = {r.position: StepRecord(r.position, r.name, r.output, r.error, r.stream_ends, r.wake_at, r.remaining,
                                      r.waiting)
               for r in rows if r.name is not None and r.position is not None}
    children = max((r.position for r in rows if r.name is None and r.position is not None), default=-1)
    return journal, max(children, max(journal, default=-1))


class Journal(Port):
    """The port that reads a workflow's journal and records its steps' starts and ends."""

    async def journal(self, workflow_id: str) -> tuple[dict[int, StepRecord], int]:
        """The journal of a workflow, and its horizon: the highest position an earlier run reached,
        by a record or by a child it started from that position (``<id>.<position>[.<n>]``), -1
        when none; one round trip."""
        return journal_of(await self.db.rows(READ_JOURNAL, id=workflow_id))

    async def start_steps(self, notes: Sequence[StepStart]) -> list[Fence]:
        """Note, for each start, that the execution holding its claim token starts that attempt of
        the step, before the step runs, so an attempt cut short by a crash still counts.

        Idempotent (a row keeps the highest count), and not waiting for the disk: a worker's crash
        loses nothing, and only a server crash before the step's record could forget an attempt
        that the crash itself cut short."""
        ids, attempts, leases, positions, tries = map(list, zip(*notes, strict=True))
        rows = await self.db.rows(START_STEPS, ids, attempts, leases, positions, tries)
        return [Fence(cancel is not None, bool(cancel)) for _, cancel in rows]

    async def record_step(
        self, workflow_id: str, attempt: int, lease_token: int, position: int, name: str, output: bytes | None,
        error: dict[str, Any] | None, attempts: int, stream_ends: dict[str, int] | None = None,
    ) -> Fence:
        """Record a finished step for the execution holding ``attempt`` under ``lease_token``.

        The workflow row is share-locked for the insert, so a takeover cannot slip in between the
        fencing check and the write.
        """
        row = await self.db.row(RECORD_STEP, id=workflow_id, attempt=attempt, lease=lease_token, position=position,
                                name=name, output=output, error=_jsonb(error), attempts=attempts,
                                stream_ends=_jsonb(stream_ends or None))
        assert row is not None
        return Fence(row[0] is not None, bool(row[0]))


def _jsonb(value: dict[str, Any] | None) -> Jsonb | None:
    return None if value is None else Jsonb(value, dumps=lambda v: msgspec.json.encode(v).decode())
