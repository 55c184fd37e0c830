"""Group commit, the shape shared by the stream writer and the finisher of a worker.

Items come from many tasks (chunks, workflow ends); each task awaits its own item's batch. Batches are
gathered while earlier ones commit, up to ``max_in_flight`` at once: when idle an item goes out at
once, and under load batches grow by themselves.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Generic, TypeVar

import anyio
import anyio.abc

T = TypeVar("T")


class GroupCommit(ABC, Generic[T]):
    # Whether the items still queued when ``run`` is cancelled are sent before it returns, and those
    # submitted afterwards go alone: for items whose tasks only wait to be written (a workflow's end,
    # the note counting a step attempt), which a stopping worker must not drop.
    drains = False
    # Whether an item that would go alone is written in its caller's task (shielded, so a caller that
    # must be able to give up waiting for its item, within a deadline of its own, says no).
    inline = True

    def __init__(self, max_batch: int, max_in_flight: int) -> None:
        self._max_batch = max_batch
        self._max_in_flight = max_in_flight
        self._queue: list[T] = []
        self._wake = anyio.Event()
        self._in_flight = 0
        self._stopped = False
        self._gathering: list[T] | None = None  # an inline batch taking what this turn of the loop submits

    def _put(self, item: T) -> None:
        self._queue.append(item)
        self._wake.set()

    async def _submit(self, item: T) -> None:
        """Write the item now, in the caller's task, when nothing is queued and there is room in
        flight, with whatever other tasks submit in the same turn of the event loop (the workflows of
        one claim end together: alone, the first end was a statement and a commit of its own); or once
        ``run`` has stopped; otherwise queue it for the next batch. The caller then awaits its item's
        own answer."""
        if self._stopped:
            await self._flush([item])
        elif self._gathering is not None:
            self._gathering.append(item)
        elif self.inline and not self._queue and self._in_flight < self._max_in_flight:
            self._in_flight += 1
            batch = self._gathering = [item]
            try:
                await asyncio.sleep(0)  # the other tasks ready in this turn run, and join the batch
            except BaseException:
                self._gathering = None
                self._in_flight -= 1
                for queued in batch:
                    self._put(queued)
                raise
            self._gathering = None
            await self._send(batch)  # no hop through ``run`` and a task of its own
        else:
            self._put(item)

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Send batches until cancelled; a batch in flight is finished first (shielded), since one
        cut off halfway would answer nobody."""
        try:
            async with anyio.create_task_group() as flushes:
                task_status.started()
                while True:
                    await self._wake.wait()
                    self._wake = anyio.Event()
                    while self._queue and self._in_flight < self._max_in_flight:
                        batch = self._take_batch()
                        if not batch:
                            break
                        self._in_flight += 1
                        flushes.start_soon(self._send, batch)
        finally:
            if self.drains:
                self._stopped = True
                with anyio.CancelScope(shield=True):
                    while self._queue:
                        await self._flush(self._take_batch())

    def _take_batch(self) -> list[T]:
        """The next batch, taken off the queue."""
        batch, self._queue = self._queue[:self._max_batch], self._queue[self._max_batch:]
        return batch

    async def _send(self, batch: list[T]) -> None:
        try:
            with anyio.CancelScope(shield=True):
                await self._flush(batch)
        finally:
            self._sent(batch)
            self._in_flight -= 1
            if self._queue:
                self._wake.set()

    def _sent(self, batch: list[T]) -> None:
        """A batch is done (written or failed): what it held back may go."""

    @abstractmethod
    async def _flush(self, batch: list[T]) -> None:
        """Write a batch and answer each of its items."""
