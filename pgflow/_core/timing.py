"""``eta=`` and ``expires=`` together: when a workflow may start, and by when it must have, as stored;
each value on its own is checked in ``checks.py``, this refuses a combination that could never run."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from .engine.starts import Timing


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
