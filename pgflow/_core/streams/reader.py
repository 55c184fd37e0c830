"""Reading streams: every reader of one event loop shares its fetches.

The reads asked for while a query runs are answered together by the next one; the first reader to
ask runs the queries for everyone waiting, so no background task is needed. A reader waits on its own
loop, woken by the listener or the writer of that loop: a chunk goes from the database to the reader
with no hop between threads.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import anyio

from ... import codec
from ...errors import UnknownWorkflow
from ..store import Store

log = logging.getLogger("pgflow.streams")

READ_BATCH = 1000
ENDED = ("succeeded", "failed", "cancelled")
T = TypeVar("T")
Chunks = list[tuple[int, bytes | None]]
Found = tuple[str | None, bool, Chunks]


class WaitFor(Protocol):
    async def __call__(self, keys: list[str], check: Callable[[], Awaitable[T | None]],
                       timeout: float | None) -> T | None: ...


@dataclass(eq=False)
class _Read:
    workflow_id: str
    key: str
    offset: int
    done: anyio.Event = field(default_factory=anyio.Event)
    result: Found = (None, False, [])
    error: BaseException | None = None


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
        if self._busy:
            await read.done.wait()
        else:
            self._busy = True
            try:
                with anyio.CancelScope(shield=True):
                    while self._queue:
                        batch, self._queue = self._queue[:READ_BATCH], self._queue[READ_BATCH:]
                        await self._answer(batch)
            finally:
                self._busy = False
        if read.error is not None:
            raise read.error
        return read.result

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
            if len(batch) > 1:
                middle = len(batch) // 2
                await self._answer(batch[:middle])
                await self._answer(batch[middle:])
                return
            batch[0].error = exc
            batch[0].done.set()
            return
        for r, result in zip(batch, results, strict=True):
            r.result = result
            r.done.set()


async def next_chunks(fetcher: ChunkFetcher, wait_for: WaitFor, workflow_id: str, key: str,
                      offset: int) -> Chunks | None:
    """The chunks from ``offset`` on, waiting until there is at least one; None once the stream
    can grow no more (its workflow ended and every chunk it wrote has been read)."""

    async def check() -> Chunks | None:
        status, closed, chunks = await fetcher.fetch(workflow_id, key, offset)
        if status is None:
            raise UnknownWorkflow(f"no workflow with id {workflow_id!r}")
        if chunks or closed or status in ENDED:
            return chunks
        return None

    chunks = await wait_for([f"s:{workflow_id}:{key}", f"wf:{workflow_id}"], check, None)
    return chunks or None


def take(chunks: Chunks | None, offset: int, decode_as: Any) -> tuple[list[tuple[int, Any]], int | None]:
    """The (position, decoded value) pairs of fetched chunks and the offset to read from next (None
    at the end)."""
    if chunks is None:
        return [], None
    items: list[tuple[int, Any]] = []
    for position, value in chunks:
        if value is None:
            return items, None
        items.append((position, codec.decode(value, decode_as)))
        offset = position + 1
    return items, offset
