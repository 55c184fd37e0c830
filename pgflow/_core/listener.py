"""The LISTEN connection of one event loop: open while something waits, closed when nothing has.

Autocommit and never inside a transaction (a listener in an open transaction stalls the notification
queue of the whole cluster). It reconnects with a backoff that starts again from the bottom after every
good connection, and wakes every waiter on each (re)connect, since pings sent while it was down are gone.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import anyio
import psycopg

from .notify import Waiters, unpack
from .pool import answered_within

log = logging.getLogger("pgflow.notify")

FIRST_BACKOFF = 0.05
MAX_BACKOFF = 5.0


class Listener:
    """Dispatches the pings of other processes to the waiters of one loop."""

    def __init__(self, conninfo: Callable[[], str], channel: str, waiters: Waiters, token: str,
                 idle: float, health_every: float = 30.0, query_timeout: float = 10.0) -> None:
        self._conninfo = conninfo
        self._channel = channel
        self._waiters = waiters
        self._token = token
        self._idle = idle
        self._health_every = health_every
        self._query_timeout = query_timeout
        self.connected = False
        self.reconnects = 0
        self.backend_pid: int | None = None
        self.queue_usage = 0.0

    async def run(self) -> None:
        """Listen until nobody has waited for ``idle`` seconds; reconnect while somebody waits."""
        backoff = FIRST_BACKOFF
        while True:
            try:
                if await self._listen():
                    return
            except (psycopg.Error, OSError) as exc:
                if self.connected:  # it was a good connection: this outage starts a fresh backoff
                    backoff = FIRST_BACKOFF
                log.warning("listener connection lost (%s); reconnecting in %.2fs", exc, backoff)
            finally:
                if self.connected:  # pings from now on pass this loop by
                    self._waiters.news.forget()
                self.connected = False
                self.backend_pid = None
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF)
            self.reconnects += 1

    async def _listen(self) -> bool:
        """Serve one connection; True when it was closed for being idle."""
        conn = await psycopg.AsyncConnection.connect(self._conninfo(), autocommit=True,
                                                     application_name=f"pgflow-listener-{os.getpid()}")
        async with conn:
            with answered_within(conn, self._query_timeout):
                await conn.execute(f'LISTEN "{self._channel}"')
            self.backend_pid = conn.info.backend_pid
            self.connected = True
            self._waiters.wake_all()
            idle_since: float | None = None
            checked = anyio.current_time()
            tick = min(self._idle, self._health_every, 5.0)
            while True:
                async for note in conn.notifies(timeout=tick):
                    token, keys = unpack(note.payload)
                    if token != self._token:
                        self._waiters.wake(keys)
                now = anyio.current_time()
                if len(self._waiters):
                    idle_since = None
                elif idle_since is None:
                    idle_since = now
                elif now - idle_since >= self._idle:
                    return True
                if now - checked >= self._health_every:
                    checked = now
                    await self._check(conn)

    async def _check(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Prove the connection is alive, and say so when the notification queue is filling up."""
        with answered_within(conn, self._query_timeout):  # a frozen link would never say so
            cur = await conn.execute("SELECT pg_notification_queue_usage()")
            row = await cur.fetchone()
        self.queue_usage = float(row[0]) if row else 0.0
        if self.queue_usage > 0.5:
            log.warning("the NOTIFY queue is %.0f%% full: a listener somewhere is stuck in a transaction",
                        self.queue_usage * 100)
