"""The runtime: what pgflow keeps on each event loop that uses it.

Every loop that touches the database gets its own ``Runtime``: a connection pool that belongs to
that loop, the waiters of that loop, its notifier, its LISTEN connection (open only while something
waits) and its shared stream fetcher. An async caller therefore runs everything on its own loop, with
no thread of pgflow's and no hop between threads; sync callers reach a runtime of their own on a
private loop (see ``sync.py``). ``Runtimes`` is the App's set of them, one per loop, and the
process-wide things they share: the configuration, the ping token, the one-time migration.

A runtime's background tasks (the notifier and the listener) belong to one task group in one root
task; closing the runtime, or the loop's own shutdown, cancels that task, which flushes the last pings
and closes the pool and the listener on its way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, fields
from typing import TypeVar

import anyio
import anyio.to_thread

from .connecting import check_connectable, linked
from .listener import Listener
from .notify import Notifier, Waiter, Waiters, new_token, payloads_for, until
from .pool import Pool
from .registry import Config
from .store import NO_PINGS, Pings, Store, retrying
from .streams.reader import ChunkFetcher, StreamRead, read_batches
from .streams.writer import StreamWriter

log = logging.getLogger("pgflow")

T = TypeVar("T")


@dataclass
class Stats:
    """Counters of an App in this process, summed over its runtimes (``app.stats()``)."""

    runtimes: int = 0
    pool_connections: int = 0
    notify_flushes: int = 0
    notify_failed_flushes: int = 0
    listeners_connected: int = 0
    listener_reconnects: int = 0
    notification_queue_usage: float = 0.0
    fetch_queries: int = 0
    stream_batches: int = 0
    stream_chunks: int = 0
    end_batches: int = 0  # statements that recorded workflow ends (each records every end ready)
    ends: int = 0
    results_from_pings: int = 0  # results taken from the end their ping carried, with no read of the row
    chunks_from_pings: int = 0  # stream chunks taken from the ping that carried them, with no query

    def __add__(self, other: Stats) -> Stats:
        summed = Stats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(Stats)})
        summed.notification_queue_usage = max(self.notification_queue_usage, other.notification_queue_usage)
        return summed


class Runtime:
    """pgflow on one event loop. Made by ``Runtimes.current()``; only touched from its own loop."""

    def __init__(self, hub: Runtimes) -> None:
        self.hub = hub
        self.loop = asyncio.get_running_loop()
        self.waiters = Waiters(on_wait=self._want_listener)
        self.fetcher = ChunkFetcher(self.store, self.waiters.ticks)
        self.config: Config | None = None
        self.notifier: Notifier | None = None
        self.listener: Listener | None = None
        self.writers: set[StreamWriter] = set()  # the stream writers of the workers on this loop
        self.retired_writes = (0, 0)  # batches and chunks of the writers of workers that have stopped
        self.end_batches = 0  # batches of ends recorded by the finishers of the workers on this loop
        self.ends = 0
        self._store: Store | None = None
        self._opening = anyio.Lock()
        self._root: asyncio.Task[None] | None = None
        self._listen_wanted = anyio.Event()
        self._listening = False
        self._closed = False

    # -- the pool ---------------------------------------------------------------------------------------

    async def store(self) -> Store:
        """The store on this loop's pool, opened (and the schema migrated) on first use."""
        if self._store is None:
            async with self._opening:
                if self._store is None:
                    self._store = await self._open()
        return self._store

    async def _open(self) -> Store:
        config = await self.hub.config_async()
        if not self.hub.reached:
            await check_connectable(config.dsn)  # a wrong DSN fails now, and says why
            self.hub.reached = True
        self.config = config
        self.waiters.ticks.every = config.poll_interval
        pool = Pool(config)
        await pool.open(wait=True, timeout=30)
        store = Store(pool, config.schema)
        try:
            await self.hub.migrate_once(store)
        except BaseException:
            await pool.close()
            raise
        self.notifier = Notifier(self._pool, config.channel, config.notify_interval, self.hub.token)
        self.listener = Listener(lambda: linked(config.dsn, config.query_timeout), config.channel, self.waiters,
                                 self.hub.token, config.listen_idle, query_timeout=config.query_timeout)
        # The root task owns the pool from now on: when the loop shuts down it closes it.
        self._serve_in_background()
        return store

    async def _pool(self) -> Pool:
        return (await self.store()).pool

    async def db(self, fn: Callable[[Store], Awaitable[T]]) -> T:
        """``fn(store)``, tried again while the server cannot be reached; ``fn`` must be idempotent."""
        store = await self.store()
        return await retrying(lambda: fn(store), "a query")

    # -- pings and waits --------------------------------------------------------------------------------

    def ping(self, keys: Iterable[str]) -> None:
        """Wake this process's waiters now and every other process's within a notifier interval."""
        keys = set(keys)
        self.wake_here(keys)
        if self.notifier is not None and self.config is not None and self.config.notify != "off":
            self._serve_in_background()
            self.notifier.add(keys)

    @contextlib.contextmanager
    def carrying(self, keys: set[str]) -> Iterator[Pings]:
        """Pings for a statement run in the block to send with its own commit, when the notifier is
        quiet (see ``Notifier.carry``); pass them to ``announced`` after the commit."""
        if self.notifier is None or self.config is None or self.config.notify == "off":
            yield NO_PINGS
            return
        notifier = self.notifier
        payloads = notifier.carry(keys)
        try:
            yield (self.config.channel, payloads) if payloads else NO_PINGS
        finally:
            if payloads:
                notifier.carried()

    def announced(self, keys: set[str], carried: Pings) -> None:
        """After the commit of a statement that carried ``carried``: wake this process's waiters, and
        have the notifier send what the statement did not."""
        if carried[1]:
            self.wake_here(keys)
        else:
            self.ping(keys)

    def wake_here(self, keys: set[str]) -> None:
        """Wake the waiters of this process (on every loop), with no round trip."""
        self.waiters.wake(keys)
        self.hub.wake_elsewhere(self, keys)

    def hearing(self) -> int | None:
        """While this loop's listener listens, the epoch of what it heard (see ``EndNews``); None
        when it does not, so pings may pass it by."""
        if self.ping_token() is None or self.listener is None or not self.listener.connected:
            return None
        if len(self.hub) > 1:
            # Another loop of this process may end the workflow, and its pings reach this loop only
            # while something here waits (the listener skips the process's own).
            return None
        return self.waiters.news.epoch

    def ping_token(self) -> str | None:
        """What this process's pings are signed with; None when it pings no other process."""
        if self.config is None or self.config.notify == "off":
            return None
        return self.hub.token

    def payloads(self, keys: Collection[str]) -> list[str]:
        """The NOTIFY payloads that tell other processes of ``keys`` (none with notify="off")."""
        token = self.ping_token()
        return [] if token is None else payloads_for(token, keys)

    async def wait_for(self, keys: list[str], check: Callable[[], Awaitable[T | None]],
                       timeout: float | None) -> T | None:
        """Re-run ``check`` on every ping of ``keys`` and on the slow poll, until it returns a value."""
        with self.waiters.watching(keys) as waiter:
            return await self.until(waiter, check, timeout)

    async def until(self, waiter: Waiter, check: Callable[[], Awaitable[T | None]],
                    timeout: float | None) -> T | None:
        """Re-run ``check`` whenever ``waiter`` is woken and on the slow poll, until it returns a value."""
        if self.config is None:
            await self.store()
        assert self.config is not None
        return await until(waiter, check, timeout, self.config.poll_interval)

    def read_stream(self, workflow_id: str, key: str, offset: int) -> StreamRead:
        """Batches of chunks of a stream from ``offset`` on, waiting for each, until the stream can
        grow no more. (The first fetch opens the store, which sets the poll interval before any
        reader waits for a tick.)"""
        return read_batches(self.fetcher, self.waiters, workflow_id, key, offset)

    def _want_listener(self) -> None:
        if not self._listening:
            self._listening = True
            self._serve_in_background()
            self._listen_wanted.set()

    # -- background tasks -------------------------------------------------------------------------------

    def _serve_in_background(self) -> None:
        if (self._root is None or self._root.done()) and not self._closed:
            self._root = self.loop.create_task(self._serve(), name="pgflow runtime")

    async def _serve(self) -> None:
        """The notifier, and the listener whenever something waits, until cancelled; then the last
        pings go out and every connection is closed."""
        try:
            await self.store()
            assert self.notifier is not None and self.listener is not None
            async with anyio.create_task_group() as group:
                group.start_soon(self.notifier.run)
                while True:
                    await self._listen_wanted.wait()
                    self._listen_wanted = anyio.Event()
                    try:
                        await self.listener.run()  # returns once nothing has waited for a while
                    finally:
                        self._listening = False
        except Exception:
            log.exception("pgflow's notifier or listener failed; waiters fall back to their poll")
        finally:
            with anyio.CancelScope(shield=True):
                await self._close_pool()

    async def _close_pool(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            await store.pool.close()

    async def aclose(self) -> None:
        """Flush pending pings, stop the listener and close the pool; idempotent."""
        self._closed = True
        root, self._root = self._root, None
        if root is not None and not root.done():
            root.cancel()
            await asyncio.wait([root])
        await self._close_pool()

    def stats(self) -> Stats:
        pool = self._store.pool if self._store is not None else None
        listener, notifier = self.listener, self.notifier
        return Stats(
            runtimes=1,
            pool_connections=pool.get_stats().get("pool_size", 0) if pool is not None else 0,
            notify_flushes=notifier.flushes if notifier else 0,
            notify_failed_flushes=notifier.failed_flushes if notifier else 0,
            listeners_connected=int(bool(listener and listener.connected)),
            listener_reconnects=listener.reconnects if listener else 0,
            notification_queue_usage=listener.queue_usage if listener else 0.0,
            fetch_queries=self.fetcher.queries,
            stream_batches=self.retired_writes[0] + sum(w.batches for w in self.writers),
            stream_chunks=self.retired_writes[1] + sum(w.chunks for w in self.writers),
            end_batches=self.end_batches,
            ends=self.ends,
            results_from_pings=self.waiters.news.taken,
            chunks_from_pings=self.fetcher.handed,
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

    def __init__(self, config: Callable[[], Config], config_blocks: bool = False) -> None:
        self._make_config = config
        self._config_blocks = config_blocks
        self._config: Config | None = None
        self._lock = threading.Lock()
        self._by_loop: dict[asyncio.AbstractEventLoop, Runtime] = {}
        self._migrated = False
        self.reached = False  # the server answered once: later failures are outages, waited out
        self.token = new_token()

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
        runtime = self._by_loop.get(loop)
        if runtime is None:
            with self._lock:
                for old in [old for old in self._by_loop if old.is_closed()]:
                    del self._by_loop[old]
                runtime = self._by_loop.setdefault(loop, Runtime(self))
        return runtime

    async def migrate_once(self, store: Store) -> None:
        if not self._migrated:
            await store.migrate()
            self._migrated = True

    def __len__(self) -> int:
        return len(self._by_loop)

    def wake_elsewhere(self, origin: Runtime, keys: set[str]) -> None:
        """Wake the waiters of this App on the process's other loops directly: their listeners skip
        this process's pings."""
        if len(self._by_loop) < 2:
            return
        for loop, runtime in list(self._by_loop.items()):
            if runtime is not origin and len(runtime.waiters):
                with contextlib.suppress(RuntimeError):  # that loop has closed: nobody waits there
                    loop.call_soon_threadsafe(runtime.waiters.wake, keys)

    def stats(self) -> Stats:
        total = Stats()
        for runtime in list(self._by_loop.values()):
            total = total + runtime.stats()
        return total

    async def aclose_current(self) -> None:
        loop = asyncio.get_running_loop()
        runtime = self._by_loop.pop(loop, None)
        if runtime is not None:
            await runtime.aclose()

    def elsewhere(self) -> bool:
        """Whether runtimes live on loops other than the running one."""
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        return any(loop is not running and not loop.is_closed() for loop in list(self._by_loop))

    def close(self, timeout: float = 10.0) -> None:
        """Close the runtimes of loops that still run; those of closed loops closed with them."""
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
                loop.create_task(runtime.aclose())  # cannot block the loop we are called from
            elif loop.is_running():
                future = asyncio.run_coroutine_threadsafe(runtime.aclose(), loop)
                with contextlib.suppress(Exception):
                    future.result(timeout)
            else:  # a loop paused between runs (a test runner's): closed as soon as it runs again
                loop.call_soon_threadsafe(loop.create_task, runtime.aclose())
