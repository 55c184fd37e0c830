"""Every rule for a value a user hands pgflow: ids, names, queue names, keys, priorities, counts,
seconds, times and stream chunks, and the settings of an App and of its workflows and steps. Each is
checked before anything is written, queued or batched, so one bad value fails its own caller with an
error that names the parameter and the limit, and never a statement or a batch shared with others.
A rule lives here once; the modules that take the value call it.

Which exception a bad value gets (one policy, wherever the value comes in):

- A number, a datetime, a dict or a function of the wrong type (a str where an int goes, a bool for
  a number): ``TypeError``. Of the right type but outside what pgflow can take (out of range, NaN, a
  naive datetime): ``ValueError``.
- Text (ids, names, queue names, keys, topics) and positions (stream offsets, ``from_step``):
  ``ValueError`` for anything that is not one, whatever its type, with one message ("is a non-empty
  string", "is a position >= 0"). They have been checked so from the start, and code catches
  ValueError for them (a body that skips a stream key it cannot use).
- Both are the builtin types themselves: raised in a workflow body they are recorded and shown as
  ``TypeError``/``ValueError``, and rebuilt as such on a replay.
- The same values given to set an App up (``App(...)``, ``@app.workflow``, ``@app.step``,
  ``app.queue``) also make a ``pgflow.ConfigurationError``: the program cannot start as written,
  which the CLI reports as a usage error. The setup wraps the rule's call in ``setting_up()``, which
  raises ``BadSetting`` (ConfigurationError and ValueError) or ``BadSettingType`` (ConfigurationError
  and TypeError) with the rule's message, so no rule is written twice.
- A value that cannot be encoded, or does not fit its type hint: ``pgflow.SerializationError``
  (``codec.py``).
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from ..errors import ConfigurationError
from . import codec

MAX_ID_BYTES = 1000  # far below the index's row limit (~2,700 bytes), and pings name ids
MAX_NAME_BYTES = MAX_ID_BYTES  # a workflow's name is part of its scheduled ticks' ids
MAX_QUEUE_BYTES = 256
MAX_KEY_BYTES = 256  # stream keys, event keys, message topics
MAX_CHANGE_ID_BYTES = 200  # a patch's change id, inside a journal entry's name
MAX_DELAY = 10 * 366 * 24 * 3600.0  # seconds: ten years
INT4 = (-(2**31), 2**31 - 1)  # the range of the integer columns (priorities, attempts)
PRIORITY_RANGE = INT4
MAX_CHUNK_BYTES = 8 * 1024 * 1024
POSITION_LIMIT = 2**31  # stream positions are int4 in the table: an offset at or past this is no position
VALUE_LIMITS = (1024, 512 * 1024 * 1024)  # what max_value_bytes may be
NOTIFY_MODES = ("buffered", "off")


class BadSetting(ConfigurationError, ValueError):
    """A setting's value that the rule refuses, given while setting an App up."""


class BadSettingType(ConfigurationError, TypeError):
    """A setting of the wrong type, given while setting an App up."""


@contextmanager
def setting_up() -> Iterator[None]:
    """Around the checks of an App's setup: a refused value is a ConfigurationError as well (see the
    policy). Only the checks go inside: any other TypeError or ValueError would be taken for theirs."""
    try:
        yield
    except TypeError as exc:
        raise BadSettingType(str(exc)) from None
    except ValueError as exc:
        raise BadSetting(str(exc)) from None


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- text ---------------------------------------------------------------------------------------------------


def check_text(value: object, what: str, limit: int) -> str:
    """A non-empty str that PostgreSQL can store (no NUL, no lone surrogate) within ``limit`` bytes."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} is a non-empty string, got {value!r}")
    try:
        size = len(value.encode())
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} must be valid Unicode text (it holds a lone surrogate): {value!r}") from exc
    if "\x00" in value:
        raise ValueError(f"{what} must not contain NUL characters: {value!r}")
    if size > limit:
        raise ValueError(f"{what} is at most {limit} bytes, got {size}")
    return value


def check_id(id: object) -> str:
    return check_text(id, "a workflow id", MAX_ID_BYTES)


def check_name(name: object, what: str = "a workflow name") -> str:
    """A workflow's or a step's name: what the journal, the workers and ``start_by_name`` know it by."""
    return check_text(name, what, MAX_NAME_BYTES)


def check_queue(queue: object) -> str:
    return check_text(queue, "a queue name", MAX_QUEUE_BYTES)


def check_event_key(key: object) -> str:
    return check_text(key, "an event key", MAX_KEY_BYTES)


def check_topic(topic: object) -> str:
    return check_text(topic, "a message topic", MAX_KEY_BYTES)


def check_idempotency_key(key: object) -> str:
    return check_text(key, "an idempotency key", MAX_ID_BYTES)


def check_change_id(change_id: object) -> str:
    return check_text(change_id, "a patch's change id", MAX_CHANGE_ID_BYTES)


_TICK_ID = re.compile(r"(.+)@(.+)", re.S)  # what the scheduler names a tick: <workflow name>@<ISO time>
# A child: <parent id>.<position>, or <parent id>.<position>.<n> (start_many).
_CHILD_IDS = (re.compile(r"(.+)\.[0-9]+", re.S), re.compile(r"(.+)\.[0-9]+\.[0-9]+", re.S))


def check_chosen_id(id: object) -> tuple[str, list[str]]:
    """A workflow id that a caller chose (not one pgflow derived): refused when it has the form of a
    scheduled tick's (``<name>@<ISO time with a zone>``), which a caller could otherwise take first
    and so stop that tick from running. Returns it, and for an id of a child's form
    (``<parent id>.<position>[.<n>]``) the ids of the parents it could be a child of, which
    ``starting.refuse_children`` looks up: a caller may not take the id of a child that a workflow
    has started or will start."""
    chosen = check_id(id)
    tick = _TICK_ID.fullmatch(chosen)
    if tick is not None:
        try:
            when = datetime.fromisoformat(tick[2])
        except ValueError:
            when = None
        if when is not None and when.tzinfo is not None:
            raise ValueError(f"workflow id {chosen!r} is reserved: ids of the form <name>@<ISO time> are what the"
                             " scheduler gives the ticks of scheduled workflows; choose another id")
    return chosen, [match[1] for pattern in _CHILD_IDS if (match := pattern.fullmatch(chosen)) is not None]


# -- numbers ------------------------------------------------------------------------------------------------


def check_int(value: object, what: str, low: int, high: int | None = None) -> int:
    """An int (not a bool, which is one to Python) from ``low`` to ``high`` (None: no bound)."""
    if not _is_int(value):
        raise TypeError(f"{what} is an int, got {value!r}")
    assert isinstance(value, int)
    if high is None and value < low:
        raise ValueError(f"{what} must be at least {low}, got {value}")
    if high is not None and not low <= value <= high:
        raise ValueError(f"{what} must be between {low} and {high}, got {value}")
    return value


def check_priority(priority: object) -> int:
    return check_int(priority, "priority", *PRIORITY_RANGE)


def check_max_attempts(max_attempts: object) -> int:
    """Runs of a workflow before it is given up; the caller lets None (no cap) through."""
    return check_int(max_attempts, "max_attempts", 1, INT4[1])


def check_run_options(*, queue: object = None, priority: object = None, max_attempts: object = None,
                      timeout: object = None, timeout_what: str = "timeout") -> float | None:
    """The options a workflow runs under, each checked when given (None: the default holds); returns
    the timeout as seconds."""
    if queue is not None:
        check_queue(queue)
    if priority is not None:
        check_priority(priority)
    if max_attempts is not None:
        check_max_attempts(max_attempts)
    return None if timeout is None else check_positive_seconds(timeout, timeout_what)


def check_seconds(seconds: object, what: str) -> float:
    """A wait: from 0 to ten years (a delay, a sleep, a receive's or an event's timeout). NaN compares
    false with everything, so each bound is written to refuse it."""
    if not _is_number(seconds):
        raise TypeError(f"{what} is a number of seconds, got {seconds!r}")
    assert isinstance(seconds, int | float)
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_DELAY:
        raise ValueError(f"{what} must be between 0 and {MAX_DELAY:.0f} seconds (ten years), got {seconds!r}")
    return float(seconds)


def check_wait(timeout: object, what: str = "timeout") -> float | None:
    """A wait's timeout, or None: no end."""
    return None if timeout is None else check_seconds(timeout, what)


def check_positive_seconds(seconds: object, what: str, most: float = MAX_DELAY) -> float:
    """A span that must not be zero (a timeout, an interval, a rate's period), finite, at most ``most``."""
    if not _is_number(seconds):
        raise TypeError(f"{what} is a positive number of seconds, got {seconds!r}")
    assert isinstance(seconds, int | float)
    if not math.isfinite(seconds) or not 0 < seconds <= most:
        bound = f", at most {most:.0f}" if math.isfinite(most) else ", finite"
        raise ValueError(f"{what} is a positive number of seconds{bound}, got {seconds!r}")
    return float(seconds)


def check_retention(retention: object, what: str = "retention (None keeps everything)") -> float | None:
    """Seconds finished workflows are kept (a timedelta too); None keeps them for ever. (Any other
    period that may be None, for ``what``.)"""
    if isinstance(retention, timedelta):
        retention = retention.total_seconds()
    if retention is None:
        return None
    return check_positive_seconds(retention, what, math.inf)


def check_position(position: object, what: str) -> int:
    """A position in a journal or a stream: an int >= 0 below the int4 limit of the columns."""
    if not isinstance(position, int) or isinstance(position, bool) or position < 0:
        raise ValueError(f"{what} is a position >= 0, got {position!r}")
    if position >= POSITION_LIMIT:
        raise ValueError(f"{what} is below 2**31 = {POSITION_LIMIT} (positions are int4), got {position}")
    return position


# -- times --------------------------------------------------------------------------------------------------


def check_eta(eta: object) -> datetime:
    """A timezone-aware datetime at most ten years ahead. A naive one is refused: nothing says whose
    clock it was read from (the caller's, the server's, UTC), and guessing would move the start."""
    if not isinstance(eta, datetime):
        raise TypeError(f"eta is a datetime, e.g. datetime.now(timezone.utc) + timedelta(hours=1); got {eta!r}")
    if eta.tzinfo is None or eta.utcoffset() is None:
        raise ValueError(f"eta must be timezone-aware (got the naive {eta.isoformat()}): give it a tzinfo, e.g. "
                         "datetime(2027, 1, 1, 9, 0, tzinfo=timezone.utc) or datetime.now(timezone.utc) + delta")
    if eta - datetime.now(UTC) > timedelta(seconds=MAX_DELAY):
        raise ValueError(f"eta is at most ten years ahead, got {eta.isoformat()}")
    return eta


def check_expires(expires: object) -> datetime | float:
    """A timezone-aware datetime, or seconds (a number or a timedelta) from the start call."""
    if isinstance(expires, timedelta):
        expires = expires.total_seconds()
    if isinstance(expires, datetime):
        if expires.tzinfo is None or expires.utcoffset() is None:
            raise ValueError(f"expires must be timezone-aware when it is a datetime (got the naive "
                             f"{expires.isoformat()}), or a number of seconds")
        return expires
    if not _is_number(expires):
        raise TypeError(f"expires is a timezone-aware datetime or a number of seconds, got {expires!r}")
    assert isinstance(expires, int | float)
    if not math.isfinite(expires) or not 0 < expires <= MAX_DELAY:
        raise ValueError(f"expires is a number of seconds above 0 and at most ten years, got {expires!r}")
    return float(expires)


# -- arguments ----------------------------------------------------------------------------------------------


def check_kwargs(kwargs: object) -> dict[str, Any]:
    """Keyword arguments given as a value (``start_by_name``'s ``kwargs=``), None for none."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise TypeError(f"kwargs is a dict of keyword arguments by name, got {kwargs!r:.80}")
    return kwargs


def check_call(call: object) -> tuple[Any, ...]:
    """One call of ``start_many``: its positional arguments."""
    if not isinstance(call, tuple | list):
        raise TypeError(f"start_many takes one tuple of arguments per workflow, e.g. [(1,), (2,)]; got {call!r:.80}")
    return tuple(call)


def check_many_ids(ids: object, calls: int) -> list[str]:
    """``start_many``'s ``ids=``: one chosen id per call."""
    if isinstance(ids, str) or not isinstance(ids, Sequence) or len(ids) != calls:
        raise ValueError(f"ids= gives one id per call: {calls} calls, got {ids!r:.80}")
    return [check_chosen_id(id)[0] for id in ids]


# -- streams ------------------------------------------------------------------------------------------------

_good_keys: set[str] = set()  # stream keys already checked: a writer names the same few keys again and again


def check_key(key: str) -> None:
    if type(key) is str and key in _good_keys:  # (a str subclass could compare equal to a good key)
        return
    check_text(key, "a stream key", MAX_KEY_BYTES)
    if len(_good_keys) > 1000:
        _good_keys.clear()
    _good_keys.add(key)


def check_reader(key: str, offset: int) -> None:
    check_key(key)
    check_position(offset, "a stream offset")


def encode_chunk(key: str, value: object) -> bytes:
    data = codec.encode_quietly(value)
    if data is None:  # it cannot be encoded: again, for the error that says why
        data = codec.encode(value, f"a chunk of stream {key!r}")
    if len(data) > MAX_CHUNK_BYTES:
        raise ValueError(
            f"a chunk of stream {key!r} is {len(data)} bytes encoded; the limit is {MAX_CHUNK_BYTES}. "
            "Split it into several chunks."
        )
    return data


# -- setting an App up (called inside ``setting_up()``) -----------------------------------------------------

_SCHEMA = re.compile(r"[a-z_][a-z0-9_]{0,54}")


def check_schema(schema: object) -> str:
    """A schema name usable unquoted in every statement and in the NOTIFY channel's name."""
    if not isinstance(schema, str) or not _SCHEMA.fullmatch(schema):
        raise ValueError(f"schema {schema!r} is not usable: use lowercase letters, digits and _ "
                         "(at most 55 characters, not starting with a digit)")
    return schema


def check_notify(notify: object) -> str:
    if notify not in NOTIFY_MODES:
        raise ValueError(f"notify must be 'buffered' or 'off', got {notify!r}")
    assert isinstance(notify, str)
    return notify


def check_value_limit(max_value_bytes: object) -> int:
    return check_int(max_value_bytes, "max_value_bytes", *VALUE_LIMITS)


def check_registrable(fn: object, what: str) -> Callable[..., Any]:
    """What ``@app.workflow`` and ``@app.step`` decorate: a plain or async function, no generator
    (its body would run as the generator is iterated, outside the journal)."""
    if not callable(fn):
        raise TypeError(f"@app.{what} decorates a function, got {fn!r}")
    if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
        raise ValueError(f"@app.{what} cannot decorate a generator function: {fn!r}")
    return fn


def check_schedulable(fn: Callable[..., Any], name: str) -> None:
    """A scheduled workflow is started by the scheduler, which has only the tick's time to give."""
    if len(inspect.signature(fn).parameters) > 1:
        raise ValueError(f"scheduled workflow {name!r} takes no arguments or one (the tick's datetime)")


def check_queue_limits(concurrency: object, rate_limit: object, per: object) -> float:
    """``app.queue``'s limits; returns ``per`` as seconds."""
    if concurrency is not None:
        check_int(concurrency, "concurrency", 1)
    if rate_limit is not None:
        check_int(rate_limit, "rate_limit", 1)
    return check_positive_seconds(per, "per")
