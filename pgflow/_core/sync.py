"""The sync twins: one async implementation, run for sync callers on a private loop.

A sync call from a plain thread runs the async implementation on a loop of the App's own, in a daemon
thread that only sync callers use (async callers never touch it), so the two APIs cannot drift apart.
A sync call made from a sync workflow or step that a worker runs goes to that worker's loop instead,
where its connections already are. Ctrl-C in a sync caller blocked here raises KeyboardInterrupt at
once and cancels the call; the thread is a daemon, so it never keeps the process alive.

Why a loop thread of pgflow's own rather than anyio's blocking portal, which does the same: a call
through the portal (``start_blocking_portal``'s ``start_task_soon``: a task in its task group, a cancel
scope, a future) costs 91 us here against 37 us through ``run_coroutine_threadsafe`` onto a
plain loop (``benchmarks/sync_bridge.py``); a sync ``start`` and ``result`` make two calls in a
start-to-result of about 2 ms. And not ``BlockingPortalProvider``, which stops its loop whenever its
last caller leaves: the pool and the listener living there would go with it, and every sync call would
connect anew.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import anyio.from_thread

from . import forks, loops
from .current import current_execution

T = TypeVar("T")


class LoopThread:
    """A private event loop in a daemon thread, started on first use."""

    def __init__(self, name: str, on_stop: Callable[[], Awaitable[None]]) -> None:
        self._name = name
        self._on_stop = on_stop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.forked()
        forks.watch(self)

    def forked(self) -> None:
        """In a forked child the thread is gone and its loop will never run again: the next call
        starts a loop of this process's own (what the old one held stays the parent's)."""
        forks.keep_inherited(self._loop, self._thread)
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._loop = self._thread = None

    @property
    def started(self) -> bool:
        return self._loop is not None

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self._pid != os.getpid():  # forked by a hook-less fork (uWSGI's)
            self.forked()
        with self._lock:
            if self._loop is None:
                loop = loops.new_event_loop(loops.from_environment())
                thread = threading.Thread(target=self._run, args=(loop,), name=self._name, daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
                atexit.register(self.stop)  # flush this loop's pending pings when the process exits
            return self._loop

    @staticmethod
    def _run(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            loop.close()

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        loop = self._running_loop()
        if threading.current_thread() is self._thread:
            raise RuntimeError("pgflow's sync API cannot be called from its own loop; use the _async twin")
        future: Future[T] = asyncio.run_coroutine_threadsafe(_call(fn, *args), loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # KeyboardInterrupt while waiting: the call stops too
            raise

    def stop(self, timeout: float = 10.0) -> None:
        """Run ``on_stop`` on the loop (closing what lives there), then end the thread."""
        if self._pid != os.getpid():  # the loop is a forked parent's: nothing of it runs here
            self.forked()
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None or thread is None:
            return
        atexit.unregister(self.stop)
        try:
            asyncio.run_coroutine_threadsafe(_call(self._on_stop), loop).result(timeout)
        except Exception:  # noqa: BLE001,S110 - closing is best effort: the thread ends regardless
            pass
        finally:
            loop.call_soon_threadsafe(loop.stop)
            if thread is not threading.current_thread():
                thread.join(timeout)


async def _call(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    return await fn(*args)


def on_a_loop() -> bool:
    """Whether the caller runs on an event loop. Asked outside any ``except`` clause: what the caller
    runs next (a sync step) would otherwise raise with "RuntimeError: no running event loop" chained
    to its own traceback as the exception it happened "during"."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def run_sync(loop_thread: LoopThread, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Run ``fn(*args)`` to completion for a sync caller: on the worker's loop when called from a
    sync workflow or step it runs, otherwise on the private loop."""
    execution = current_execution.get()
    if execution is not None:
        if not on_a_loop():
            return anyio.from_thread.run(_call, fn, *args, token=execution.token)
        raise RuntimeError("a blocking pgflow call inside an async workflow or step would stall its worker; "
                           "await the _async twin instead")
    return loop_thread.run(fn, *args)
