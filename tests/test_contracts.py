"""The contracts between pgflow's layers, with no server: the statuses the schema allows are the
Status enum's, the light record's fields are the store's columns, and the records the layers hand
each other name their fields."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import msgspec

import pgflow
from pgflow._core.engine import Fence, Fenced, StepStart
from pgflow._core.engine.management import RECORD, RECORD_COLUMNS, RECORD_FIELDS, STEP_FIELDS
from pgflow._core.outcomes import CANCELLED, Outcome
from pgflow._core.signals import End, News, payload
from pgflow._core.status import ENDED, STATUSES, UNFINISHED, Status
from pgflow.operations import STATUSES as PUBLIC_STATUSES
from pgflow.records import StepInfo, WorkflowRecord

PACKAGE = Path(pgflow.__file__).parent


def test_the_statuses_are_the_ones_the_schema_allows() -> None:
    core = (PACKAGE / "_core" / "engine" / "sql" / "0001_core.sql").read_text()
    allowed = re.search(r"CHECK \(status IN \(([^)]*)\)\)", core)
    assert allowed is not None
    assert [s.strip().strip("'") for s in allowed.group(1).split(",")] == [s.value for s in Status]
    assert set(ENDED) | set(UNFINISHED) == set(STATUSES) and not set(ENDED) & set(UNFINISHED)


def test_what_users_see_of_a_status_is_a_plain_string() -> None:
    assert PUBLIC_STATUSES == ("queued", "running", "succeeded", "failed", "cancelled")
    assert all(type(s) is str for s in PUBLIC_STATUSES)
    assert Status.QUEUED == "queued" and f"{Status.FAILED}" == "failed" and str(Status.RUNNING) == "running"
    # A carried end goes out as the plain string, and comes back as one.
    end = End("w", 1, 1, "wf", Status.SUCCEEDED.value, None, None)
    back = payload.decode(payload.plaintexts(News(ends=[end]))[0])
    assert back is not None and type(back.ends[0].status) is str and back.ends[0] == end
    assert msgspec.json.encode(Status.CANCELLED) == b'"cancelled"'


def test_the_light_record_is_built_from_the_columns_that_name_its_fields() -> None:
    assert tuple(f.name for f in dataclasses.fields(WorkflowRecord)) == RECORD_FIELDS
    assert RECORD == ", ".join(column for _, column in RECORD_COLUMNS)
    row = tuple(f"v{n}" for n in range(len(RECORD_FIELDS)))
    record = WorkflowRecord.of(row)
    assert [getattr(record, name) for name in RECORD_FIELDS] == list(row)
    assert tuple(f.name for f in dataclasses.fields(StepInfo)) == STEP_FIELDS


def test_the_records_between_layers_name_their_fields() -> None:
    outcome = Outcome.failed(ValueError("no"))
    assert outcome.status == Status.FAILED and outcome.output is None and outcome.error is not None
    assert outcome.error["type"] == "ValueError"
    assert CANCELLED == ("cancelled", None, None)
    assert Fence(True, False).with_value(3) == Fenced(owner=True, cancel=False, value=3)
    start = StepStart("w", 2, 99, 0, 1)
    assert (start.workflow_id, start.attempt, start.lease_token, start.position, start.step_attempt) == (
        "w", 2, 99, 0, 1)


def test_every_error_pgflow_exports_is_a_pgflow_error() -> None:
    """One ``except pgflow.PgflowError`` catches whatever pgflow raises on purpose."""
    exported = [getattr(pgflow, name) for name in pgflow.__all__]
    errors = [e for e in exported if isinstance(e, type) and issubclass(e, BaseException)]
    assert pgflow.EmbeddedUnavailable in errors
    assert [e.__name__ for e in errors if not issubclass(e, pgflow.PgflowError)] == []
