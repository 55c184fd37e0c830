"""The clock a test moves: ``env.clock.advance(days=30)``.

Moving it sets the schema's ``clock_now()`` (every due time, wake-up and deadline the statements
read) and the App's clock in this process (the timers a worker keeps in Python) by the same amount,
then wakes the worker, so what fell due runs now. ``advance`` moves in steps: to the next moment
something falls due, runs until idle, and so on up to the end of the span, so a workflow that sleeps,
retries with backoff and waits for a message with a timeout goes through every one of them in turn.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from .._core.clock import Clock

if TYPE_CHECKING:
    from .env import PgflowEnv

STEP_PAST = 0.001  # seconds past a due time that a step lands on, so "due_at <= clock_now()" holds


def span(seconds: float = 0.0, minutes: float = 0.0, hours: float = 0.0, days: float = 0.0,
         weeks: float = 0.0) -> float:
    parts = (seconds, minutes, hours, days, weeks)
    if any(isinstance(part, bool) or not isinstance(part, int | float) or not math.isfinite(part) for part in parts):
        raise ValueError(f"the clock only moves forward, by a finite span: got {parts!r}")
    total = timedelta(seconds=seconds, minutes=minutes, hours=hours, days=days, weeks=weeks).total_seconds()
    if total < 0:
        raise ValueError(f"the clock only moves forward, by a finite span: got {total!r} seconds")
    return total


class VirtualClock:
    """The test's time: real time plus what the test has advanced it by."""

    def __init__(self, env: PgflowEnv, clock: Clock) -> None:
        self._env = env
        self._clock = clock

    @property
    def offset(self) -> float:
        """Seconds this clock is ahead of the real one."""
        return self._clock.offset

    def now(self) -> datetime:
        """The test's time (UTC), as the workers and the schema see it."""
        return self._clock.now()

    def advance(self, seconds: float = 0.0, *, minutes: float = 0.0, hours: float = 0.0, days: float = 0.0,
                weeks: float = 0.0, timeout: float = 30.0) -> None:
        """Move time on by the span given, running everything that falls due on the way, and return
        once nothing more can happen before the end of it. ``timeout`` bounds the wall time."""
        total = span(seconds, minutes, hours, days, weeks)
        self._env._call(lambda: self._advance(total, timeout))

    async def advance_async(self, seconds: float = 0.0, *, minutes: float = 0.0, hours: float = 0.0,
                            days: float = 0.0, weeks: float = 0.0, timeout: float = 30.0) -> None:
        total = span(seconds, minutes, hours, days, weeks)
        await self._advance(total, timeout)

    async def _advance(self, total: float, timeout: float) -> None:
        env, clock = self._env, self._clock
        deadline = env.wall_deadline(timeout)
        await env.run_until_idle_async(timeout=env.wall_left(deadline))
        until = clock.monotonic() + total
        while True:
            left = until - clock.monotonic()
            if left <= 0:
                return
            db_next = await env.next_due_async()
            dues = [due for due in (db_next, clock.next_due()) if due is not None]
            step = left if not dues or min(dues) >= left else max(min(dues), 0.0) + STEP_PAST
            await self._move(min(step, left))
            await env.run_until_idle_async(timeout=env.wall_left(deadline))

    async def _move(self, seconds: float) -> None:
        """The schema's clock first, so a timer woken here reads the new time in its statements, then
        this process's timers, then the worker (not left to its poll)."""
        await self._env.set_schema_clock(self._clock.offset + seconds)
        self._clock.advance(seconds)
        self._env.wake_worker()

