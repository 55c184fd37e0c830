"""The options of per-key limits, checked before anything is written: a start's key
(``with_options(key=...)``, or the workflow's key function, ``@app.workflow(key=...)``) and a queue's
per-key limits (``app.queue(..., key_concurrency=, key_rate_limit=)``).

Apart from ``checks.py`` because the rules are about keys alone: what a key may be (a non-empty string,
since the empty one stands for "no key" in the table; migration 0032), and what a key function may
return. A key function is the user's code, run in the caller at ``start``: what it raises reaches the
caller as it is, and a result that is no key is refused there, before the start is written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .checks import MAX_ID_BYTES, check_int, check_text

MAX_KEY_BYTES = MAX_ID_BYTES  # a tenant's id, a user's: as long as a workflow id may be

KeyFunction = Callable[..., str]


def check_key(key: object) -> str:
    """``with_options(key=)``: the key a start counts against in a queue with per-key limits."""
    return check_text(key, "key", MAX_KEY_BYTES)


def check_key_function(key: object) -> KeyFunction | None:
    """``@app.workflow(key=)``: a callable taking the workflow's arguments (None: starts carry no key
    unless they give one). A string is refused: every start would have that one key, which is the queue's
    own limits, and is more likely ``with_options(key=...)`` misplaced."""
    if key is None:
        return None
    if isinstance(key, str) or not callable(key):
        raise TypeError(f"a workflow's key is a function of its arguments returning the start's key (a string),"
                        f" got {key!r}; a fixed key is given per start: with_options(key=...)")
    return key


def key_of(function: KeyFunction, workflow: str, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    """The key ``function`` gives a start of ``workflow`` with these arguments, checked."""
    key = function(*args, **kwargs)
    try:
        return check_key(key)
    except ValueError as exc:
        raise ValueError(f"the key function of workflow {workflow!r} returned {key!r}: {exc}") from None


def check_key_limits(key_concurrency: object, key_rate_limit: object) -> None:
    """``app.queue``'s per-key limits (None: no such limit)."""
    if key_concurrency is not None:
        check_int(key_concurrency, "key_concurrency", 1, 2**31 - 1)
    if key_rate_limit is not None:
        check_int(key_rate_limit, "key_rate_limit", 1, 2**31 - 1)
