"""How a step's or a workflow's outcome is recorded and given back: an exception described in words
PostgreSQL can store (and pickled, so a replay raises the same type), an output decoded as the first
run returned it."""

from __future__ import annotations

import logging
import pickle
import traceback
from typing import Any

from .. import codec
from ..errors import MaxAttemptsExceeded, StepFailed, WorkflowTimeout
from .registry import StepSpec
from .store import Claimed, StepRecord

runs = logging.getLogger("pgflow.workflows")  # one line per workflow start and end

# A workflow's recorded end: (status, output, error).
Outcome = tuple[str, bytes | None, dict[str, Any] | None]


def _storable(text: str) -> str:
    """Text PostgreSQL can hold in jsonb: NUL and lone surrogates (which a user's exception message
    may carry) are spelled out instead of failing the write that records the failure."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")


def describe(exc: BaseException) -> dict[str, Any]:
    """The recorded form of an exception: what a reader in another process needs to understand it."""
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return {
        "type": _storable(name),
        "message": _storable(str(exc)),
        "traceback": _storable("".join(traceback.format_exception(exc))),
    }


def pickled(exc: BaseException) -> bytes | None:
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
    except Exception:  # noqa: BLE001 - many exceptions do not survive pickling; fall back to StepFailed
        return None
    return data


def replay(record: StepRecord, step: StepSpec) -> Any:
    """The recorded outcome of a step: its output, or its exception raised again."""
    if record.error is None:
        return codec.decode(record.output or b"\xc0", step.return_type)
    if record.exception is not None:
        try:
            exc = pickle.loads(record.exception)
        except Exception:  # noqa: BLE001 - the class may be gone from this code base
            exc = None
        if isinstance(exc, BaseException):
            raise exc
    raise StepFailed(record.error["type"], record.error["message"])


def refused(claimed: Claimed) -> Outcome | None:
    """The failure to record instead of running, for a poison workflow or one past its deadline."""
    if claimed.max_attempts is not None and claimed.attempt > claimed.max_attempts:
        return "failed", None, describe(MaxAttemptsExceeded(
            f"workflow {claimed.id!r} was claimed {claimed.max_attempts} times without finishing"))
    if claimed.seconds_left is not None and claimed.seconds_left <= 0:
        return "failed", None, describe(WorkflowTimeout(f"workflow {claimed.id!r} ran out of time"))
    return None


def log_end(name: str, claimed: Claimed, outcome: Outcome, seconds: float) -> None:
    """One line per workflow end at INFO; a failure at WARNING, with its traceback."""
    status, _, error = outcome
    if status == "failed" and error is not None:
        runs.warning("workflow %s %s failed in %.3fs (attempt %d): %s: %s\n%s", name, claimed.id, seconds,
                     claimed.attempt, error.get("type"), error.get("message"), error.get("traceback", ""))
    else:
        runs.info("workflow %s %s %s in %.3fs (attempt %d)", name, claimed.id, status, seconds, claimed.attempt)
