"""How a step's or a workflow's outcome is recorded and given back. An exception is recorded as data
(its type's path, message, arguments where they encode, and traceback), never as code: a row read back
is data, and write access to one table must never mean code execution on the fleet. A replay raises
the recorded type again when this process has it and can build it from the recorded arguments,
otherwise ``StepFailed`` naming it; an output is decoded as the first run returned it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import re
import sys
import threading
import traceback
import types
from pathlib import Path
from typing import Any, NamedTuple, cast

import anyio
import msgspec

from ..errors import ExecutionInterrupted, MaxAttemptsExceeded, StepFailed, WorkflowExpired, WorkflowTimeout
from . import codec, log_lines
from .engine import Claimed, StepRecord
from .engine.claims import CRASHES_ALONE
from .registry import StepSpec
from .status import Status

runs = logging.getLogger("pgflow.workflows")  # one line per workflow start and end


class Outcome(NamedTuple):
    """A workflow's end, as it is recorded: its status, and its encoded result or its error."""

    status: Status
    output: bytes | None = None
    error: dict[str, Any] | None = None

    @classmethod
    def failed(cls, exc: BaseException) -> Outcome:
        return cls(Status.FAILED, None, describe(exc))


CANCELLED = Outcome(Status.CANCELLED)
ARGS_AT_MOST = 4096  # bytes of an exception's encoded arguments kept to rebuild it on replay


def _storable(text: str) -> str:
    """Text PostgreSQL can hold in jsonb: NUL and lone surrogates (which a user's exception message
    may carry) are spelled out instead of failing the write that records the failure."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")


def describe(exc: BaseException) -> dict[str, Any]:
    """The recorded form of an exception: what a reader in another process needs to understand it,
    and what a replay needs to raise it again (``args``: None when they do not encode as JSON
    that PostgreSQL can hold)."""
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return {
        "type": _storable(name),
        "message": _storable(str(exc)),
        "args": _arguments(exc),
        "traceback": _storable(folded_traceback(exc)),
    }


# Where the frames a reader does not need come from: pgflow's own, anyio's, and the standard library's
# event loop and thread pools, between the worker and the user's code. Found by the file's directory.
_INTERNAL = (str(Path(__file__).resolve().parents[1]) + os.sep,
             *(os.path.dirname(module.__file__ or "") + os.sep for module in (anyio, asyncio, concurrent.futures)))
_INTERNAL_FILES = (threading.__file__,)
_FRAME = re.compile(r'  File "([^"]*)", line')


def folded_traceback(exc: BaseException) -> str:
    """``exc``'s traceback as Python formats it (causes and contexts included), each run of frames of
    pgflow, anyio or the event loop folded into one line saying how many, and the user's frames whole:
    the raise a reader looks for is theirs, among a worker's dozens of frames of its own."""
    lines: list[str] = []
    folded = 0
    for chunk in traceback.TracebackException.from_exception(exc).format():
        frame = _FRAME.match(chunk)
        if frame is not None and (frame.group(1).startswith(_INTERNAL) or frame.group(1) in _INTERNAL_FILES):
            folded += 1
            continue
        if folded:
            lines.append(f"  [{folded} frame{'s' if folded > 1 else ''} of pgflow, anyio and the event loop]\n")
            folded = 0
        lines.append(chunk)
    return "".join(lines)


MESSAGE_AT_MOST = 2000  # characters of a retried attempt's message kept (outcomes of the step itself are whole)
TRACEBACK_AT_MOST = 8000  # characters of its traceback: its start and its end, where the raise is


def attempt_error(exc: BaseException) -> dict[str, Any]:
    """The kept form of a retried attempt's exception: ``describe``'s, with the message and the
    traceback cut to a bounded size (a step retried often must not fill the table with copies of a
    huge message). No arguments: nothing rebuilds these."""
    error = describe(exc)
    error.pop("args")
    error["message"] = _cut(error["message"], MESSAGE_AT_MOST)
    error["traceback"] = _cut(error["traceback"], TRACEBACK_AT_MOST)
    return error


def _cut(text: str, at_most: int) -> str:
    if len(text) <= at_most:
        return text
    head = at_most // 4
    tail = at_most - head
    return f"{text[:head]}\n[... {len(text) - at_most} characters cut ...]\n{text[-tail:]}"


def _arguments(exc: BaseException) -> list[Any] | None:
    try:
        encoded = msgspec.json.encode(list(exc.args))
    except (TypeError, ValueError, OverflowError, RecursionError):  # not JSON, or a lone surrogate
        return None
    if len(encoded) > ARGS_AT_MOST or b"\\u0000" in encoded:  # jsonb holds no NUL
        return None
    args: list[Any] = msgspec.json.decode(encoded)
    return args if args == list(exc.args) else None  # only what comes back as it went


def rebuilt(error: dict[str, Any]) -> Exception:
    """The exception a recorded ``error`` describes: its type again when that type is an exception
    class of a module this process has already imported (none is imported for a row's sake) and it
    takes the recorded arguments; otherwise ``StepFailed`` naming the type. Rows of older versions
    have no arguments: their message stands in for them."""
    name, message = str(error.get("type", "Exception")), str(error.get("message", ""))
    kind = _exception_type(name)
    args = error["args"] if "args" in error else [message]
    if kind is not None and isinstance(args, list):
        try:
            exc = kind(*args)
        except Exception:  # noqa: BLE001 - a constructor that wants other arguments: StepFailed
            exc = None
        if isinstance(exc, kind):
            return exc
    return StepFailed(name, message)


NAME_PARTS_AT_MOST = 16  # dotted parts of a recorded type name looked at (a row could hold a megabyte of dots)
# The attribute dictionaries of a module and of a class, read as the interpreter stores them: looking a
# name up there runs nothing (no module ``__getattr__``, which in lazily loading packages imports
# submodules; no property, descriptor or metaclass ``__getattr__``), where ``getattr`` may run any of those.
_MODULE_DICT: Any = vars(types.ModuleType)["__dict__"]
_CLASS_DICT: Any = vars(type)["__dict__"]


def _exception_type(name: str) -> type[Exception] | None:
    """The class ``name`` (``module.Qual.Name``, or a builtin's bare name) if a module already loaded
    defines it and it is an ordinary exception (not a BaseException such as an interrupt).

    The name comes from a row, so it is data: it is only looked up, never followed as a path of code.
    The module must already be in ``sys.modules`` (nothing is imported for a row's sake); each name
    after it is read from the dictionary of a module, then of a class (a nested class's qualified
    name), never through ``getattr``; a path does not go through anything that is not a class (a
    module's attribute ``os`` in ``mod.os.system`` is not followed); and the class is checked to be
    an ``Exception`` subclass before anything calls it."""
    parts = name.split(".")
    if len(parts) > NAME_PARTS_AT_MOST or not all(part.isidentifier() for part in parts):
        return None
    module_name, attributes = "builtins", parts
    if len(parts) > 1:
        cut = next((cut for cut in range(len(parts) - 1, 0, -1) if ".".join(parts[:cut]) in sys.modules), None)
        if cut is None:
            return None
        module_name, attributes = ".".join(parts[:cut]), parts[cut:]
    module = sys.modules.get(module_name)
    if not issubclass(type(module), types.ModuleType):  # (not isinstance, which may ask its own __class__)
        return None
    found: Any = _MODULE_DICT.__get__(module).get(attributes[0])
    for attribute in attributes[1:]:
        if not issubclass(type(found), type):
            return None
        found = _CLASS_DICT.__get__(found).get(attribute)
    if (issubclass(type(found), type) and issubclass(found, Exception)
            and not issubclass(found, ExecutionInterrupted)):
        return cast(type[Exception], found)
    return None


def replay(record: StepRecord, step: StepSpec) -> Any:
    """The recorded outcome of a step: its output, or its exception raised again."""
    if record.error is None:
        return codec.decode(record.output or b"\xc0", step.return_type)
    raise rebuilt(record.error)


def refused(claimed: Claimed) -> Outcome | None:
    """The end to record instead of running: for a workflow that expired before it started, a poison
    workflow, or one past its deadline."""
    if claimed.expired:
        return Outcome(Status.CANCELLED, None, describe(WorkflowExpired(
            f"workflow {claimed.id!r} had not started by its expiry time (expires=), so it never ran")))
    if claimed.give_up:
        return Outcome.failed(MaxAttemptsExceeded(given_up(claimed)))
    if claimed.seconds_left is not None and claimed.seconds_left <= 0:
        return Outcome.failed(WorkflowTimeout(f"workflow {claimed.id!r} ran out of time"))
    return None


def given_up(claimed: Claimed) -> str:
    """Why a workflow was given up: what it did, and what to do about it."""
    resume = "then resume it (pgflow workflows resume ID)"
    if claimed.crashes and claimed.max_attempts is not None \
            and claimed.crashes >= min(claimed.max_attempts, CRASHES_ALONE):
        return (f"workflow {claimed.id!r} was given up at attempt {claimed.run}: its worker process died"
                f" {claimed.crashes} times while running it alone (nothing else ran beside it), so something it"
                " does kills the process (os._exit, a fatal signal, the OOM killer, a crash in native code)."
                f" Fix what kills it, {resume}")
    return (f"workflow {claimed.id!r} was given up after {claimed.run} attempts (its max_attempts): each run"
            " was cut short before it finished (its worker was stopped, lost its lease, or died while running"
            f" it alone). Fix what interrupts it, {resume}, or give it a higher max_attempts")


def log_end(name: str, claimed: Claimed, outcome: Outcome, seconds: float) -> None:
    """One line per workflow end at INFO; a failure at WARNING, with its traceback. The attempt is
    ``pgflow.attempt()``'s (runs cut short count, wakes from a sleep do not), not the claims."""
    error = outcome.error
    if outcome.status == Status.FAILED and error is not None:
        runs.warning("workflow %s %s failed in %.3fs (attempt %d): %s: %s\n%s", name, claimed.id, seconds,
                     claimed.run, error.get("type"), error.get("message"), error.get("traceback", ""))
    elif runs.isEnabledFor(logging.INFO):
        args = (name, claimed.id, outcome.status, seconds, claimed.run)
        if not log_lines.write(runs, logging.INFO, _END, args):
            runs.info(_END, *args)


_END = "workflow %s %s %s in %.3fs (attempt %d)"
