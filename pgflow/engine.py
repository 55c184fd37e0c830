"""The per-App runtime: connection pools, the notifier, the listener, and the engine's own loop.

Everything that is one per process runs on the engine's loop, in a daemon thread started on first use:
the pool that callers use, the notifier and the one LISTEN connection. Sync calls run the async
implementation on that loop through a blocking portal, so the sync and async APIs cannot drift apart;
async calls from any other loop hop there and back without tying up a thread. psycopg's async
connections belong to the loop that opened them, so a worker, whose hot paths must not hop, gets a
pool on its own loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal
from psycopg_pool import AsyncConnectionPool

from .notify import Listener, Notifier, NotifyMode, Waiters, new_token
from .store import Store, retrying

log = logging.getLogger("pgflow")

T = TypeVar("T")


@dataclass(frozen=True)
class Config:
    dsn: str
    schema: str = "pgflow"
    pool_size: int = 10
    notify: NotifyMode = "buffered"
    notify_interval: float = 0.005
    poll_interval: float = 1.0

    @property
    def channel(self) -> str:
        return f"pgflow_{self.schema}"


IDLE_CHECK_AFTER = 2.0  # seconds a pooled connection may sit unused before it is checked on checkout
_returned: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()


async def _note_return(conn: Any) -> None:
    _returned[conn] = time.monotonic()


async def _check_if_idle(conn: Any) -> None:
    """Check a connection on checkout only when it sat idle a while (a restart may have killed it):
    a check on every checkout costs a round trip per query. A connection that died in the last
    moments fails its query instead, which the idempotent operations retry."""
    if time.monotonic() - _returned.get(conn, 0.0) > IDLE_CHECK_AFTER:
        await AsyncConnectionPool.check_connection(conn)


_outbox_lock = threading.Lock()
_outboxes: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], asyncio.Task[Any]]]] = {}


def _answer_later(caller: asyncio.AbstractEventLoop, answer: asyncio.Future[Any], done: asyncio.Task[Any]) -> None:
    """Hand a finished task's outcome to the loop that awaits it. Runs on the engine's loop; the
    answers finished in one pass of that loop (a shared fetch answers hundreds of readers at once)
    cross to their loop in one call instead of one each."""
    with _outbox_lock:
        outbox = _outboxes.setdefault(caller, [])
        outbox.append((answer, done))
        first = len(outbox) == 1
    if first:
        try:
            caller.call_soon_threadsafe(_deliver, caller)
        except RuntimeError:  # the caller's loop has closed: nobody is waiting any more
            with _outbox_lock:
                _outboxes.pop(caller, None)


def _deliver(caller: asyncio.AbstractEventLoop) -> None:
    with _outbox_lock:
        answers = _outboxes.pop(caller, [])
    for answer, done in answers:
        if answer.done():
            continue
        if done.cancelled():
            answer.cancel()
        elif done.exception() is not None:
            answer.set_exception(done.exception())  # type: ignore[arg-type]
        else:
            answer.set_result(done.result())


class Engine:
    """Owns every connection and background task of one App; ``close`` stops them all.

    Callers on any loop reach the database through ``db``, which runs the query on the engine's loop
    without tying up a thread; only workers, whose hot paths (step records, stream batches) must not
    hop between loops, get a pool on their own loop (``store``).
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self.waiters = Waiters()
        self._lock = threading.Lock()
        self._stores: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Store] = (
            weakref.WeakKeyDictionary()
        )
        self._holders: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, int] = (
            weakref.WeakKeyDictionary()
        )
        self._migrated = False
        self._portal_cm: contextlib.AbstractContextManager[BlockingPortal] | None = None
        self._portal: BlockingPortal | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: anyio.Event | None = None
        self._background: Future[None] | None = None
        self.notifier: Notifier | None = None
        self.listener: Listener | None = None

    # -- the engine's own loop --------------------------------------------------------------------------

    def portal(self) -> BlockingPortal:
        """The engine loop, started on first use together with the notifier and the listener."""
        with self._lock:
            if self._portal is None:
                self._portal_cm = start_blocking_portal(name="pgflow-engine")
                portal = self._portal_cm.__enter__()
                try:
                    self._background, _ = portal.start_task(self._run_background)
                except BaseException:
                    self._portal_cm.__exit__(None, None, None)
                    raise
                self._portal = portal
            return self._portal

    async def _run_background(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """The notifier and the listener, until ``close``: then a last flush of pending pings."""
        self._loop = asyncio.get_running_loop()
        self._stop = anyio.Event()
        store = await self.store()
        token = new_token()
        self.notifier = Notifier(store.pool, self.config.channel, self.waiters, self.config.notify_interval,
                                 self.config.notify, token)
        self.listener = Listener(self.config.dsn, self.config.channel, self.waiters, token)
        try:
            async with anyio.create_task_group() as group:
                await group.start(self.notifier.run)
                await group.start(self.listener.run)
                task_status.started()
                await self._stop.wait()
                group.cancel_scope.cancel()
        except Exception:
            log.exception("pgflow's notifier or listener failed; waiters fall back to their poll")
            raise
        finally:
            await self.close_loop()

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run an async implementation to completion from sync code."""
        return self.portal().call(fn, *args)

    async def db(self, fn: Callable[[Store], Awaitable[T]]) -> T:
        """Run ``fn(store)`` on the engine's loop, from whichever loop calls. ``fn`` must be
        idempotent: it is tried again while the server cannot be reached."""

        async def with_store() -> T:
            store = await self.store()
            return await retrying(lambda: fn(store), "a query")

        return await self.on_engine_loop(with_store)

    async def on_engine_loop(self, fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Await ``fn()`` run on the engine's loop: one hop there and one back, with no thread tied
        up, however long it waits."""
        if self._loop is None:
            await anyio.to_thread.run_sync(self.portal)
        assert self._loop is not None
        engine_loop = self._loop
        caller = asyncio.get_running_loop()
        if caller is engine_loop:
            return await fn()
        answer: asyncio.Future[T] = caller.create_future()
        tasks: list[asyncio.Task[T]] = []

        def start() -> None:
            task = engine_loop.create_task(fn())
            task.add_done_callback(lambda done: _answer_later(caller, answer, done))
            tasks.append(task)

        engine_loop.call_soon_threadsafe(start)
        try:
            return await answer
        except asyncio.CancelledError:
            engine_loop.call_soon_threadsafe(lambda: [task.cancel() for task in tasks])
            raise

    def ping(self, *keys: str) -> None:
        """Wake this process's waiters now and every other process's within a notifier interval."""
        self.portal()
        assert self.notifier is not None
        self.notifier.ping(keys)

    async def wait_for(
        self, keys: list[str], check: Callable[[], Awaitable[T | None]], timeout: float | None,
    ) -> T | None:
        """Re-run ``check`` on every ping of ``keys`` and on the slow poll, until it returns a value."""
        if self.listener is None:
            await anyio.to_thread.run_sync(self.portal)
        return await self.waiters.wait_for(keys, check, timeout, self.config.poll_interval)

    # -- pools: the engine's, and one per worker loop ---------------------------------------------------

    async def store(self) -> Store:
        """The store bound to the running event loop, created (and the schema migrated) on first use."""
        loop = asyncio.get_running_loop()
        store = self._stores.get(loop)
        if store is None:
            pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
                self.config.dsn, min_size=1, max_size=self.config.pool_size, open=False,
                kwargs={"autocommit": True}, name=f"pgflow-{self.config.schema}",
                check=_check_if_idle, reset=_note_return,
            )
            await pool.open(wait=True, timeout=30)
            store = self._stores.setdefault(loop, Store(pool, self.config.schema))
            if store.pool is not pool:
                await pool.close()
            if not self._migrated:
                await store.migrate()
                self._migrated = True
        return store

    def hold_loop(self) -> None:
        """Count a worker on the running loop, so the loop's pool outlives every worker but the last."""
        loop = asyncio.get_running_loop()
        self._holders[loop] = self._holders.get(loop, 0) + 1

    async def release_loop(self) -> None:
        """The running loop's worker is done; close the loop's pool when it was the last one."""
        loop = asyncio.get_running_loop()
        self._holders[loop] = self._holders.get(loop, 1) - 1
        if self._holders[loop] <= 0:
            del self._holders[loop]
            await self.close_loop()

    async def close_loop(self) -> None:
        store = self._stores.pop(asyncio.get_running_loop(), None)
        if store is not None:
            await store.pool.close()

    def close(self) -> None:
        """Flush pending pings, stop the listener and close the engine's pool; idempotent."""
        with self._lock:
            portal, cm, background = self._portal, self._portal_cm, self._background
            self._portal = self._portal_cm = self._background = None
        if portal is None or cm is None:
            return
        try:
            if self._stop is not None:
                portal.call(self._stop.set)
            if background is not None:
                with contextlib.suppress(Exception):
                    background.result(timeout=30)
        finally:
            cm.__exit__(None, None, None)
            self.notifier = self.listener = None
            self._loop = None
