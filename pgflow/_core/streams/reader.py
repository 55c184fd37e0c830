"""Reading streams: every reader of one event loop shares its fetches.

The reads asked for while a query runs are answered together by the next one; the first reader to
ask runs the queries for everyone waiting, so no background task is needed. A reader waits on its own
loop, woken by the listener or the writer of that loop: a chunk goes from the database to the reader
with no hop between threads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import anyio
import psycopg

from ... import codec
from ...errors import UnknownWorkflow
from ..notify import Outage, Waiter
from ..store import Store, unreachable

log = logging.getLogger("pgflow.streams")

READ_BATCH = 1000
ENDED = ("succeeded", "failed", "cancelled")
Chunks = list[tuple[int, bytes | None]]
Found = tuple[str | None, bool, Chunks]


def stream_keys(workflow_id: str, key: str) -> list[str]:
    """The pings a reader of the stream waits for: the stream grew, or its workflow ended."""
    return [f"s:{workflow_id}:{key}", f"wf:{workflow_id}"]


class _Read:
    """One reader's question, answered by the next shared query."""

    __slots__ = ("workflow_id", "key", "offset", "answer")

    def __init__(self, workflow_id: str, key: str, offset: int) -> None:
        self.workflow_id = workflow_id
        self.key = key
        self.offset = offset
        self.answer: asyncio.Future[Found] = asyncio.get_running_loop().create_future()

    def reply(self, result: Found | None = None, error: BaseException | None = None) -> None:
        if self.answer.done():  # its reader was cancelled meanwhile
            return
        if error is not None:
            self.answer.set_exception(error)
        else:
            assert result is not None
            self.answer.set_result(result)


class ChunkFetcher:
    """Shares reads among the readers of one loop."""

    def __init__(self, store: Callable[[], Awaitable[Store]]) -> None:
        self._store = store
        self._queue: list[_Read] = []
        self._busy = False
        self.queries = 0

    async def fetch(self, workflow_id: str, key: str, offset: int) -> Found:
        read = _Read(workflow_id, key, offset)
        self._queue.append(read)
        if not self._busy:
            self._busy = True
            try:
                with anyio.CancelScope(shield=True):
                    # Readers woken by the same ping run right after this one: let them ask first,
                    # so one query answers them all.
                    await asyncio.sleep(0)
                    while self._queue:
                        batch, self._queue = self._queue[:READ_BATCH], self._queue[READ_BATCH:]
                        await self._answer(batch)
            finally:
                self._busy = False
        return await read.answer

    async def _answer(self, batch: list[_Read]) -> None:
        """Answer a batch in one query. When it fails, the halves are tried apart, so a read that
        breaks the query (whatever slipped past the checks) fails alone and the others are answered."""
        try:
            store = await self._store()
            results = await store.read_streams(
                [r.workflow_id for r in batch], [r.key for r in batch], [r.offset for r in batch],
                READ_BATCH)
            self.queries += 1
        except Exception as exc:  # noqa: BLE001 - given to the reads that caused it
            if len(batch) > 1 and not unreachable(exc):  # an outage is nobody's fault: no bisection
                middle = len(batch) // 2
                await self._answer(batch[:middle])
                await self._answer(batch[middle:])
                return
            for read in batch:
                read.reply(error=exc)
            return
        for r, result in zip(batch, results, strict=True):
            r.reply(result)


async def read_batches(fetcher: ChunkFetcher, waiter: Waiter, workflow_id: str, key: str,
                       offset: int) -> AsyncGenerator[Chunks, None]:
    """Batches of a stream's chunks from ``offset`` on, until it can grow no more (closed, or its
    workflow ended and every chunk it wrote has been read).

    ``waiter`` is armed before each fetch, so a ping that comes while the reader fetches or handles a
    batch makes it fetch again at once; otherwise it waits for the next ping or the poll. So each
    batch costs one shared query, not a second one that finds nothing yet. A fetch that cannot reach
    the database counts as "nothing yet" until the outage lasts ``OUTAGE_LIMIT`` seconds.
    """
    outage = Outage()
    while True:
        waiter.arm()
        try:
            status, closed, chunks = await fetcher.fetch(workflow_id, key, offset)
            outage.over()
        except psycopg.Error as exc:
            outage.bear(exc)
            await waiter.wait()
            continue
        if status is None:
            raise UnknownWorkflow(f"no workflow with id {workflow_id!r}")
        if chunks:
            yield chunks
            offset = chunks[-1][0] + 1
            if len(chunks) >= READ_BATCH:
                continue  # more are waiting: no need for a ping
        elif closed or status in ENDED:
            return
        await waiter.wait()


def take(chunks: Chunks, decode_as: Any) -> tuple[list[tuple[int, Any]], bool]:
    """The (position, decoded value) pairs of fetched chunks, and whether the close marker ended them."""
    items: list[tuple[int, Any]] = []
    for position, value in chunks:
        if value is None:
            return items, True
        items.append((position, codec.decode(value, decode_as)))
    return items, False
