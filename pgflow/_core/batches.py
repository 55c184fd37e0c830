"""Group commit, the shape shared by the stream writer and the finisher of a worker.

Items come from many tasks (chunks, workflow ends, step-start notes) and are answered when their batch
is done. Batches are gathered while earlier ones commit, up to ``max_in_flight`` at once: when idle an
item goes out on the next turn of the loop (with whatever else that turn submitted), and under load
batches grow by themselves.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar

import anyio
import anyio.abc

from .engine import unreachable

T = TypeVar("T")
log = logging.getLogger("pgflow")


class GroupCommit(ABC, Generic[T]):
    # Whether the items still queued when ``run`` is cancelled are sent before it returns, and those
    # submitted afterwards go alone: for items whose tasks only wait to be written (a workflow's end,
    # the note counting a step attempt), which a stopping worker must not drop.
    drains = False

    def __init__(self, max_batch: int, max_in_flight: int) -> None:
        self._max_batch = max_batch
        self._max_in_flight = max_in_flight
        self._queue: list[T] = []
        self._in_flight = 0
        self._stopped = False
        self._sending: set[asyncio.Task[None]] | None = None  # while ``run`` runs: the tasks it owns
        self._dispatching = False  # a task to take the next batches is on its way
        self._closing = False  # ``run`` was cancelled: no batch begins any more

    def _put(self, item: T) -> None:
        queue = self._queue
        queue.append(item)
        if len(queue) == 1:
            # Only the first item of a queue starts a batch: while the queue holds more, a batch in
            # flight takes them when it is done (that is why they wait).
            self._dispatch_soon()

    async def _submit(self, item: T) -> None:
        """Queue the item for the next batch (the batch taken on the next turn of the loop holds
        whatever this turn submitted); once ``run`` has stopped, write it now, alone."""
        if self._stopped:
            await self._flush([item])
        else:
            self._put(item)

    def _dispatch_soon(self) -> None:
        """Have the queued items taken on the next turn of the loop, in a task that sends the first
        batch itself: an end or a chunk put when nothing is in flight goes out one hop later, not
        two (a task woken to start another)."""
        sending = self._sending
        if sending is None or self._closing or self._dispatching or self._in_flight >= self._max_in_flight:
            return
        self._dispatching = True
        self._own(sending, self._dispatch())

    @staticmethod
    def _own(sending: set[asyncio.Task[None]], sent: Coroutine[Any, Any, None]) -> None:
        """Run ``sent`` in a plain task of ``run``'s."""
        task = asyncio.get_running_loop().create_task(sent)
        sending.add(task)
        task.add_done_callback(sending.discard)

    async def _dispatch(self) -> None:
        self._dispatching = False
        batches = []
        while self._queue and self._in_flight < self._max_in_flight and not self._closing:
            batch = self._take_batch()
            if not batch:
                break
            self._in_flight += 1
            batches.append(batch)
        if not batches:
            return
        sending = self._sending
        assert sending is not None  # (``run`` waits for this task before it lets go of them)
        for batch in batches[1:]:
            self._own(sending, self._send(batch))
        await self._send(batches[0])

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Own the batches' tasks until cancelled; a batch in flight is finished first, since one cut
        off halfway would answer nobody.

        Each batch is sent in a plain task, which ``run`` owns: nothing cancels it, and ``run`` does
        not return before it is done. (anyio's ``start_soon`` costs a cancel scope and an event per
        task; there is a batch of ends per claim cycle, and one of chunks per round.)"""
        sending: set[asyncio.Task[None]] = set()
        self._sending = sending
        try:
            task_status.started()
            if self._queue:
                self._dispatch_soon()
            await anyio.sleep_forever()
        finally:
            self._closing = True
            with anyio.CancelScope(shield=True):
                while sending:  # (and those a dispatch under way started meanwhile)
                    await asyncio.wait(set(sending))
                self._sending = None
                if self.drains:
                    self._stopped = True
                    while self._queue:
                        await self._flush(self._take_batch())

    def _take_batch(self) -> list[T]:
        """The next batch, taken off the queue."""
        batch, self._queue = self._queue[:self._max_batch], self._queue[self._max_batch:]
        return batch

    async def _send(self, batch: list[T]) -> None:
        try:
            await self._flush(batch)
        except Exception:  # noqa: BLE001 - a flush answers its items itself; this is a bug, and logged
            log.exception("sending a batch of %d failed", len(batch))
        finally:
            self._sent(batch)
            self._in_flight -= 1
            if self._queue:
                self._dispatch_soon()

    def _sent(self, batch: list[T]) -> None:
        """A batch is done (written or failed): what it held back may go."""

    @abstractmethod
    async def _flush(self, batch: list[T]) -> None:
        """Write a batch and answer each of its items."""


async def apart(batch: list[T], attempt: Callable[[list[T]], Awaitable[None]],
                refused: Callable[[list[T], Exception], None]) -> None:
    """Run ``attempt`` on the batch; when it fails for what the batch holds, on its halves apart, until
    the item to blame is alone: one bad item (a value the server refuses, a read that breaks the query)
    fails by itself and the others go through. An outage is nobody's fault and is not split:
    ``refused(items, error)`` gets the whole batch then, and the lone item otherwise."""
    try:
        await attempt(batch)
    except Exception as exc:  # noqa: BLE001 - given to the items it concerns
        if unreachable(exc) or len(batch) == 1:
            refused(batch, exc)
            return
        middle = len(batch) // 2
        await apart(batch[:middle], attempt, refused)
        await apart(batch[middle:], attempt, refused)
