"""Batching of requests that arrive together: group commit for appends, shared reads for readers.

One transaction (one WAL flush) for every append of a batch, one query for every reader woken together:
under load, the database's work grows with the batches rather than with the requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

A = TypeVar("A")
R = TypeVar("R")


class Batcher(Generic[A, R]):
    """Requests that arrive while a batch is being run go together in the next one (``run`` answers a
    list of them at once, in order, an exception standing for a request's own failure), each request
    awaiting its own answer; alone, a request waits for nobody. A batch that fails as a whole is run
    again one request at a time, so that only the culprit fails.

    Appends use it for group commit (one transaction, one WAL flush, for every append of a batch:
    ``FreeStreams.append_many``), readers for shared reads (one query for every reader woken together:
    ``FreeStreams.read_many``)."""

    def __init__(self, run: Callable[[list[A]], Awaitable[list[R | Exception]]], most: int) -> None:
        self._run = run
        self._most = most
        self._pending: dict[asyncio.AbstractEventLoop, list[tuple[A, asyncio.Future[R]]]] = {}
        self._flushers: dict[asyncio.AbstractEventLoop, asyncio.Task[None]] = {}
        self.batches = 0

    async def submit(self, request: A) -> R:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._pending.setdefault(loop, []).append((request, future))
        if loop not in self._flushers:
            self._flushers[loop] = loop.create_task(self._flush(loop))
        return await future

    async def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            while self._pending.get(loop):
                pending = self._pending[loop]
                batch, self._pending[loop] = pending[:self._most], pending[self._most:]
                self.batches += 1
                try:
                    results = await self._run([request for request, _ in batch])
                except Exception as exc:  # noqa: BLE001 - each one alone, so that only the culprit fails
                    results = [exc] if len(batch) == 1 else [await self._alone(request) for request, _ in batch]
                for (_, future), result in zip(batch, results, strict=True):
                    if future.done():  # (its request was cancelled: its client left)
                        continue
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        finally:
            del self._flushers[loop]
            if not self._pending.get(loop):
                self._pending.pop(loop, None)

    async def _alone(self, request: A) -> R | Exception:
        try:
            return (await self._run([request]))[0]
        except Exception as exc:  # noqa: BLE001 - this request's own failure
            return exc
