"""The clock that pgflow's own timers follow in a process: the Python half of the schema's clock.

The database half is ``<schema>.clock_now()`` (migration 0019): every due time, wake-up and deadline
the statements read. The timers a worker keeps in Python decide when to look again on that same time:
a step's retry backoff, a short sleep or wait held in the slot, a workflow's timeout while it runs,
the next cron tick. In production the clock is the real one and each of these is the plain anyio
call it always was (one attribute test more). ``pgflow.testing`` turns an App's clock *virtual*: its
time is the real time plus an offset that the test moves, and moving it re-arms every timer at once,
from any thread, so what falls due runs now instead of when the real clock gets there.

A virtual clock also knows which workflows are *parked*: waiting on one of its timers, or on another
workflow (a child's result, an event), inside their worker. That is what lets a test tell "nothing can
happen until time moves" from "still busy".
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import anyio

# The workflow whose body (or step) the running code belongs to: set by the executor, read when a
# wait parks, so the clock can say which running workflows wait.
OWNER: ContextVar[str | None] = ContextVar("pgflow_clock_owner", default=None)


@dataclass(eq=False)
class _Timer:
    loop: asyncio.AbstractEventLoop
    scope: anyio.CancelScope
    due: float  # on the clock's monotonic time


class Clock:
    """Real time plus an offset that only a test moves (see the module's docstring)."""

    def __init__(self) -> None:
        self.virtual = False
        self.offset = 0.0  # seconds the virtual clock is ahead of the real one
        self._lock = threading.Lock()
        self._timers: set[_Timer] = set()
        self._parked: Counter[str] = Counter()
        self._working: set[str] = set()  # services woken by this clock that have not slept again yet
        self.activity = 0  # counts every park that ended: a waiter woken since a look was taken

    # -- reading ----------------------------------------------------------------------------------------

    def monotonic(self) -> float:
        return time.monotonic() + self.offset

    def now(self) -> datetime:
        now = datetime.now(UTC)
        return now + timedelta(seconds=self.offset) if self.offset else now

    # -- timers -----------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def move_on_after(self, seconds: float | None, *, owner: str | None = None) -> Iterator[anyio.CancelScope]:
        """``anyio.move_on_after`` on this clock. ``owner``: the workflow that waits for it (parked
        meanwhile); None for a deadline around work (a workflow's timeout)."""
        if not self.virtual:
            with anyio.move_on_after(seconds) as scope:
                yield scope
            return
        if seconds is None:  # no timer, but a wait all the same
            with anyio.CancelScope() as scope, self._parking(owner):
                yield scope
            return
        due = self.monotonic() + max(0.0, seconds)
        with anyio.CancelScope(deadline=due - self.offset) as scope:
            timer = _Timer(asyncio.get_running_loop(), scope, due)
            with self._lock:
                self._timers.add(timer)
            try:
                with self._parking(owner):
                    yield scope
            finally:
                with self._lock:
                    self._timers.discard(timer)

    async def sleep(self, seconds: float, *, owner: str | None = None, service: str | None = None) -> None:
        """``anyio.sleep`` on this clock. ``service``: a loop of the worker's that does something
        each time it wakes (a schedule); it counts as busy from its wake-up until its next sleep."""
        if not self.virtual:
            await anyio.sleep(seconds)
            return
        if service is not None:
            with self._lock:
                self._working.discard(service)
        with self.move_on_after(seconds, owner=owner):
            await anyio.sleep_forever()
        if service is not None:  # (not when cancelled: the service is stopping)
            with self._lock:
                self._working.add(service)

    @contextlib.contextmanager
    def parked(self) -> Iterator[None]:
        """Around a wait on something other than time (another workflow's end or event), in the
        workflow whose code runs here: it counts as parked while it waits."""
        with self._parking(OWNER.get() if self.virtual else None):
            yield

    @contextlib.contextmanager
    def _parking(self, owner: str | None) -> Iterator[None]:
        if owner is None:
            yield
            return
        with self._lock:
            self._parked[owner] += 1
        try:
            yield
        finally:
            with self._lock:
                self._parked[owner] -= 1
                if self._parked[owner] <= 0:
                    del self._parked[owner]
                self.activity += 1

    # -- what a test asks of it -------------------------------------------------------------------------

    def working(self) -> set[str]:
        with self._lock:
            return set(self._working)

    def parked_owners(self) -> set[str]:
        with self._lock:
            return set(self._parked)

    def timers(self) -> int:
        """How many timers run on this clock now."""
        with self._lock:
            return len(self._timers)

    def next_due(self) -> float | None:
        """Seconds until this process's next timer falls due, on this clock; None without one."""
        with self._lock:
            dues = [timer.due for timer in self._timers]
        return min(dues) - self.monotonic() if dues else None

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` on and re-arm every timer on it, on whatever loop it runs."""
        if not self.virtual:
            raise RuntimeError("only a virtual clock moves (pgflow.testing makes one)")
        if not seconds >= 0:
            raise ValueError(f"the clock only moves forward: got {seconds!r} seconds")
        with self._lock:
            self.offset += seconds
            timers = list(self._timers)
        for timer in timers:
            with contextlib.suppress(RuntimeError):  # its loop has closed: nothing waits there
                timer.loop.call_soon_threadsafe(self._rearm, timer)

    def _rearm(self, timer: _Timer) -> None:
        timer.scope.deadline = timer.due - self.offset
