"""Pings: waiting on a key, and the buffered notifier that tells other processes.

A ping says "go and look at the table"; it carries no truth and may be lost. So pings are gathered in a
set and sent off the hot path in one small transaction every few milliseconds (committing a NOTIFY takes
a cluster-wide lock, which a NOTIFY per write would hold once per write), and every waiter re-reads the
table on a slow poll and whenever the listener reconnects. Waiters in the pinging process are woken
directly, with no round trip.

Keys name what changed: ``wf:<id>`` (a workflow finished or was cancelled), ``q:<queue>`` (work was
enqueued, or fell due), ``s:<id>:<key>`` (a stream grew), ``e:<id>`` (a workflow set an event),
``m:<id>`` (a message was sent to a workflow). ``*`` wakes everybody. Two kinds carry truth, each
sent only by the commit that wrote it: ``o:`` and the end of a workflow (see ``store/ends.py``), so
a caller waiting for its result takes it from the ping instead of reading the row, and ``c:`` and a
small chunk of a stream (see ``streams/pings.py``), so a reader keeping up takes it without a query.

Everything here belongs to one event loop and is only touched from it: no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator
from typing import Any, Protocol, TypeVar

import anyio
import msgspec
import psycopg
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from .news import ENDED, EndNews
from .store import unreachable
from .streams.pings import CARRIED_CHUNK, carried, carried_value

log = logging.getLogger("pgflow.notify")

T = TypeVar("T")
WAKE_ALL = "*"
PAYLOAD_LIMIT = 7900  # Postgres refuses payloads of 8000 bytes or more; keep a margin for framing.
WAKE_ALL_ABOVE = 2000  # keys in one flush beyond which a single "wake all" ping is cheaper
OUTAGE_LIMIT = 60.0  # seconds a waiter tolerates a database it cannot reach
FLUSH_TIMEOUT = 2.0  # seconds a flush waits for a connection before dropping its pings


class Wakeable(Protocol):
    """What a ping or a poll tick wakes: a ``Waiter``, or a stream reader's place in its stream."""

    def wake(self) -> None: ...

    def hand(self, id_length: int, position: int, value: bytes | None) -> None:
        """A ping of the key carried the chunk at ``position`` of the stream of a workflow whose id is
        ``id_length`` long (see ``streams/pings.py``)."""


def new_token() -> str:
    """Names one process's pings, so its own listeners can skip what it already delivered locally."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


class PollTicks:
    """The slow poll of one loop's waiters: one timer for all of them instead of one per wait (a
    reader waits once per batch of chunks). A waiter that waits for the poll is woken at the next
    tick, at most ``every`` seconds later."""

    def __init__(self, every: float = 1.0) -> None:
        self.every = every
        self._loop = asyncio.get_running_loop()
        self._due: set[Wakeable] = set()
        self._timer: asyncio.TimerHandle | None = None

    def add(self, waiter: Wakeable) -> None:
        self._due.add(waiter)
        if self._timer is None:
            self._timer = self._loop.call_later(self.every, self._tick)

    def _tick(self) -> None:
        self._timer = None
        due, self._due = self._due, set()
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

    def hand(self, id_length: int, position: int, value: bytes | None) -> None:
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
    runtime can open its LISTEN connection only while somebody waits."""

    def __init__(self, on_wait: Callable[[], None] = lambda: None) -> None:
        self._by_key: dict[str, set[Wakeable]] = {}
        self._on_wait = on_wait
        self.ticks = PollTicks()
        self.news = EndNews()

    def __len__(self) -> int:
        return len(self._by_key)

    def add(self, key: str, waiter: Wakeable) -> None:
        waiting = self._by_key.get(key)
        if waiting is None:
            waiting = self._by_key[key] = set()
            if key.startswith(ENDED):
                self.news.watch(key[len(ENDED):])
        waiting.add(waiter)
        self._on_wait()

    def remove(self, key: str, waiter: Wakeable) -> None:
        waiting = self._by_key.get(key)
        if waiting is not None:
            waiting.discard(waiter)
            if not waiting:
                del self._by_key[key]
                if key.startswith(ENDED):
                    self.news.unwatch(key[len(ENDED):])

    def wake(self, keys: Collection[str]) -> None:
        self.news.hear(keys)
        if WAKE_ALL in keys:
            self.news.forget()
            for waiting in self._by_key.values():
                for waiter in waiting:
                    waiter.wake()
            return
        for key in keys:
            if key.startswith(CARRIED_CHUNK):
                self._hand(key)
                continue
            for waiter in self._by_key.get(key, ()):
                waiter.wake()

    def _hand(self, key: str) -> None:
        """Give the chunk a ping carried to the readers of its stream (decoded only if there are
        any). A key that does not parse wakes nobody (no process of ours sends one); a value that
        does not decode wakes the stream's readers as a plain ping would."""
        try:
            ping, position, encoded, id_length = carried(key)
        except ValueError:
            return
        waiting = self._by_key.get(ping)
        if not waiting:
            return
        try:
            value = carried_value(encoded)
        except ValueError:
            for waiter in waiting:
                waiter.wake()
            return
        for waiter in waiting:
            waiter.hand(id_length, position, value)

    def wake_all(self) -> None:
        self.wake((WAKE_ALL,))

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


def payloads_for(token: str, keys: Collection[str]) -> list[str]:
    """The NOTIFY payloads announcing ``keys``: one "wake all" when there are very many."""
    if len(keys) > WAKE_ALL_ABOVE:
        return [_payload(token, [WAKE_ALL])]
    return pack(token, keys)


def pack(token: str, keys: Iterable[str]) -> list[str]:
    """Pack keys into few payloads under the NOTIFY limit, each tagged with the sending process's
    token. A batch's keys are encoded at once and halved until each half fits, which costs a few
    encodings of the whole set instead of one per key (a stream batch has a key per chunk)."""
    keys = list(keys)
    return _halves(token, keys) if keys else []


def _halves(token: str, keys: list[str]) -> list[str]:
    whole = msgspec.json.encode([token, keys])
    if len(whole) <= PAYLOAD_LIMIT:
        return [whole.decode()]
    if len(keys) == 1:
        # A key too long for any payload (an enormous workflow id): wake everybody instead.
        return [_payload(token, [WAKE_ALL])]
    middle = len(keys) // 2
    return _halves(token, keys[:middle]) + _halves(token, keys[middle:])


def _payload(token: str, keys: list[str]) -> str:
    return msgspec.json.encode([token, keys]).decode()


def unpack(payload: str) -> tuple[str, list[str]]:
    """(sending process token, keys) of a payload; a foreign payload wakes everybody."""
    try:
        token, keys = msgspec.json.decode(payload, type=tuple[str, list[str]])
    except msgspec.DecodeError:
        return "", [WAKE_ALL]
    return token, keys


class Notifier:
    """Collects pings in memory and sends them to other processes in one background transaction, at
    most one every ``interval``: a ping after a quiet spell goes out at once, and under load the
    pings of a whole interval share one transaction."""

    def __init__(self, pool: Callable[[], Awaitable[AsyncConnectionPool[Any]]], channel: str,
                 interval: float, token: str) -> None:
        self.token = token
        self._pool = pool
        self._channel = channel
        self._interval = interval
        self._pending: set[str] = set()
        self._due = anyio.Event()
        self._last_flush = -1e9
        self._flushing = False
        self._carrying = 0  # statements sending pings with their own commit right now
        self.flushes = 0
        self.failed_flushes = 0

    def carry(self, keys: set[str]) -> list[str]:
        """The payloads a statement about to commit should send itself, when nothing waits for the
        next flush and no other statement of this process is carrying pings (its commit is then the
        quickest way out, with no second transaction); otherwise none, and the keys go to ``add``
        after the commit, to be coalesced with the others. Call ``carried`` once the statement is
        done, however it ended.

        A commit that sends a NOTIFY holds the cluster's notify lock through its flush, so a second
        such commit from this process would only queue behind the first: under load the pings
        coalesce in the notifier, while a caller that starts one workflow after another (each
        statement done before the next) sends each ping with its own commit and waits for no
        interval. A carry still open after an interval (its statement hangs or was abandoned)
        no longer holds the others back."""
        now = anyio.current_time()
        if self._pending or self._flushing or (self._carrying and now - self._last_flush < self._interval):
            return []
        self._carrying += 1
        self._last_flush = now
        return payloads_for(self.token, keys)

    def carried(self) -> None:
        """A statement that was given pings to carry is done."""
        self._carrying = max(0, self._carrying - 1)

    def add(self, keys: Iterable[str]) -> None:
        """Send these keys with the next flush."""
        first = not self._pending
        self._pending.update(keys)
        if first:
            self._due.set()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Flush pings until cancelled, then flush what is left."""
        task_status.started()
        try:
            while True:
                await self._due.wait()
                self._due = anyio.Event()
                await anyio.sleep(max(0.0, self._last_flush + self._interval - anyio.current_time()))
                self._last_flush = anyio.current_time()
                self._flushing = True
                try:
                    with anyio.CancelScope(shield=True):
                        await self.flush()
                finally:
                    self._flushing = False
        finally:
            with anyio.CancelScope(shield=True):
                await self.flush()

    async def flush(self) -> None:
        keys, self._pending = self._pending, set()
        if not keys:
            return
        payloads = payloads_for(self.token, keys)
        try:
            pool = await self._pool()
            async with pool.connection(timeout=FLUSH_TIMEOUT) as conn:
                await conn.execute(
                    "SELECT pg_notify(%s, p) FROM unnest(%b::text[]) AS p", (self._channel, payloads)
                )
            self.flushes += 1
        except (psycopg.Error, OSError, PoolTimeout) as exc:
            # A lost ping costs latency, never data: every waiter re-reads the table on its poll.
            self.failed_flushes += 1
            log.warning("dropped %d pings: %s", len(keys), exc)
