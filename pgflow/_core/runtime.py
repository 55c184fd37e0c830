"""The runtime: what pgflow keeps on each event loop that uses it.

Every loop that touches the database gets its own ``Runtime``: its connection pool (the store), its
signals (waiters, notifier, listener: ``signals/``), its shared stream reads and its counters. An async
caller therefore runs everything on its own loop, with no thread of pgflow's and no hop between
threads; sync callers reach a runtime of their own on a private loop (see ``sync.py``). ``Runtimes``
is the App's set of them, one per loop, and what they share in the process: the configuration, the
keyring that seals pings, the one-time migration.

A runtime opens with its first use, and from then on has a task of its own on its loop, for as long as
it lives: the signals service runs in it (restarted after a failure, which only costs latency: every
wait also polls). Closing the runtime, or the loop's own shutdown, cancels that task, which sends the
last pings and closes the pool; a store used after that refuses, it does not wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from typing import TypeVar

import anyio
import anyio.to_thread
import psycopg
from psycopg_pool import PoolClosed

from . import forks
from .clock import OWNER, Clock
from .connecting import check_connectable, linked
from .engine import Engine, retrying
from .pool import Pool
from .pooler import warn_of_missing_settings
from .registry import Config
from .signals import Keyring, News, Signals
from .streams.reader import ChunkFetcher, StreamRead, read_batches
from .streams.writer import StreamWriter

log = logging.getLogger("pgflow")

T = TypeVar("T")
RESTART_SIGNALS_AFTER = 1.0  # seconds before a failed signals service is started again


@dataclass
class Stats:
    """Counters of an App in this process, summed over its runtimes (``app.stats()``)."""

    runtimes: int = 0
    pool_connections: int = 0
    notify_flushes: int = 0
    notify_failed_flushes: int = 0
    listeners_connected: int = 0
    listener_backends: tuple[int, ...] = ()  # server process ids of the LISTEN connections (pg_stat_activity's pid)
    listener_reconnects: int = 0
    notification_queue_usage: float = 0.0
    pings_rejected: int = 0  # payloads heard that did not open with the keyring (forged, foreign, garbage)
    pings_refused: int = 0  # statements sent again without their pings, which the server refused
    fetch_queries: int = 0
    stream_batches: int = 0
    stream_chunks: int = 0
    end_batches: int = 0  # statements that recorded workflow ends (each records every end ready)
    ends: int = 0
    results_from_pings: int = 0  # results taken from the end their news carried, with no read of the row
    chunks_from_pings: int = 0  # stream chunks taken from the news that carried them, with no query

    def __add__(self, other: Stats) -> Stats:
        summed = Stats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(Stats)})
        summed.notification_queue_usage = max(self.notification_queue_usage, other.notification_queue_usage)
        return summed


class RuntimeClosed(PoolClosed):
    """The runtime of this loop was closed (``app.close()``): its store takes no more statements."""


class Runtime:
    """pgflow on one event loop. Made by ``Runtimes.current()``; only touched from its own loop."""

    def __init__(self, hub: Runtimes) -> None:
        self.hub = hub
        self.loop = asyncio.get_running_loop()
        self.signals = Signals(hub.keyring, lambda news: hub.wake_elsewhere(self, news), lambda: len(hub) <= 1)
        self.fetcher = ChunkFetcher(self.store, self.signals.waiters.ticks)
        self.config: Config | None = None
        self.writers: set[StreamWriter] = set()  # the stream writers of the workers on this loop
        self.retired_writes = (0, 0)  # batches and chunks of the writers of workers that have stopped
        self.end_batches = 0  # batches of ends recorded by the finishers of the workers on this loop
        self.ends = 0
        self._store: Engine | None = None
        self._opening = anyio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    # -- the connection ---------------------------------------------------------------------------------

    async def store(self) -> Engine:
        """The store on this loop's pool, opened (and the schema migrated) on first use."""
        if self._store is None:
            async with self._opening:
                if self._closed:
                    raise RuntimeClosed("this App was closed on this event loop")
                if self._store is None:
                    self._store = await self._open()
        return self._store

    async def _open(self) -> Engine:
        config = await self.hub.config_async()
        if not self.hub.reached:
            # A wrong DSN fails now, and says why.
            await check_connectable(config.dsn, config.query_timeout, session=not config.pooled)
            if config.pooled:
                await check_connectable(config.session_dsn, config.query_timeout)
            self.hub.reached = True
        self.config = config
        pool = Pool(config)
        await pool.open(wait=True, timeout=30)
        store = Engine(pool, config.schema)
        try:
            if config.pooled and not self.hub.pooled_checked:
                self.hub.pooled_checked = True
                await warn_of_missing_settings(pool, config.query_timeout)
            await self.hub.migrate_once(store)
            await self.hub.load_keys(store)
        except BaseException:
            await pool.close()
            raise

        async def opened_pool() -> Pool:
            return pool

        self.signals.start(config, opened_pool, lambda: linked(config.session_dsn, config.query_timeout),
                           store.channel.signal_keys)
        self._task = self.loop.create_task(self._live(pool), name="pgflow runtime")
        return store

    async def server_on_this_machine(self) -> bool:
        """Whether the server runs on this machine, sharing its cores, which decides how a worker's stream
        writer batches (``streams/writer.py``): the App's ``server_on_this_machine`` when it says, else
        the guess from the connection's address (``connecting.on_this_machine``), which cannot see a
        server in a container of this machine reached through a bridge address, nor a loopback tunnel
        to a server elsewhere."""
        store = await self.store()
        assert self.config is not None  # (set by the store's opening)
        if self.config.server_on_this_machine is not None:
            return self.config.server_on_this_machine
        return await store.db.on_this_machine()

    async def db(self, fn: Callable[[Engine], Awaitable[T]]) -> T:
        """``fn(store)``, tried again while the server cannot be reached; ``fn`` must be idempotent."""
        store = await self.store()
        return await retrying(lambda: fn(store), "a query")

    async def _live(self, pool: Pool) -> None:
        """The runtime's life on its loop: the signals service until the runtime closes (or the loop
        shuts down), then the pool closes."""
        try:
            while True:
                try:
                    await self.signals.run()
                except Exception:  # noqa: BLE001 - its waiters poll meanwhile; the pool is not its to close
                    log.exception("pgflow's signals failed; waiters fall back to their poll until they are back")
                    await anyio.sleep(RESTART_SIGNALS_AFTER)
        finally:
            self._closed = True
            with anyio.CancelScope(shield=True):
                await pool.close()

    async def wait_for(self, keys: list[str], check: Callable[[], Awaitable[T | None]],
                       timeout: float | None) -> T | None:
        """Re-run ``check`` on every ping of ``keys`` and on the slow poll, until it returns a value
        (the store opened first: it sets the poll's interval)."""
        await self.store()
        clock = self.hub.clock
        if clock.virtual and OWNER.get() is not None:  # a workflow waiting: on the App's clock, parked
            async def whole_check() -> T | None:  # the timeout cuts the wait, never a check (a receive)
                with anyio.CancelScope(shield=True):
                    found = await check()
                return found

            with clock.move_on_after(timeout, owner=OWNER.get()):
                return await self.signals.wait_for(keys, whole_check, None)
            return None
        return await self.signals.wait_for(keys, check, timeout)

    # -- stream reads -----------------------------------------------------------------------------------

    def read_stream(self, workflow_id: str, key: str, offset: int) -> StreamRead:
        """Batches of chunks of a stream from ``offset`` on, waiting for each, until the stream can
        grow no more. (The first fetch opens the store, which sets the poll interval before any
        reader waits for a tick.)"""
        return read_batches(self.fetcher, self.signals.waiters, workflow_id, key, offset)

    # -- closing ----------------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Send pending pings, stop the listener and close the pool; idempotent."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])

    # -- counters ---------------------------------------------------------------------------------------

    def stats(self) -> Stats:
        store = None if self._closed else self._store
        return Stats(
            runtimes=1,
            pool_connections=store.pool.get_stats().get("pool_size", 0) if store is not None else 0,
            fetch_queries=self.fetcher.queries,
            stream_batches=self.retired_writes[0] + sum(w.batches for w in self.writers),
            stream_chunks=self.retired_writes[1] + sum(w.chunks for w in self.writers),
            end_batches=self.end_batches,
            ends=self.ends,
            chunks_from_pings=self.fetcher.handed,
            **self.signals.stats(),
        )

    def count_ends(self, ends: int) -> None:
        """A finisher on this loop recorded a batch of ``ends`` workflow ends."""
        self.end_batches += 1
        self.ends += ends

    def retire(self, writer: StreamWriter) -> None:
        self.writers.discard(writer)
        self.retired_writes = (self.retired_writes[0] + writer.batches, self.retired_writes[1] + writer.chunks)


class Runtimes:
    """An App's runtimes, one per event loop, and what they share in this process."""

    def __init__(self, config: Callable[[], Config], schema: str, config_blocks: bool = False) -> None:
        self._make_config = config
        self._config_blocks = config_blocks
        self._config: Config | None = None
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._closing: set[asyncio.Task[None]] = set()  # closings ``close`` could not wait for
        self._by_loop: dict[asyncio.AbstractEventLoop, Runtime] = {}
        forks.watch(self)
        self._migrated = False
        self.reached = False  # the server answered once: later failures are outages, waited out
        self.pooled_checked = False  # the pooler's server sessions were looked at (Config.pooled)
        self.keyring = Keyring(Config.channel_of(schema))
        self.clock = Clock()  # the time this App's timers follow here (pgflow.testing moves it)

    def reset(self, config: Callable[[], Config], schema: str, config_blocks: bool = False) -> None:
        """Serve another configuration from now on, with a fresh clock (``pgflow.testing`` points an
        App at a test's schema and back). Only between uses: every runtime must be closed."""
        with self._lock:
            if any(not loop.is_closed() for loop in self._by_loop):
                raise RuntimeError("close the App (app.close()) before pointing it elsewhere")
            self._by_loop.clear()
            self._make_config, self._config_blocks, self._config = config, config_blocks, None
            self._migrated = self.reached = self.pooled_checked = False
            self.keyring = Keyring(Config.channel_of(schema))
            self.clock = Clock()

    def forked(self) -> None:
        """In a forked child: the parent's runtimes (their loops do not run here, their pools are the
        parent's sessions) are left alone, and this process opens its own on first use."""
        forks.keep_inherited(self._by_loop, self._closing)
        self._by_loop, self._closing = {}, set()
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def config(self) -> Config:
        """The configuration; resolving it may start the embedded server (blocking)."""
        with self._lock:
            if self._config is None:
                self._config = self._make_config()
            return self._config

    async def config_async(self) -> Config:
        if self._config is not None or not self._config_blocks:
            return self.config()
        # Only the embedded default has work to do here (starting a server): keep it off the loop.
        return await anyio.to_thread.run_sync(self.config)

    def current(self) -> Runtime:
        """The runtime of the running event loop, made on first use."""
        loop = asyncio.get_running_loop()
        if self._pid != os.getpid():  # forked by a hook-less fork (uWSGI's)
            self.forked()
        runtime = self._by_loop.get(loop)
        if runtime is None:
            with self._lock:
                for old in [old for old in self._by_loop if old.is_closed()]:
                    del self._by_loop[old]
                runtime = self._by_loop.setdefault(loop, Runtime(self))
        return runtime

    async def migrate_once(self, store: Engine) -> None:
        if not self._migrated:
            await store.migrations.migrate()
            self._migrated = True

    async def load_keys(self, store: Engine) -> None:
        """Load the keyring once per process (the signals service reloads it from then on). A role
        that may not read it works on, with pings between processes off: waits poll."""
        if self.keyring.loaded:
            return
        try:
            self.keyring.load(await store.channel.signal_keys())
        except psycopg.errors.InsufficientPrivilege as exc:
            log.warning("cannot read the signal keys (%s): grant this role SELECT on %s.signal_keys; until then"
                        " this process tells other processes of nothing, and hears of them only on its poll",
                        exc, store.schema)

    def __len__(self) -> int:
        return len(self._by_loop)

    def wake_elsewhere(self, origin: Runtime, news: News) -> None:
        """Wake the waiters of this App on the process's other loops directly: their listeners skip
        this process's payloads."""
        if len(self._by_loop) < 2:
            return
        for loop, runtime in list(self._by_loop.items()):
            waiters = runtime.signals.waiters
            if runtime is not origin and len(waiters):
                with contextlib.suppress(RuntimeError):  # that loop has closed: nobody waits there
                    loop.call_soon_threadsafe(waiters.hear, news)

    def stats(self) -> Stats:
        total = Stats()
        for runtime in list(self._by_loop.values()):
            total = total + runtime.stats()
        return total

    async def aclose_current(self) -> None:
        """Close this loop's runtime, and wait for the closings ``close`` left to this loop."""
        loop = asyncio.get_running_loop()
        runtime = self._by_loop.pop(loop, None)
        if runtime is not None:
            await runtime.aclose()
        if closing := [task for task in self._closing if task.get_loop() is loop]:
            await asyncio.wait(closing)

    def elsewhere(self) -> bool:
        """Whether runtimes live on loops other than the running one."""
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        return any(loop is not running and not loop.is_closed() for loop in list(self._by_loop))

    def close(self, timeout: float = 10.0) -> None:
        """Close the runtimes of loops that still run; those of closed loops closed with them. A
        runtime of the calling loop (or of a loop paused between runs) cannot be waited for here: its
        closing is a task this object holds until it ends, which ``aclose_current`` on that loop awaits."""
        with self._lock:
            runtimes, self._by_loop = self._by_loop, {}
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        for loop, runtime in runtimes.items():
            if loop.is_closed():
                continue
            if loop is running:
                self._close_later(runtime)
            elif loop.is_running():
                future = asyncio.run_coroutine_threadsafe(runtime.aclose(), loop)
                with contextlib.suppress(Exception):
                    future.result(timeout)
            else:  # a loop paused between runs (a test runner's): closed as soon as it runs again
                loop.call_soon_threadsafe(self._close_later, runtime)

    def _close_later(self, runtime: Runtime) -> None:
        """Close ``runtime`` in a task of the running loop's, held until it ends."""
        task = asyncio.get_running_loop().create_task(runtime.aclose(), name="pgflow runtime closing")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
