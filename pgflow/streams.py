"""Streams: group-committed writes and batched reads.

Writing a chunk is an INSERT, but not one per chunk: the chunks of every writer in a worker process are
gathered while earlier batches commit (two may be in flight) and then written in one multi-row INSERT,
and each writer awaits its batch's commit. Under load batches grow by themselves; when idle a chunk
goes out at once.

Positions are dense per (workflow, key). The execution that holds a workflow's lease is the only writer
of its streams (fencing refuses the others), so it assigns positions in memory, from the stream ends
read once when it starts. A batch that fails is retried whole; if it cannot be written, every execution
that had a chunk in it is interrupted and given back to the queue, so no later chunk of theirs lands
behind a gap, and the execution that resumes them reads the ends afresh.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import psycopg

from . import codec
from .context import current_execution
from .errors import CancelRequested, ExecutionInterrupted, LeaseLost, UnknownWorkflow
from .notify import pack
from .store import Store, retrying

if TYPE_CHECKING:
    from .engine import Engine
    from .execution import Execution

log = logging.getLogger("pgflow.streams")

MAX_CHUNK_BYTES = 8 * 1024 * 1024
MAX_KEY_BYTES = 256
READ_BATCH = 1000


class StreamWriteFailed(ExecutionInterrupted):
    """A batch of chunks could not be written; the execution stops and another run resumes it."""


def check_key(key: str) -> None:
    if not isinstance(key, str) or not key:
        raise ValueError(f"a stream key is a non-empty string, got {key!r}")
    if len(key.encode()) > MAX_KEY_BYTES:
        raise ValueError(f"a stream key is at most {MAX_KEY_BYTES} bytes, got {len(key.encode())}")


def check_reader(key: str, offset: int) -> None:
    check_key(key)
    if not isinstance(offset, int) or offset < 0:
        raise ValueError(f"a stream offset is a position >= 0, got {offset!r}")


def encode_chunk(key: str, value: object) -> bytes:
    data = codec.encode(value, f"a chunk of stream {key!r}")
    if len(data) > MAX_CHUNK_BYTES:
        raise ValueError(
            f"a chunk of stream {key!r} is {len(data)} bytes encoded; the limit is {MAX_CHUNK_BYTES}. "
            "Split it into several chunks."
        )
    return data


class _Pending:
    """A chunk waiting for its batch; its writer awaits ``done`` (a bare future: the cheapest
    thing to wait on, and there is one per chunk)."""

    __slots__ = ("execution", "key", "position", "value", "done", "error")

    def __init__(self, execution: Execution, key: str, position: int, value: bytes | None) -> None:
        self.execution = execution
        self.key = key
        self.position = position
        self.value = value
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.error: BaseException | None = None

    def resolve(self, error: BaseException | None = None) -> None:
        self.error = error
        if not self.done.done():  # its writer may have been cancelled meanwhile
            self.done.set_result(None)


class StreamWriter:
    """Group commit for the chunks of every execution in one worker."""

    def __init__(self, engine: Engine, store: Store, max_batch: int = 5000, max_in_flight: int = 2) -> None:
        self._engine = engine
        self._store = store
        self._max_batch = max_batch
        self._max_in_flight = max_in_flight
        self._queue: list[_Pending] = []
        self._wake = anyio.Event()
        self._in_flight = 0
        self._busy: set[tuple[str, str]] = set()  # (workflow, key) with a chunk in a batch in flight
        self.batches = 0
        self.chunks = 0

    async def write(self, execution: Execution, key: str, position: int, value: bytes | None) -> None:
        """Queue one chunk and return once its batch has committed."""
        pending = _Pending(execution, key, position, value)
        self._queue.append(pending)
        self._wake.set()
        await pending.done
        if pending.error is not None:
            raise pending.error

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Send batches, up to ``max_in_flight`` at once so that the database commits one batch while
        this process gathers the next. A stream's chunks never ride in two batches in flight at once:
        each batch commits a stream's chunks in order, after every earlier one, so a reader never
        sees a gap, and a batch that fails leaves nothing of its streams committed behind it."""
        async with anyio.create_task_group() as flushes:
            task_status.started()
            while True:
                await self._wake.wait()
                self._wake = anyio.Event()
                while self._queue and self._in_flight < self._max_in_flight:
                    batch = self._take_batch()
                    if not batch:
                        break
                    streams = {(p.execution.workflow_id, p.key) for p in batch}
                    self._busy |= streams
                    self._in_flight += 1
                    flushes.start_soon(self._flush_then_free, batch, streams)

    def _take_batch(self) -> list[_Pending]:
        batch: list[_Pending] = []
        waiting: list[_Pending] = []
        for p in self._queue:
            if p.execution.interrupt is not None:
                p.resolve(p.execution.interrupt)  # a failed batch poisoned it: nothing more goes out
            elif len(batch) >= self._max_batch or (p.execution.workflow_id, p.key) in self._busy:
                waiting.append(p)
            else:
                batch.append(p)
        self._queue = waiting
        return batch

    async def _flush_then_free(self, batch: list[_Pending], streams: set[tuple[str, str]]) -> None:
        try:
            with anyio.CancelScope(shield=True):
                await self._flush(batch)
        finally:
            self._busy -= streams
            self._in_flight -= 1
            self._wake.set()

    async def _flush(self, batch: list[_Pending]) -> None:
        ids = [p.execution.workflow_id for p in batch]
        attempts = [p.execution.attempt for p in batch]
        keys_ = [p.key for p in batch]
        positions = [p.position for p in batch]
        values = [p.value for p in batch]
        keys = {f"s:{wid}:{key}" for wid, key in zip(ids, keys_, strict=True)}
        notify = None
        if self._engine.config.notify == "inline" and self._engine.notifier is not None:
            notify = (self._engine.config.channel, pack(self._engine.notifier.token, keys))
        try:
            fenced, cancelled = await retrying(lambda: self._store.write_chunks(
                ids, attempts, keys_, positions, values, notify=notify), f"a batch of {len(batch)} chunks")
        except (psycopg.Error, OSError) as exc:
            log.error("a batch of %d chunks could not be written: %s", len(batch), exc)
            self._fail(batch, exc)
            return
        self.batches += 1
        self.chunks += len(batch)
        for p in batch:
            ex = p.execution
            if (ex.workflow_id, ex.attempt) in fenced:
                ex.interrupt = LeaseLost(f"workflow {ex.workflow_id!r} attempt {ex.attempt} lost its lease")
                p.resolve(ex.interrupt)
                continue
            if ex.workflow_id in cancelled and ex.interrupt is None:
                ex.interrupt = CancelRequested(f"workflow {ex.workflow_id!r} was cancelled")
            p.resolve()
        if notify is None:
            self._engine.ping(*keys)
        else:
            self._engine.waiters.wake(keys)

    def _fail(self, batch: list[_Pending], exc: BaseException) -> None:
        for p in batch:
            p.execution.interrupt = StreamWriteFailed(
                f"chunks of workflow {p.execution.workflow_id!r} could not be written: {exc}")
            p.resolve(p.execution.interrupt)


async def read(engine: Engine, workflow_id: str, key: str, offset: int,
               decode_as: Any = Any) -> AsyncIterator[Any]:
    """Every chunk of a stream from ``offset`` on, waiting for more until the stream is closed or its
    workflow has ended in any way. Each wait is a ping on the stream or the workflow, or the poll."""
    check_reader(key, offset)
    at: int | None = offset
    while at is not None:
        values, at = take(await next_chunks(engine, workflow_id, key, at), at, decode_as)
        for value in values:
            yield value


def take(chunks: list[tuple[int, bytes | None]] | None, offset: int,
         decode_as: Any) -> tuple[list[Any], int | None]:
    """The decoded values of fetched chunks and the offset to read from next (None at the end)."""
    if chunks is None:
        return [], None
    values: list[Any] = []
    for position, value in chunks:
        if value is None:
            return values, None
        values.append(codec.decode(value, decode_as))
        offset = position + 1
    return values, offset


async def next_chunks(engine: Engine, workflow_id: str, key: str,
                      offset: int) -> list[tuple[int, bytes | None]] | None:
    """The chunks from ``offset`` on, waiting until there is at least one; None once the stream
    can grow no more (its workflow ended and every chunk it wrote has been read).

    The whole wait runs on the engine's loop, beside the listener and the shared fetcher, so a
    reader on another loop costs one hop there and back per batch of chunks, not per ping."""

    async def wait_there() -> list[tuple[int, bytes | None]] | None:
        store = await engine.store()
        fetcher = _fetchers.get(store)
        if fetcher is None:
            fetcher = _fetchers.setdefault(store, ChunkFetcher(store))

        async def check() -> list[tuple[int, bytes | None]] | None:
            status, closed, chunks = await fetcher.fetch(workflow_id, key, offset)
            if status is None:
                raise UnknownWorkflow(f"no workflow with id {workflow_id!r}")
            if chunks or closed or status in ("succeeded", "failed", "cancelled"):
                return chunks
            return None

        chunks = await engine.wait_for([f"s:{workflow_id}:{key}", f"wf:{workflow_id}"], check, None)
        return chunks or None

    return await engine.on_engine_loop(wait_there)


@dataclass(eq=False)
class _Read:
    workflow_id: str
    key: str
    offset: int
    done: anyio.Event = field(default_factory=anyio.Event)
    result: tuple[str | None, bool, list[tuple[int, bytes | None]]] = (None, False, [])
    error: BaseException | None = None


class ChunkFetcher:
    """Shares reads among the readers of one process: the reads asked for while a query runs are
    answered together by the next one. The first reader to ask runs the queries for everyone
    waiting, so no background task is needed."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._queue: list[_Read] = []
        self._busy = False
        self.queries = 0

    async def fetch(self, workflow_id: str, key: str, offset: int,
                    ) -> tuple[str | None, bool, list[tuple[int, bytes | None]]]:
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
        try:
            results = await self._store.read_streams(
                [r.workflow_id for r in batch], [r.key for r in batch], [r.offset for r in batch],
                READ_BATCH)
            self.queries += 1
        except Exception as exc:  # noqa: BLE001 - every reader in the batch gets the error
            for r in batch:
                r.error = exc
                r.done.set()
            return
        for r, result in zip(batch, results, strict=True):
            r.result = result
            r.done.set()


_fetchers: weakref.WeakKeyDictionary[Store, ChunkFetcher] = weakref.WeakKeyDictionary()


# -- the public functions, called from inside a workflow or a step --------------------------------------


def _execution(what: str) -> Execution:
    execution = current_execution.get()
    if execution is None:
        raise RuntimeError(f"pgflow.{what} is called from inside a workflow or a step run by a worker")
    return execution


async def write_stream_async(key: str, value: object) -> None:
    """Append a chunk to the workflow's stream ``key``; returns once the chunk is committed."""
    check_key(key)
    await _execution("write_stream_async").write_chunk(key, encode_chunk(key, value))


async def close_stream_async(key: str) -> None:
    """Close the stream: its readers stop after the chunks written so far."""
    check_key(key)
    await _execution("close_stream_async").write_chunk(key, None)


def write_stream(key: str, value: object) -> None:
    """Sync twin of ``write_stream_async``, for sync workflows and steps."""
    check_key(key)
    _write_from_thread("write_stream", key, encode_chunk(key, value))


def close_stream(key: str) -> None:
    """Sync twin of ``close_stream_async``."""
    check_key(key)
    _write_from_thread("close_stream", key, None)


def stream_offset(key: str) -> int:
    """Inside a step: how many chunks this step call has already committed to ``key``, counting
    its earlier attempts, so a retried step can resume where it stopped instead of repeating itself.
    In the workflow body: how many chunks the stream holds."""
    check_key(key)
    return _execution("stream_offset").stream_offset(key)


def _write_from_thread(what: str, key: str, value: bytes | None) -> None:
    execution = _execution(what)
    try:
        on_loop = anyio.lowlevel.current_token() == execution.token
    except RuntimeError:
        on_loop = False
    if on_loop:
        raise RuntimeError(f"pgflow.{what} blocks; in async code use `await pgflow.{what}_async(...)`")
    anyio.from_thread.run(execution.write_chunk, key, value, token=execution.token)
