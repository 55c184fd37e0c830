"""The LISTEN connection of one event loop: open while something waits, closed when nothing has.

Autocommit and never inside a transaction (a listener in an open transaction stalls the notification
queue of the whole cluster). It reconnects with a backoff that starts again from the bottom after every
good connection, and wakes every waiter on each (re)connect, since pings sent while it was down are gone.

It listens on the schema's main channel, and on its stream channel too while something on its loop
waits for a stream (until ``idle`` seconds have passed without one): a worker whose workflows read no
stream, or have not for a while, does not receive the chunks of the fleet's batches.

Any role that can connect may send on the channels: a payload is believed only once it opens with the
schema's keyring (``sealing.py``) and was not heard before (``Replays``); anything else is dropped
and counted in ``rejected``.

Between its statements the listener reads its socket itself (``_hear``), beside psycopg's notify
handler, rather than through psycopg's ``notifies()``: pgflow's one bypass of psycopg's listening,
kept here. It uses psycopg's public libpq wrapper only (``pgconn.socket``, ``consume_input``,
``notifies``), so it needs no bound on psycopg's version; its invariant is that nothing else reads the
connection while ``_hear`` waits. What it buys, measured side by side (``python -m benchmarks.bypasses
--only listener,lone``, benchmarks/README.md): a notification costs the listener 1.6x its CPU through
``notifies()``, on uvloop and on asyncio's own loop alike, and a no-op started and awaited back to
back costs its caller 1.14x and its worker 1.13x the CPU.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

import anyio
import psycopg

from ..engine import channel as channel_sql
from ..pool import answered_within
from . import payload
from .sealing import Keyring, Replays
from .waiters import Waiters

log = logging.getLogger("pgflow.signals")

FIRST_BACKOFF = 0.05
MAX_BACKOFF = 5.0


class Listener:
    """Dispatches the news of other processes to the waiters of one loop."""

    def __init__(self, conninfo: Callable[[], str], channels: tuple[str, str], waiters: Waiters,
                 keyring: Keyring, idle: float, health_every: float = 30.0, query_timeout: float = 10.0,
                 wants_keys: Callable[[], None] = lambda: None) -> None:
        self._conninfo = conninfo
        self._channel, self._stream_channel = channels
        self._waiters = waiters
        self._keyring = keyring
        self._idle = idle
        self._health_every = health_every
        self._query_timeout = query_timeout
        self._wants_keys = wants_keys
        self._replays = Replays()
        self.connected = False
        self.reconnects = 0
        self.backend_pid: int | None = None
        self.queue_usage = 0.0
        self.heard = 0
        self.rejected = 0  # payloads that did not open: foreign, forged, garbage, replayed, or a key not loaded
        self.streams = False  # whether this connection listens on the stream channel
        self._streams_unwanted_since: float | None = None  # since when no stream is waited for
        self._hearing: anyio.CancelScope | None = None  # the wait for notifications, while it waits

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
                    self._waiters.ends.forget()
                self.connected = False
                self.streams = False
                self._hearing = None
                self.backend_pid = None
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF)
            self.reconnects += 1

    def want_streams(self) -> None:
        """Something on this loop waits for a stream: listen on the stream channel too (now, if
        connected; otherwise on connecting)."""
        if self.connected and not self.streams and self._hearing is not None:
            self._hearing.cancel()  # the connection is free for a LISTEN once this wait has stopped

    def dispatch(self, text: str, channel: str) -> None:
        """Hand one notification's news (heard on ``channel``) to the waiters, if it opens and is not
        this process's own (those were delivered here directly)."""
        keyring = self._keyring
        if keyring.sender_of(text) == keyring.sender:
            return
        opened = keyring.open(text, channel)
        news = None if opened is None or not self._replays.fresh(opened) else payload.decode(opened.plaintext)
        if news is None:
            self.rejected += 1
            if keyring.unknown_key:  # sealed with a key this process has not loaded: a rotation
                self._wants_keys()
            return
        self.heard += 1
        self._waiters.hear(news)

    def _handed_over(self, note: psycopg.Notify) -> None:
        """A notification psycopg read while a statement of ours ran on the connection."""
        self.dispatch(note.payload, note.channel)

    async def _listen(self) -> bool:
        """Serve one connection; True when it was closed for being idle."""
        conn = await psycopg.AsyncConnection.connect(self._conninfo(), autocommit=True,
                                                     fallback_application_name=f"pgflow-listener-{os.getpid()}")
        async with conn:
            # Notifications that come in while a statement of ours runs on this connection (a LISTEN,
            # the health check) are handed over by psycopg; between them, ``_hear`` reads them itself.
            conn.add_notify_handler(self._handed_over)
            with answered_within(conn, self._query_timeout):
                await channel_sql.listen(conn, self._channel)
            self.backend_pid = conn.info.backend_pid
            self.connected = True
            self.streams = False
            await self._listen_to_streams(conn, wake=False)
            self._waiters.wake_all()
            idle_since: float | None = None
            checked = anyio.current_time()
            tick = min(self._idle, self._health_every, 5.0)
            while True:
                await self._listen_to_streams(conn)  # (a stream waited for since the last look)
                await self._hear(conn, tick)
                now = anyio.current_time()
                await self._unlisten_streams_when_idle(conn, now)
                if len(self._waiters):
                    idle_since = None
                elif idle_since is None:
                    idle_since = now
                elif now - idle_since >= self._idle:
                    return True
                if now - checked >= self._health_every:
                    checked = now
                    await self._check(conn)

    async def _hear(self, conn: psycopg.AsyncConnection[Any], seconds: float) -> None:
        """Dispatch what arrives on ``conn`` for ``seconds``, or until ``want_streams`` cuts the wait
        short; raise when the connection breaks.

        The socket's reader callback reads and dispatches the notifications itself, in the loop's own
        turn: no task to wake and no wait set up anew per notification. (psycopg's ``notifies()``
        registered the socket with the loop and took it off again for every one of them: in a caller
        waiting for a workflow's result, or an idle worker woken by a start, about a tenth of its CPU.)
        Nothing else uses the connection meanwhile: its statements come between these waits."""
        pgconn = conn.pgconn
        loop = asyncio.get_running_loop()
        broken: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            try:
                pgconn.consume_input()
            except psycopg.Error as exc:  # the connection is gone: the wait below ends with it
                if not broken.done():
                    broken.set_exception(exc)
                return
            while (note := pgconn.notifies()) is not None:
                try:
                    self.dispatch(note.extra.decode(errors="replace"), note.relname.decode(errors="replace"))
                except Exception:  # noqa: BLE001 - one payload must not stop the listening
                    log.exception("dispatching a notification failed")

        fd = pgconn.socket
        loop.add_reader(fd, readable)
        try:
            with anyio.CancelScope() as self._hearing, anyio.move_on_after(seconds):
                await broken
        finally:
            self._hearing = None
            loop.remove_reader(fd)

    async def _listen_to_streams(self, conn: psycopg.AsyncConnection[Any], wake: bool = True) -> None:
        """LISTEN on the stream channel when a stream is waited for and this connection does not
        yet; then wake every waiter, since pings sent before the LISTEN passed this loop by."""
        if self.streams or not self._waiters.streams:
            return
        with answered_within(conn, self._query_timeout):
            await channel_sql.listen(conn, self._stream_channel)
        self.streams = True
        self._streams_unwanted_since = None
        if wake:
            self._waiters.wake_all()

    async def _unlisten_streams_when_idle(self, conn: psycopg.AsyncConnection[Any], now: float) -> None:
        """Stop listening on the stream channel once no stream has been waited for in ``idle`` seconds
        (nothing is missed: a later stream wait LISTENs again and wakes every waiter)."""
        if not self.streams or self._waiters.streams:
            self._streams_unwanted_since = None
        elif self._streams_unwanted_since is None:
            self._streams_unwanted_since = now
        elif now - self._streams_unwanted_since >= self._idle:
            with answered_within(conn, self._query_timeout):
                await channel_sql.unlisten(conn, self._stream_channel)
            self.streams = False
            self._streams_unwanted_since = None

    async def _check(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Prove the connection is alive, and say so when the notification queue is filling up."""
        with answered_within(conn, self._query_timeout):  # a frozen link would never say so
            self.queue_usage = await channel_sql.queue_usage(conn)
        if self.queue_usage > 0.5:
            log.warning("the NOTIFY queue is %.0f%% full: a session somewhere in the cluster sits in an open"
                        " transaction after LISTEN (`pgflow status` names the oldest)", self.queue_usage * 100)
