"""The SQL of what is kept for the people who look at a workflow afterwards (``pgflow workflows show``,
the dashboard): every failed attempt's error, and one workflow read in full."""

from __future__ import annotations

from datetime import datetime
from typing import Any, NamedTuple

import msgspec
from psycopg.types.json import Jsonb

from .database import SNAPSHOT, Port, Sql
from .fencing import OWNER, Fence, Owned
from .statement import Id

KEEP_ATTEMPT_ERRORS = 10  # per step: the latest ones (a step retried 1000 times keeps 10 rows)

class WorkflowRead(NamedTuple):
    """A workflow's row as ``WORKFLOW`` reads it (the statement's column names are these fields')."""

    id: str
    name: str
    queue: str
    status: str
    attempt: int  # as pgflow.attempt() counts it
    priority: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    due_at: datetime | None  # while queued
    waiting_for: str | None  # while queued
    parent_id: str | None
    lease_owner: str | None
    lease_expires_at: datetime | None
    cancel_requested: bool
    max_attempts: int | None
    timeout: float | None
    deadline_at: datetime | None
    inputs: bytes
    output: bytes | None
    error: dict[str, Any] | None


class StepRead(NamedTuple):
    position: int
    name: str
    started_at: datetime | None
    finished_at: datetime
    attempts: int
    output: bytes | None
    error: dict[str, Any] | None
    wake_at: datetime | None
    waiting: bool


class AttemptErrorRead(NamedTuple):
    position: int
    run: int
    step_attempt: int
    failed_at: datetime
    error: dict[str, Any]


class BegunRead(NamedTuple):
    """A step begun and not recorded: its tries, and when the latest execution's note was made."""

    position: int
    tries: int | None
    started_at: datetime | None


class StreamRead(NamedTuple):
    key: str
    chunks: int
    closed: bool


class DetailsRead(NamedTuple):
    """One workflow read from one snapshot (``Details.details``)."""

    workflow: WorkflowRead
    steps: list[StepRead]  # the first ``steps_limit``
    steps_total: int
    attempt_errors: list[AttemptErrorRead]
    begun: list[BegunRead]
    streams: list[StreamRead]


_EXPRESSIONS = {"attempt": "attempt - attempt_base", "due_at": "CASE WHEN status = 'queued' THEN due_at END",
                "waiting_for": "CASE WHEN status = 'queued' THEN waiting_for END"}
_ROW = ", ".join(f"{_EXPRESSIONS[f]} AS {f}" if f in _EXPRESSIONS else f for f in WorkflowRead._fields)

# The statements of one details read, each by a primary key or the streams' (workflow_id, key) index
# (tests/test_cli_show.py checks their generic plans); their parameters are positional, in order, and
# their columns are named as the fields of the records above.
WORKFLOW = f"SELECT {_ROW} FROM {{s}}.workflows WHERE id = %s"  # (id)
STEPS = (f"SELECT {', '.join(StepRead._fields)}"
         " FROM {s}.steps WHERE workflow_id = %s ORDER BY position LIMIT %s")  # (id, limit)
STEP_COUNT = "SELECT count(*) FROM {s}.steps WHERE workflow_id = %s"  # (id)
# The kept errors of the steps listed and of the steps begun and not recorded (always past the steps
# recorded, so a listing cut by its limit would leave them out by position alone).
ATTEMPT_ERRORS = ("SELECT e.position, e.run, e.step_attempt, e.failed_at, e.error FROM {s}.step_errors e"
                  " WHERE e.workflow_id = %s AND (%s OR e.position <= %s OR NOT EXISTS (SELECT FROM {s}.steps s"
                  "  WHERE s.workflow_id = e.workflow_id AND s.position = e.position))"
                  " ORDER BY e.position, e.run, e.step_attempt")  # (id, every step listed, last position listed)
BEGUN = ("SELECT a.position, sum(a.tries)::int AS tries,"
         " (array_agg(a.started_at ORDER BY a.attempt DESC))[1] AS started_at"
         " FROM {s}.step_attempts a WHERE a.workflow_id = %s AND NOT EXISTS (SELECT FROM {s}.steps s"
         "  WHERE s.workflow_id = a.workflow_id AND s.position = a.position)"
         " GROUP BY a.position ORDER BY a.position")  # (id)
# A stream's length from its last chunk (positions are dense), not a count of all of them.
STREAMS = ("SELECT i.key, coalesce(last.position + 1, 0) - CASE WHEN last.closed THEN 1 ELSE 0 END AS chunks,"
           " coalesce(last.closed, false) AS closed FROM {s}.stream_ids i LEFT JOIN LATERAL (SELECT c.position,"
           "  c.value IS NULL AS closed FROM {s}.chunks c WHERE c.stream_id = i.id"
           "  ORDER BY c.position DESC LIMIT 1) last ON true"
           " WHERE i.workflow_id = %s ORDER BY i.key")  # (id)
DETAILS = {"workflow": WORKFLOW, "steps": STEPS, "step_count": STEP_COUNT, "attempt_errors": ATTEMPT_ERRORS,
           "begun": BEGUN, "streams": STREAMS}


class FirstSteps(NamedTuple):
    id: str
    limit: int


class ErrorsOf(NamedTuple):
    id: str
    every: bool  # every step listed
    last: int  # the last position listed


# The statements above, as the executor runs them.
READ_WORKFLOW = Sql(WORKFLOW, row=WorkflowRead, params=Id)
READ_STEPS = Sql(STEPS, row=StepRead, params=FirstSteps)
COUNT_STEPS = Sql(STEP_COUNT, row=tuple[int], params=Id)
READ_ATTEMPT_ERRORS = Sql(ATTEMPT_ERRORS, row=AttemptErrorRead, params=ErrorsOf)
READ_BEGUN, READ_STREAMS = Sql(BEGUN, row=BegunRead, params=Id), Sql(STREAMS, row=StreamRead, params=Id)
# Per journal position not recorded, the step attempts earlier runs began there.
TRIES_BEGUN = Sql("SELECT position, sum(tries)::int FROM {s}.step_attempts WHERE workflow_id = %s GROUP BY position",
                  row=tuple[int, int], params=Id)


# Keeps one retried attempt's error, fenced by the claim, and lets the step's oldest beyond the bound go.
NOTE_ERROR = (
    "WITH " + OWNER + ","
    " noted AS (INSERT INTO {s}.step_errors (workflow_id, position, run, step_attempt, error, failed_at)"
    "  SELECT %(id)s, %(position)s, %(run)s, %(step_attempt)s, %(error)s, {s}.clock_now() FROM owner"
    "  ON CONFLICT (workflow_id, position, run, step_attempt)"
    "  DO UPDATE SET error = excluded.error, failed_at = excluded.failed_at),"
    # (The statement's snapshot does not see the row it inserts: the newest keep - 1 stay.)
    " old AS (DELETE FROM {s}.step_errors WHERE workflow_id = %(id)s AND position = %(position)s"
    "  AND EXISTS (SELECT FROM owner) AND (run, step_attempt) IN (SELECT run, step_attempt"
    "   FROM {s}.step_errors WHERE workflow_id = %(id)s AND position = %(position)s"
    "   ORDER BY run DESC, step_attempt DESC OFFSET %(keep)s))"
    " SELECT (SELECT cancel_requested FROM owner)"
)


class NotingError(Owned):
    position: int
    run: int
    step_attempt: int
    error: Jsonb
    keep: int  # the step's newest errors kept besides this one


NOTING_ERROR = Sql(NOTE_ERROR, row=tuple[bool | None], params=NotingError)  # (as the executor runs it)


class Details(Port):
    async def note_step_error(self, workflow_id: str, lease_token: int, position: int, run: int,
                              step_attempt: int, error: dict[str, Any]) -> Fence:
        """Keep the error of a step attempt that is retried, for the execution holding
        ``lease_token`` (fenced: one that lost it writes nothing). The step's oldest rows beyond
        KEEP_ATTEMPT_ERRORS go in the same statement."""
        row = await self.db.row(NOTING_ERROR, id=workflow_id, lease=lease_token, position=position, run=run,
                                step_attempt=step_attempt,
                                error=Jsonb(error, dumps=lambda v: msgspec.json.encode(v).decode()),
                                keep=KEEP_ATTEMPT_ERRORS - 1)
        assert row is not None
        return Fence(row[0] is not None, bool(row[0]))

    async def tries_begun(self, workflow_id: str) -> dict[int, int]:
        """Per journal position not recorded, the step attempts that earlier runs began there (their
        notes): a run that calls the step again counts its tries on from these."""
        return dict(await self.db.rows(TRIES_BEGUN, workflow_id))

    async def details(self, workflow_id: str, steps_limit: int) -> DetailsRead | None:
        """One workflow from one snapshot: its row, its first ``steps_limit`` step records, how many
        it has in all, the kept errors of their failed attempts, the steps begun and not recorded,
        and its streams. None: no such workflow. Every read goes by the primary key of its table, or
        the streams' (workflow_id, key) index."""
        async with self.db.session() as s, s.transaction():
            await s.run(SNAPSHOT)
            workflow = await s.row(READ_WORKFLOW, workflow_id)
            if workflow is None:
                return None
            steps = await s.rows(READ_STEPS, workflow_id, steps_limit)
            total = len(steps)
            if total == steps_limit:
                counted = await s.row(COUNT_STEPS, workflow_id)
                total = counted[0] if counted else total
            listed_all, last = total == len(steps), steps[-1].position if steps else -1
            return DetailsRead(workflow, steps, total, await s.rows(READ_ATTEMPT_ERRORS, workflow_id, listed_all, last),
                               await s.rows(READ_BEGUN, workflow_id), await s.rows(READ_STREAMS, workflow_id))
