"""``AppInternals``: the one seam between an ``App`` and the tools pgflow builds on it.

The pytest plugin (``pgflow.testing``), ``check-replay``, the dashboard, Durable Streams and the CLI need
more of an App than its public API gives: the runtime of the calling event loop (its pool, its signals,
its stream reads), the bridge that runs async code for a sync caller, the clock a test moves, and, for the
plugin alone, a way to point the App at a test's schema and back. They used to read the App's private
attributes for it, so every change inside ``App`` could break a tool that nothing tied to it. They now ask
``app._internals()`` for this object, and read nothing else private of the App
(tests/test_app_internals.py holds them to it): what the App may change freely is everything not here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from .client import Client
from .clock import Clock
from .registry import Config, Registry
from .runtime import Runtime
from .twins import iterate

T = TypeVar("T")


@dataclass(frozen=True)
class Pointing:
    """Where an App points: its DSN (None: the embedded server's, resolved on first use) and its
    settings as ``Config`` takes them (schema, pool size, suspend_after, retention, ...)."""

    dsn: str | None
    settings: Mapping[str, Any]


class AppInternals:
    """What pgflow's own tools use of an App beyond its public API, and nothing more.

    Made once by the App; ``pointing``/``point`` are the App's own (they change what it is connected
    to), the rest goes through its client, which workflows and handles already share."""

    def __init__(self, client: Client, pointing: Callable[[], Pointing], point: Callable[[Pointing], None]) -> None:
        self._client = client
        self._pointing = pointing
        self._point = point

    @property
    def client(self) -> Client:
        """What workflows and handles of the App reach the database through: for pgflow's code that
        starts workflows as the App would (the canvas's workflow, which check-replay lends itself)."""
        return self._client

    @property
    def registry(self) -> Registry:
        """The workflows and steps this process can run (the App's ``registry``)."""
        return self._client.registry

    def runtime(self) -> Runtime:
        """The App's runtime on the calling event loop, made on first use: its store, its signals,
        its stream reads. Only for the loop that asks."""
        return self._client.runtime()

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` to completion for a sync caller, as the App's blocking twins do."""
        return self._client.call(fn, *args)

    def iterate(self, items: AsyncIterator[T]) -> Iterator[T]:
        """An async iterator read from a sync caller, one item per trip to the loop that serves it."""
        return iterate(self._client, items)

    @property
    def clock(self) -> Clock:
        """The clock the App's timers follow in this process (the one ``pgflow.testing`` moves); a
        new one after each ``point``."""
        return self._client.runtimes.clock

    async def config(self) -> Config:
        """The App's resolved configuration (resolving it may start the embedded server, off the loop)."""
        return await self._client.runtimes.config_async()

    async def close_here(self) -> None:
        """Close the App's runtime on the calling loop (its pool, its listener), leaving the others."""
        await self._client.runtimes.aclose_current()

    def pointing(self) -> Pointing:
        """Where the App points now, to point it back later."""
        return self._pointing()

    def point(self, pointing: Pointing) -> None:
        """Point the App elsewhere (``pgflow.testing``: a test's schema, and back afterwards). Only
        between uses: the App must be closed, or this raises."""
        self._point(pointing)
