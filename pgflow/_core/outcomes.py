"""How a step's or a workflow's outcome is recorded and given back: an exception described in words
PostgreSQL can store (and pickled, so a replay raises the same type), an output decoded as the first
run returned it."""

from __future__ import annotations

import pickle
import traceback
from typing import Any

from .. import codec
from ..errors import StepFailed
from .registry import StepSpec
from .store import StepRecord


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
