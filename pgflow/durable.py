"""Durable waits and publications of a workflow body: ``sleep``, ``set_event``.

Called from the body of a workflow that a worker runs (not from inside a step, which may run more
than once). Each is journaled at the body's next position like a step call, so a replay after a crash
neither repeats nor forgets it. Sync twins carry the plain names, for ``def`` workflows.
"""

from __future__ import annotations

from . import codec
from ._core import waits
from ._core.checks import check_text
from ._core.execution import from_thread, running

__all__ = ["set_event", "set_event_async", "sleep", "sleep_async"]


async def sleep_async(seconds: float) -> None:
    """Sleep ``seconds``, durably: the wake-up time is journaled on the first run (on the server's
    clock), so a replay sleeps only what is left. A sleep longer than the App's ``suspend_after``
    (5 s by default) gives the worker slot back: the workflow is queued again, due at the wake-up
    time, and any worker of its queue takes it up then."""
    seconds = waits.check_seconds(seconds, "a sleep")
    await waits.sleep(running("sleep_async"), seconds)


def sleep(seconds: float) -> None:
    """Sync twin of ``sleep_async``, for ``def`` workflows."""
    seconds = waits.check_seconds(seconds, "a sleep")
    from_thread("sleep", waits.sleep, seconds)


def _event(key: str, value: object) -> bytes:
    check_text(key, "an event key", 256)
    return codec.encode(value, f"the value of event {key!r}")


async def set_event_async(key: str, value: object) -> None:
    """Publish ``value`` under ``key`` for this workflow: a durable row keyed (workflow id, key),
    the last value set winning, read by ``handle.get_event(key)`` from any process. Journaled: a
    replay of the workflow does not publish it again."""
    data = _event(key, value)
    await waits.set_event(running("set_event_async"), key, data)


def set_event(key: str, value: object) -> None:
    """Sync twin of ``set_event_async``, for ``def`` workflows."""
    data = _event(key, value)
    from_thread("set_event", waits.set_event, key, data)
