"""What ids, queue names, priorities, delays, stream keys, offsets and chunks may be: checked before
anything is written, queued or batched, so one bad value fails its own caller with an error that names
the parameter and the limit, and never a statement or a batch shared with others."""

from __future__ import annotations

import math
import re
from datetime import datetime

from .. import codec

MAX_ID_BYTES = 1000  # far below the index's row limit (~2,700 bytes), and pings name ids
MAX_QUEUE_BYTES = 256
MAX_DELAY = 10 * 366 * 24 * 3600.0  # seconds: ten years
PRIORITY_RANGE = (-(2**31), 2**31 - 1)  # the column is an integer

MAX_CHUNK_BYTES = 8 * 1024 * 1024
MAX_KEY_BYTES = 256
POSITION_LIMIT = 2**31  # stream positions are int4 in the table: an offset at or past this is no position


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
    check_id(id)
    assert isinstance(id, str)
    tick = _TICK_ID.fullmatch(id)
    if tick is not None:
        try:
            when = datetime.fromisoformat(tick[2])
        except ValueError:
            when = None
        if when is not None and when.tzinfo is not None:
            raise ValueError(f"workflow id {id!r} is reserved: ids of the form <name>@<ISO time> are what the"
                             " scheduler gives the ticks of scheduled workflows; choose another id")
    return id, [match[1] for pattern in _CHILD_IDS if (match := pattern.fullmatch(id)) is not None]


def check_queue(queue: object) -> str:
    return check_text(queue, "a queue name", MAX_QUEUE_BYTES)


def check_priority(priority: object) -> int:
    low, high = PRIORITY_RANGE
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise TypeError(f"priority is an int, got {priority!r}")
    if not low <= priority <= high:
        raise ValueError(f"priority must be between {low} and {high}, got {priority}")
    return priority


def check_delay(delay: object) -> float:
    if not isinstance(delay, int | float) or isinstance(delay, bool):
        raise TypeError(f"delay is a number of seconds, got {delay!r}")
    if not math.isfinite(delay) or not 0 <= delay <= MAX_DELAY:
        raise ValueError(f"delay must be between 0 and {MAX_DELAY:.0f} seconds (ten years), got {delay!r}")
    return float(delay)


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
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise ValueError(f"a stream offset is a position >= 0, got {offset!r}")
    if offset >= POSITION_LIMIT:
        raise ValueError(f"a stream offset is below 2**31 = {POSITION_LIMIT} (positions are int4), got {offset}")


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
