"""``eta=`` and ``expires=``: when a workflow may start, and by when it must have, checked in the caller
before anything is written."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from .checks import MAX_DELAY
from .store.store import Timing


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
    if isinstance(expires, bool) or not isinstance(expires, int | float):
        raise TypeError(f"expires is a timezone-aware datetime or a number of seconds, got {expires!r}")
    if not math.isfinite(expires) or not 0 < expires <= MAX_DELAY:
        raise ValueError(f"expires is a number of seconds above 0 and at most ten years, got {expires!r}")
    return float(expires)


def timing(delay: float, eta: datetime | None, expires: datetime | float | None) -> Timing | None:
    """The stored form of a start's timing; refuses one that could never run."""
    if eta is not None and delay:
        raise ValueError("give delay= or eta=, not both: delay is seconds from now, eta the time itself")
    if expires is None:
        return None if eta is None else Timing(eta=eta)
    if isinstance(expires, datetime):
        due = eta if eta is not None else datetime.now(UTC) + timedelta(seconds=delay)
        if expires <= due:
            raise ValueError(f"expires ({expires.isoformat()}) is not after the time the workflow falls due "
                             f"({due.isoformat()}): it could never run")
        return Timing(eta=eta, expires_at=expires)
    if eta is not None:
        return Timing(eta=eta, expires_at=datetime.now(UTC) + timedelta(seconds=expires)) if (
            eta < datetime.now(UTC) + timedelta(seconds=expires)) else _never(expires, "eta")
    if expires <= delay:
        _never(expires, "delay")
    return Timing(expires_in=expires)


def _never(expires: float, what: str) -> Timing:
    raise ValueError(f"expires ({expires:g}s) comes before the {what} ends: the workflow could never run")
