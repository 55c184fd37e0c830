"""Blocking twins derived from their ``_async`` originals, so the two cannot drift apart.

``status = blocking(status_async)`` in a class body gives a method named ``status`` with the original's
parameters, defaults, type hints and docstring, that runs the original for a sync caller (see sync.py:
on the worker's loop from a sync workflow or step, otherwise on the App's private loop). Only methods
whose async body reads nothing from the calling thread's context are derived this way: a start or a
send takes its journal position (a context variable of the workflow body) before it leaves the caller,
and a stream is a generator, so those twins are written out; tests/test_twins.py fails when any pair's
parameters drift apart.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Concatenate, ParamSpec, Protocol, TypeVar

if TYPE_CHECKING:
    from .client import Client

P = ParamSpec("P")
T = TypeVar("T")


class HasClient(Protocol):
    _client: Client


S = TypeVar("S", bound=HasClient)


def blocking(original: Callable[Concatenate[S, P], Awaitable[T]]) -> Callable[Concatenate[S, P], T]:
    """The blocking twin of the coroutine method ``original`` (whose name ends in ``_async``)."""
    name = original.__name__
    if not name.endswith("_async"):
        raise TypeError(f"blocking() derives the twin of an '_async' method, not of {name!r}")

    def twin(self: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._client.call(functools.partial(original, self, *args, **kwargs))

    twin.__name__ = name.removesuffix("_async")
    twin.__qualname__ = original.__qualname__.removesuffix("_async")
    twin.__module__ = original.__module__
    twin.__doc__ = original.__doc__
    twin.__annotations__ = dict(original.__annotations__)
    twin.__signature__ = inspect.signature(original)  # type: ignore[attr-defined]
    return twin


def iterate(client: Client, items: AsyncIterator[T]) -> Iterator[T]:
    """Read an async iterator from a sync caller, one item per trip to the loop that serves it.
    The iterator is made here but runs there: its body (and the runtime it picks) starts on the first
    trip. Leaving the loop early closes it there too."""
    try:
        while got := client.call(_step, items):
            yield got[0]
    finally:
        closing = getattr(items, "aclose", None)
        if closing is not None:
            client.call(closing)


async def _step(items: AsyncIterator[T]) -> tuple[T] | tuple[()]:
    """The next item, or () at the end: a StopAsyncIteration must not cross into a Future."""
    try:
        return (await anext(items),)
    except StopAsyncIteration:
        return ()
