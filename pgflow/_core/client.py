"""What the objects users hold (workflows, handles) need to reach the database, without the App."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .registry import Registry
from .runtime import Runtime, Runtimes
from .sync import LoopThread, run_sync

T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class Client:
    registry: Registry
    runtimes: Runtimes
    loop_thread: LoopThread

    def runtime(self) -> Runtime:
        """The runtime of the calling event loop."""
        return self.runtimes.current()

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run an async implementation for a sync caller."""
        return run_sync(self.loop_thread, fn, *args)
