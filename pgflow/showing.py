"""``pgflow workflows show ID`` for people: one workflow's details as text (``--json`` prints the
WorkflowDetails itself, with its children). The steps table is the journal: step records and the
children the body started, each at the position it took, so no position seems to be missing. Values,
messages and tracebacks are cut to a screenful by default; ``--full`` prints them whole. Everything
stored is escaped for the terminal (see terminal.py)."""

from __future__ import annotations

from typing import Any

from ._core.status import Status
from .records import (
    AttemptError,
    ChildInfo,
    Children,
    ErrorDetails,
    StepDetails,
    Undecodable,
    WorkflowDetails,
    seconds_between,
)
from .terminal import cell, json_text, safe, table

VALUE_CHARS = 300  # of an argument, a result or a message, unless --full
CELL_CHARS = 60  # of a step's outcome in the steps table, unless --full
TRACEBACK_LINES = 40  # the last lines of a traceback (where it was raised), unless --full


def print_details(details: WorkflowDetails, full: bool, children: Children | None = None) -> None:
    record: list[tuple[str, Any]] = [
        ("id", details.id), ("name", details.name), ("queue", details.queue), ("status", details.status),
        ("attempt", f"{details.attempt}" + (f" (at most {details.max_attempts})" if details.max_attempts else "")),
        ("priority", details.priority), ("created_at", details.created_at), ("started_at", details.started_at),
        ("finished_at", details.finished_at), ("duration", _seconds(details.duration_s)),
    ]
    optional = [("due_at", details.due_at), ("waiting_for", details.waiting_for),
                ("parent_id", details.parent_id), ("lease_owner", details.lease_owner),
                ("lease_expires", details.lease_expires_at), ("timeout", _seconds(details.timeout_s)),
                ("deadline_at", details.deadline_at),
                ("cancel", "requested" if details.cancel_requested else None)]
    record += [(name, value) for name, value in optional if value is not None]
    for name, value in record:
        print(f"{name + ':':13} {cell(value)}")
    print(f"{'arguments:':13} {value_text(details.arguments, VALUE_CHARS, full)}")
    if details.status == Status.SUCCEEDED:
        print(f"{'result:':13} {value_text(details.result, VALUE_CHARS, full)}")
    if details.error is not None:
        print(f"{'error:':13} {error_line(details.error, VALUE_CHARS, full)}")
        print("traceback:")
        print_traceback(details.error.traceback, full, indent="  ")
    shown = f" (the first {len(details.steps)} of {details.steps_total})" \
        if details.steps_total > len(details.steps) else ""
    print(f"steps{shown}{_journal_line(children)}:")
    table(_journal_rows(details, children, full),
          ["position", "name", "started_at", "duration_s", "attempts", "outcome"],
          {"duration_s": lambda s: "-" if s is None else f"{s:.3f}", "outcome": str, "name": safe})
    if children is not None and children.total > len(children.children):
        print(f"(the first {len(children.children)} of {children.total} children: --children N shows more)")
    retried = [(step.position, step.name, e) for step in details.steps for e in step.attempt_errors]
    retried += [(step.position, "(not recorded)", e) for step in details.in_progress for e in step.attempt_errors]
    if retried:
        print("errors of retried attempts (the latest kept per step):")
        for position, name, kept in retried:
            print_attempt_error(position, name, kept, full)
    if details.in_progress:
        print("begun, not recorded (running, or cut short):")
        for begun in details.in_progress:
            print(f"  step {begun.position}: {begun.attempts} attempts, the latest run's first started"
                  f" {cell(begun.started_at)}")
    print("streams:")
    table([{"key": s.key, "length": s.length, "closed": s.closed} for s in details.streams],
          ["key", "length", "closed"])
    if not full and _cut_anything(details):
        print("(values, messages and tracebacks were cut: --full prints them whole, --json as data)")


def print_attempt_error(position: int, name: str, kept: AttemptError, full: bool) -> None:
    print(f"  step {position} {safe(name)}, step attempt {kept.step_attempt} of workflow attempt {kept.run}"
          f" at {cell(kept.failed_at)}: {error_line(kept.error, VALUE_CHARS, full)}")
    if full:
        print_traceback(kept.error.traceback, full, indent="      ")


def print_traceback(text: str, full: bool, indent: str) -> None:
    lines = text.rstrip("\n").split("\n") if text else []
    if not lines:
        print(f"{indent}(none recorded)")
        return
    if not full and len(lines) > TRACEBACK_LINES:
        print(f"{indent}[... {len(lines) - TRACEBACK_LINES} lines before these; --full prints them ...]")
        lines = lines[-TRACEBACK_LINES:]
    for line in lines:
        print(indent + safe(line))


def error_line(error: ErrorDetails, at_most: int, full: bool) -> str:
    return f"{safe(error.type)}: {_cut(safe(error.message), at_most, full)}"


def value_text(value: Any, at_most: int, full: bool) -> str:
    """A decoded value as one line of JSON, cut to ``at_most`` characters unless ``full``."""
    if isinstance(value, Undecodable):
        return f"<undecodable, {value.size} bytes: {safe(value.reason)}>"
    return _cut(json_text(value), at_most, full)


def _journal_line(children: Children | None) -> str:
    if children is None or not children.total:
        return ""
    return (f" and children (journal positions 0 to {children.journal_positions - 1}; a child's start"
            " takes a position and writes no step record)")


def _journal_rows(details: WorkflowDetails, children: Children | None, full: bool) -> list[dict[str, Any]]:
    """The step records and the children, by position (children with ids of their own, which take
    none, last). When the steps are cut, so are the children past the last step shown."""
    rows = [_step_row(step, full) for step in details.steps]
    if children is None:
        return rows
    cut = details.steps_total > len(details.steps)
    last = details.steps[-1].position if details.steps else -1
    rows += [_child_row(child) for child in children.children
             if not cut or (child.position is not None and child.position < last)]
    return sorted(rows, key=lambda row: (row["position"] is None, row["position"] or 0))


def _child_row(child: ChildInfo) -> dict[str, Any]:
    outcome = f"child {safe(child.id)}: {child.status}" + (f" ({safe(child.error_type)})" if child.error_type else "")
    return {"position": child.position, "name": child.name, "started_at": child.started_at,
            "duration_s": seconds_between(child.started_at, child.finished_at), "attempts": child.attempt,
            "outcome": outcome}


def _step_row(step: StepDetails, full: bool) -> dict[str, Any]:
    if step.error is not None:
        outcome = error_line(step.error, CELL_CHARS, full)
    elif step.wake_at is not None:
        outcome = f"{'waits for a message until' if step.waiting else 'wakes at'} {cell(step.wake_at)}"
    else:
        outcome = value_text(step.output, CELL_CHARS, full)
    return {"position": step.position, "name": step.name, "started_at": step.started_at,
            "duration_s": step.duration_s, "attempts": step.attempts, "outcome": outcome}


def _cut(text: str, at_most: int, full: bool) -> str:
    if full or len(text) <= at_most:
        return text
    return f"{text[:at_most]}... ({len(text) - at_most} more characters)"


def _cut_anything(details: WorkflowDetails) -> bool:
    def long(value: Any, at_most: int) -> bool:
        return not isinstance(value, Undecodable) and len(json_text(value)) > at_most

    errors = [details.error, *(s.error for s in details.steps)]
    return (long(details.arguments, VALUE_CHARS) or long(details.result, VALUE_CHARS)
            or any(long(s.output, CELL_CHARS) for s in details.steps)
            or any(e is not None and (len(e.message) > VALUE_CHARS or e.traceback.count("\n") > TRACEBACK_LINES)
                   for e in errors)
            or any(s.attempt_errors for s in details.steps) or any(s.attempt_errors for s in details.in_progress))


def _seconds(value: float | None) -> str | None:
    return None if value is None else f"{value:.3f} s"
