"""Durable waits and publications of a workflow body: ``sleep``, ``set_event``, ``recv``.

Called from the body of a workflow that a worker runs (not from inside a step, which may run more
than once). Each is journaled at the body's next position like a step call, so a replay after a crash
neither repeats nor forgets it. Sync twins carry the plain names, for ``def`` workflows.
"""

from __future__ import annotations

from typing import Any

from ._core import codec, waits
from ._core.checks import MAX_DELAY, check_event_key, check_seconds, check_topic
from ._core.current import current_execution, from_thread, running

__all__ = ["recv", "recv_async", "set_event", "set_event_async", "sleep", "sleep_async"]


async def sleep_async(seconds: float) -> None:
    """Sleep ``seconds``, durably: the wake-up time is journaled on the first run (on the server's
    clock), so a replay sleeps only what is left. A sleep longer than the App's ``suspend_after``
    (5 s by default) gives the worker slot back: the workflow is queued again, due at the wake-up
    time, and any worker of its queue takes it up then."""
    seconds = check_seconds(seconds, "a sleep")
    await waits.sleep(running("sleep_async"), seconds)


def sleep(seconds: float) -> None:
    """Sync twin of ``sleep_async``, for ``def`` workflows."""
    seconds = check_seconds(seconds, "a sleep")
    from_thread("sleep", waits.sleep, seconds)


def _event(key: str, value: object) -> bytes:
    check_event_key(key)
    execution = current_execution.get()  # (outside one, the value is still checked, then refused)
    return codec.encode(value, f"the value of event {key!r}", execution.value_limit if execution else None)


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


def _receiving(topic: str, timeout: float | None) -> float:
    check_topic(topic)
    return check_seconds(timeout, "a receive's timeout") if timeout is not None else MAX_DELAY


async def recv_async(topic: str, timeout: float | None = None, *, type: Any = Any) -> Any:
    """The next message sent to this workflow on ``topic`` (``handle.send``), waiting for it up to
    ``timeout`` seconds (None: without end); None when the time runs out.

    Each message is consumed exactly once: it is taken in the same transaction that journals its
    receipt, so a replay after a crash returns the same message, and a timeout, journaled too,
    returns None again. Messages on a topic come in the order they were sent. A wait longer than
    the App's ``suspend_after`` gives the worker slot back; a send to the topic wakes it at once.
    ``type`` decodes the message into a Struct or dataclass instead of builtins."""
    seconds = _receiving(topic, timeout)
    data = await waits.recv(running("recv_async"), topic, seconds)
    return None if data is None else codec.decode(data, type)


def recv(topic: str, timeout: float | None = None, *, type: Any = Any) -> Any:
    """Sync twin of ``recv_async``, for ``def`` workflows."""
    seconds = _receiving(topic, timeout)
    data = from_thread("recv", waits.recv, topic, seconds)
    return None if data is None else codec.decode(data, type)
