"""Pings: the buffered notifier, the per-process listener, and waiting on a key.

A ping says "go and look at the table"; it carries no truth and may be lost. So pings are gathered in a
set and sent off the hot path in one small transaction every few milliseconds (committing a NOTIFY takes
a cluster-wide lock, which a NOTIFY per write would hold once per write), and every waiter re-reads the
table on a slow poll and whenever the listener reconnects. Waiters in the pinging process are woken
directly, with no round trip.

Keys name what changed: ``wf:<id>`` (a workflow finished or was cancelled), ``q:<queue>`` (work was
enqueued), ``s:<id>:<key>`` (a stream grew). ``*`` wakes everybody.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Literal, TypeVar

import anyio
import msgspec
import psycopg
from psycopg_pool import AsyncConnectionPool, PoolTimeout

log = logging.getLogger("pgflow.notify")

T = TypeVar("T")
NotifyMode = Literal["buffered", "inline", "off"]
WAKE_ALL = "*"
PAYLOAD_LIMIT = 7900  # Postgres refuses payloads of 8000 bytes or more; keep a margin for framing.
WAKE_ALL_ABOVE = 2000  # keys in one flush beyond which a single "wake all" ping is cheaper
OUTAGE_LIMIT = 60.0  # seconds a waiter tolerates a database it cannot reach
FLUSH_TIMEOUT = 2.0  # seconds a flush waits for a connection before dropping its pings


def new_token() -> str:
    """Names one engine's pings, so its own listener can skip what it already delivered locally."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Waiter:
    """One coroutine waiting for pings on one key, woken safely from any thread."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._event = anyio.Event()

    def arm(self) -> None:
        """Start a new wait; call before re-reading the table so no ping after the read is missed."""
        self._event = anyio.Event()

    def wake(self) -> None:
        _wake_all_of([self])

    def set(self) -> None:
        """Wake it; only on its own loop."""
        self._event.set()

    async def wait(self, timeout: float) -> None:
        with anyio.move_on_after(timeout):
            await self._event.wait()


def _wake_all_of(waiters: Iterable[Waiter]) -> None:
    """Wake waiters directly on the running loop, and with one call per other loop (each cross-thread
    call costs a system call, and a busy listener wakes thousands of waiters a second)."""
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    elsewhere: dict[asyncio.AbstractEventLoop, list[Waiter]] = {}
    for waiter in waiters:
        if waiter.loop is running:
            waiter.set()
        else:
            elsewhere.setdefault(waiter.loop, []).append(waiter)
    for loop, batch in elsewhere.items():
        try:
            loop.call_soon_threadsafe(_set_each, batch)
        except RuntimeError:  # that loop has closed: nobody is waiting there any more
            pass


def _set_each(waiters: list[Waiter]) -> None:
    for waiter in waiters:
        waiter.set()


class Waiters:
    """The waiters of a process, by key; dispatch may come from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[str, set[Waiter]] = {}

    def add(self, key: str, waiter: Waiter) -> None:
        with self._lock:
            self._by_key.setdefault(key, set()).add(waiter)

    def remove(self, key: str, waiter: Waiter) -> None:
        with self._lock:
            waiting = self._by_key.get(key)
            if waiting is not None:
                waiting.discard(waiter)
                if not waiting:
                    del self._by_key[key]

    def wake(self, keys: Iterable[str]) -> None:
        with self._lock:
            if WAKE_ALL in keys:
                woken = [w for ws in self._by_key.values() for w in ws]
            else:
                woken = [w for k in keys for w in self._by_key.get(k, ())]
        _wake_all_of(woken)

    def wake_all(self) -> None:
        self.wake((WAKE_ALL,))

    async def wait_for(
        self, keys: list[str], check: Callable[[], Awaitable[T | None]], timeout: float | None,
        poll: float,
    ) -> T | None:
        """Re-run ``check`` whenever one of ``keys`` is pinged, and every ``poll`` seconds, until it
        returns something other than None or ``timeout`` passes (then None).

        A check that fails to reach the database (a restart, a dropped connection) counts as "not
        yet": waiting goes on, and only a database unreachable for ``OUTAGE_LIMIT`` seconds fails it.
        """
        waiter = Waiter()
        for key in keys:
            self.add(key, waiter)
        try:
            deadline = None if timeout is None else anyio.current_time() + timeout
            failing_since: float | None = None
            while True:
                waiter.arm()
                try:
                    found = await check()
                    failing_since = None
                except psycopg.OperationalError as exc:
                    now = anyio.current_time()
                    failing_since = failing_since or now
                    if now - failing_since > OUTAGE_LIMIT:
                        raise
                    log.warning("cannot reach the database (%s); retrying", exc)
                    found = None
                if found is not None:
                    return found
                wait = poll
                if deadline is not None:
                    left = deadline - anyio.current_time()
                    if left <= 0:
                        return None
                    wait = min(wait, left)
                await waiter.wait(wait)
        finally:
            for key in keys:
                self.remove(key, waiter)


def pack(token: str, keys: Iterable[str]) -> list[str]:
    """Pack keys into as few payloads under the NOTIFY limit as possible, each tagged with the
    sending engine's token."""
    payloads: list[str] = []
    batch: list[str] = []
    size = len(token) + 8
    for key in keys:
        cost = len(msgspec.json.encode(key)) + 1
        if cost + len(token) + 8 > PAYLOAD_LIMIT:
            # A key too long for any payload (an enormous workflow id): wake everybody instead.
            key, cost = WAKE_ALL, 4
        if batch and size + cost > PAYLOAD_LIMIT:
            payloads.append(_payload(token, batch))
            batch, size = [], len(token) + 8
        batch.append(key)
        size += cost
    if batch:
        payloads.append(_payload(token, batch))
    return payloads


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
    """Collects pings in memory and sends them in one background transaction, at most one every
    ``interval``.

    Modes: "buffered" (the default); "inline", where stream batches send their NOTIFY inside their
    own transaction and other pings go out without waiting for the interval (the naive design, for
    comparison); "off", where other processes learn of changes only by their poll.
    """

    def __init__(
        self, pool: AsyncConnectionPool[Any], channel: str, waiters: Waiters, interval: float,
        mode: NotifyMode, token: str,
    ) -> None:
        self.token = token
        self._pool = pool
        self._channel = channel
        self._waiters = waiters
        self._interval = interval
        self._mode = mode
        self._lock = threading.Lock()
        self._pending: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._due = anyio.Event()
        self._last_flush = -1e9
        self.flushes = 0
        self.failed_flushes = 0

    def ping(self, keys: Iterable[str]) -> None:
        """Wake this process's waiters now and the other processes' soon. Safe from any thread."""
        keys = list(keys)
        self._waiters.wake(keys)
        if self._mode == "off":
            return
        with self._lock:
            first = not self._pending
            self._pending.update(keys)
        if first and self._loop is not None:
            self._loop.call_soon_threadsafe(self._due.set)

    @property
    def interval(self) -> float:
        return 0.0 if self._mode == "inline" else self._interval

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Flush pings until cancelled, then flush what is left."""
        self._loop = asyncio.get_running_loop()
        task_status.started()
        try:
            while True:
                await self._due.wait()
                self._due = anyio.Event()
                # At most one flush per interval: a ping after a quiet spell goes out at once, and
                # under load the pings of a whole interval share one transaction.
                await anyio.sleep(max(0.0, self._last_flush + self.interval - anyio.current_time()))
                self._last_flush = anyio.current_time()
                with anyio.CancelScope(shield=True):
                    await self.flush()
        finally:
            with anyio.CancelScope(shield=True):
                await self.flush()

    async def flush(self) -> None:
        with self._lock:
            keys, self._pending = self._pending, set()
        if not keys:
            return
        payloads = [_payload(self.token, [WAKE_ALL])] if len(keys) > WAKE_ALL_ABOVE else pack(self.token, keys)
        try:
            async with self._pool.connection(timeout=FLUSH_TIMEOUT) as conn:
                await conn.execute(
                    "SELECT pg_notify(%s, p) FROM unnest(%s::text[]) AS p", (self._channel, payloads)
                )
            self.flushes += 1
        except (psycopg.Error, OSError, PoolTimeout) as exc:
            # A lost ping costs latency, never data: every waiter re-reads the table on its poll.
            self.failed_flushes += 1
            log.warning("dropped %d pings: %s", len(keys), exc)


class Listener:
    """The process's one LISTEN connection, dispatching pings to its waiters by key."""

    def __init__(
        self, conninfo: str, channel: str, waiters: Waiters, token: str, health_every: float = 30.0,
    ) -> None:
        self._token = token
        self._conninfo = conninfo
        self._channel = channel
        self._waiters = waiters
        self._health_every = health_every
        self.connected = anyio.Event()
        self.reconnects = 0
        self.backend_pid: int | None = None

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled, reconnecting with backoff; waiters are woken on every reconnect,
        since pings sent while the connection was down are gone."""
        task_status.started()
        backoff = 0.05
        while True:
            try:
                await self._listen()
            except (psycopg.Error, OSError) as exc:
                log.warning("listener connection lost (%s); reconnecting in %.2fs", exc, backoff)
            self.connected = anyio.Event()
            self.backend_pid = None
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
            self.reconnects += 1

    async def _listen(self) -> None:
        conn = await psycopg.AsyncConnection.connect(self._conninfo, autocommit=True)
        async with conn:
            await conn.execute(f'LISTEN "{self._channel}"')
            self.backend_pid = conn.info.backend_pid
            self.connected.set()
            self._waiters.wake_all()
            while True:
                async for note in conn.notifies(timeout=self._health_every):
                    token, keys = unpack(note.payload)
                    if token != self._token:
                        self._waiters.wake(keys)
                await self._check(conn)

    async def _check(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Prove the connection is alive, and say so when the notification queue is filling up."""
        cur = await conn.execute("SELECT pg_notification_queue_usage()")
        row = await cur.fetchone()
        usage = float(row[0]) if row else 0.0
        if usage > 0.5:
            log.warning("the NOTIFY queue is %.0f%% full: a listener somewhere is stuck in a transaction",
                        usage * 100)
