"""The waiters of one event loop: who waits for which key, what wakes them, and the slow poll that
wakes them when no ping does.

A waiter re-reads the table when it is woken: by a ping of its key (from this process, directly, or
from another, through the listener), by the slow poll, or by a reconnecting listener (pings sent
while it was down are gone). News that carries truth (an end, a chunk) is handed to the waiters
that can use it; everybody else takes it as a plain ping.

Everything here belongs to one event loop and is only touched from it: no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Protocol, TypeVar

import psycopg

from ..engine import unreachable
from . import keys as signal_keys
from .ends import EndNews
from .payload import News

log = logging.getLogger("pgflow.signals")

T = TypeVar("T")
OUTAGE_LIMIT = 60.0  # seconds a waiter tolerates a database it cannot reach


class Wakeable(Protocol):
    """What a ping or a poll tick wakes: a ``Waiter``, or a stream reader's place in its stream."""

    def wake(self) -> None: ...

    def hand(self, stream_id: int, position: int, value: bytes | None) -> None:
        """News carried the committed chunk at ``position`` of the stream ``stream_id``."""


class PollTicks:
    """The slow poll of one loop's waiters: one timer for all of them instead of one per wait (a
    reader waits once per batch of chunks). A waiter is woken by the poll once it has waited, with no
    news, between half of ``every`` and ``every`` seconds: not at a tick that comes just after it began.
    A reader in step with its writer begins a wait after every chunk; woken by the tick, all of them
    at once would leave the chunks their pings carry for one query of every stream, a stall of the
    whole loop each second."""

    def __init__(self, every: float = 1.0) -> None:
        self.every = every
        self._loop = asyncio.get_running_loop()
        self._due: set[Wakeable] = set()  # waiting since before the last tick: woken at the next
        self._young: set[Wakeable] = set()  # began to wait since the last tick: due at the one after
        self._timer: asyncio.TimerHandle | None = None

    def add(self, waiter: Wakeable) -> None:
        """``waiter`` begins to wait (again: what it waited for before has come)."""
        self._due.discard(waiter)
        self._young.add(waiter)
        if self._timer is None:
            self._timer = self._loop.call_later(self.every / 2, self._tick)

    def _tick(self) -> None:
        due, self._due, self._young = self._due, self._young, set()
        self._timer = self._loop.call_later(self.every / 2, self._tick) if self._due else None
        for waiter in due:
            waiter.wake()


class Waiter:
    """One coroutine waiting for pings on some keys: a bare future per wait (the cheapest thing to
    wait on)."""

    __slots__ = ("_loop", "_woken", "_ticks")

    def __init__(self, ticks: PollTicks | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._woken: asyncio.Future[None] | None = None
        self._ticks = ticks

    def arm(self) -> None:
        """Start a new wait; call before re-reading the table so no ping after the read is missed."""
        self._woken = self._loop.create_future()

    def wake(self) -> None:
        woken = self._woken
        if woken is not None and not woken.done():
            woken.set_result(None)

    def hand(self, stream_id: int, position: int, value: bytes | None) -> None:
        self.wake()

    async def wait(self, timeout: float | None = None) -> None:
        """Until woken (since the last ``arm``) or ``timeout`` seconds pass; with no timeout, until
        woken or the next tick of the poll."""
        woken = self._woken
        if woken is None or woken.done():
            return
        if timeout is None and self._ticks is not None:
            self._ticks.add(self)
            await woken
            return
        assert timeout is not None
        expiry = self._loop.call_later(timeout, _expire, woken)
        try:
            await woken
        finally:
            expiry.cancel()


def _expire(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)


class Waiters:
    """The waiters of one event loop, by key. ``on_wait`` is called whenever a wait begins, so the
    loop's listener is open only while somebody waits; ``on_stream_wait`` whenever somebody begins
    to wait for a stream nobody here waited for, so it listens on the stream channel too."""

    def __init__(self, on_wait: Callable[[], None] = lambda: None,
                 on_stream_wait: Callable[[], None] = lambda: None) -> None:
        self._by_key: dict[str, set[Wakeable]] = {}
        self._on_wait = on_wait
        self._on_stream_wait = on_stream_wait
        self.streams = 0  # the streams waited for
        self.ticks = PollTicks()
        self.ends = EndNews()

    def __len__(self) -> int:
        return len(self._by_key)

    def add(self, key: str, waiter: Wakeable) -> None:
        waiting = self._by_key.get(key)
        if waiting is None:
            waiting = self._by_key[key] = set()
            workflow_id = signal_keys.ended_workflow(key)
            if workflow_id is not None:
                self.ends.watch(workflow_id)
            elif signal_keys.is_stream(key):
                self.streams += 1
                self._on_stream_wait()
        waiting.add(waiter)
        self._on_wait()

    def remove(self, key: str, waiter: Wakeable) -> None:
        waiting = self._by_key.get(key)
        if waiting is not None:
            waiting.discard(waiter)
            if not waiting:
                del self._by_key[key]
                workflow_id = signal_keys.ended_workflow(key)
                if workflow_id is not None:
                    self.ends.unwatch(workflow_id)
                elif signal_keys.is_stream(key):
                    self.streams -= 1

    def hear(self, news: News) -> None:
        """Wake the waiters of what ``news`` names; give the ends and chunks it carries to those
        who can use them."""
        self.ends.hear(news)
        by_key = self._by_key
        if signal_keys.WAKE_ALL in news.keys:
            self.ends.forget()
            for waiting in list(by_key.values()):
                for waiter in list(waiting):
                    waiter.wake()
            return
        for key in news.keys:
            for waiter in by_key.get(key, ()):
                waiter.wake()
        for end in news.ends:
            for waiter in by_key.get(signal_keys.ended(end.workflow_id), ()):
                waiter.wake()
        for chunk in news.chunks:
            for waiter in by_key.get(chunk.stream, ()):
                waiter.hand(chunk.stream_id, chunk.position, chunk.value)

    def wake_all(self) -> None:
        self.hear(News([signal_keys.WAKE_ALL]))

    @contextlib.contextmanager
    def watching(self, keys: list[str]) -> Iterator[Waiter]:
        """A waiter woken by pings of ``keys`` while the block runs (a stream reader keeps one for
        its whole life instead of registering anew for every batch)."""
        waiter = Waiter(self.ticks)
        for key in keys:
            self.add(key, waiter)
        try:
            yield waiter
        finally:
            for key in keys:
                self.remove(key, waiter)


class Outage:
    """How long a waiter has been unable to reach the database. A wait rides out an outage (a
    restart, a failover) as "nothing yet"; only one that lasts ``OUTAGE_LIMIT`` seconds, or an error
    that is no outage, fails it."""

    def __init__(self) -> None:
        self._since: float | None = None

    def over(self) -> None:
        self._since = None

    def bear(self, exc: psycopg.Error) -> None:
        """Note a failed look at the table; raise ``exc`` when it is not to be borne."""
        now = time.monotonic()
        self._since = self._since or now
        if not unreachable(exc) or now - self._since > OUTAGE_LIMIT:
            raise exc
        log.warning("cannot reach the database (%s); retrying", exc)


async def until(waiter: Waiter, check: Callable[[], Awaitable[T | None]], timeout: float | None,
                poll: float) -> T | None:
    """Re-run ``check`` whenever ``waiter`` is woken, and on the poll (every ``poll`` seconds), until
    it returns something other than None or ``timeout`` passes (then None).

    A check that fails to reach the database (a restart, a dropped connection) counts as "not yet":
    waiting goes on, and only a database unreachable for ``OUTAGE_LIMIT`` seconds fails it.
    """
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    outage = Outage()
    while True:
        waiter.arm()
        try:
            found = await check()
            outage.over()
        except psycopg.Error as exc:
            outage.bear(exc)
            found = None
        if found is not None:
            return found
        if deadline is None:
            await waiter.wait()
            continue
        left = deadline - loop.time()
        if left <= 0:
            return None
        await waiter.wait(left if left < poll else None)
