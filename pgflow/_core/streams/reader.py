"""Reading streams: every reader of one event loop shares its fetches.

A reader does not run a query of its own. A ping of its stream (or the slow poll) marks the stream as
asked, one query fetches the new chunks of every stream asked meanwhile, and each reader is woken once,
with its chunks in hand: under load that is one query and one wake per reader for every batch the
writers commit. The query is run by the reader whose stream was asked first while none ran, so no
background task is needed; a chunk goes from the database to its reader with no hop between threads.

A reader is only asked again once it has taken what it was given, so a slow reader holds one batch
(and one chunk), not a growing buffer; a ping that comes meanwhile makes it ask as soon as it has taken
it. A reader that keeps up needs no query at all: the news of a small chunk carries it
(``signals/payload.py``), and a reader waiting at exactly that position takes it from there, or, if its
consumer is still busy with the chunk before, when the consumer comes back.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import psycopg

from ...errors import UnknownWorkflow
from .. import codec
from ..batches import apart
from ..engine import Engine, unreachable
from ..signals import Outage, PollTicks, Waiters
from ..signals import keys as signal_keys
from ..status import ENDED

log = logging.getLogger("pgflow.streams")

READ_BATCH = 1000  # chunks of one stream per read, at most
STREAMS_PER_READ = 1000  # streams one query reads at most
READ_BYTES = 1024 * 1024  # bytes of one stream per read, at most (but a first chunk read alone, whatever its size)
QUERY_BYTES = 64 * 1024 * 1024  # bytes of one query's chunks, at most: what a shared read of many streams holds
WHOLE = 1 << 62  # the first chunk of a stream read alone is taken whatever its size
Chunks = list[tuple[int, bytes | None]]
# ``StreamRead.step``'s answer when the reader's next chunk is the one in ``handed`` (known by its
# identity: never filled)
HANDED: Chunks = []


def stream_keys(workflow_id: str, key: str) -> list[str]:
    """The pings a reader of the stream waits for: the stream grew, or its workflow ended."""
    return [signal_keys.stream(workflow_id, key), signal_keys.ended(workflow_id)]


class ReadState(enum.Enum):
    """Where a reader is. Its life, ``ChunkFetcher`` and ``StreamRead`` making every move::

        NEW --start--> ASKED --query--> FETCHING --chunks--> READY --taken--> HELD
                         ^                 |                                   |
                         |                 +--nothing new--> WAITING <--done---+ (unless pinged)
                         +--ping or tick--------------------------+

    and from FETCHING to ENDED (the stream can grow no more) or FAILED (the error it gets); from any
    state to CLOSED when the reader stops. A ping that comes while it is FETCHING, READY or HELD sets
    ``again``: it is asked again once its consumer has taken what it has (unless, READY or HELD, the
    ping carried the very next chunk: that one is ``kept`` and handed over then, with no query).
    Apart from the state, one reader at a time ``runs_fetch``: its task runs the next query for
    everyone asked."""

    NEW = "new"  # not started: nothing wakes it yet
    WAITING = "waiting"  # for a ping or a poll tick
    ASKED = "asked"  # for the next query
    FETCHING = "fetching"  # in the query under way
    READY = "ready"  # its chunks are in, not yet taken by its consumer
    HELD = "held"  # its consumer is busy with the chunks it took (its task is not waiting)
    ENDED = "ended"  # closed, or its workflow ended and it has read every chunk
    FAILED = "failed"  # it gets ``error``
    CLOSED = "closed"  # its reader stopped


# The states as module names: a global is read in a fifth of the time of an enum's attribute, and
# a reader in lock step with its writer moves through several per chunk.
_NEW, _WAITING, _ASKED, _FETCHING, _READY, _HELD, _ENDED, _FAILED, _CLOSED = ReadState
_DONE = (_ENDED, _FAILED, _CLOSED)
_BUSY = (_FETCHING, _READY, _HELD)  # a ping for it now is kept for later


class StreamRead:
    """One reader's place in a stream: where it is, and what the last fetch brought it.

    Pings and poll ticks call ``wake``, which only marks the stream as asked; the reader's task wakes
    when its answer is in (or when it is the one to run the query)."""

    __slots__ = ("workflow_id", "key", "sid", "offset", "_fetcher", "_waiters", "_loop", "_signal", "state",
                 "again", "alone", "runs_fetch", "chunks", "handed", "kept_at", "kept", "error", "outage")

    def __init__(self, fetcher: ChunkFetcher, waiters: Waiters | None, workflow_id: str, key: str,
                 offset: int) -> None:
        self.workflow_id = workflow_id
        self.key = key
        self.sid: int | None = None  # the stream's id in the table, once it has one
        self.offset = offset
        self._fetcher = fetcher
        self._waiters = waiters
        self._loop = asyncio.get_running_loop()
        self._signal: asyncio.Future[None] | None = None
        self.state = _NEW
        self.again = False  # pinged since its query began: ask again once the answer is taken
        self.alone = False  # its next chunk is too big to share a query: the next one reads it alone
        self.runs_fetch = False  # this reader's task is to run the query for everyone asked
        self.chunks: Chunks | None = None  # READY: fetched, not yet taken by the reader (None: ``handed``)
        self.handed: bytes | None = None  # READY without chunks: the one a ping carried, at ``offset - 1``
        self.kept_at = -1  # the position of the chunk a ping carried while its consumer was busy (-1: none)
        self.kept: bytes | None = None  # that chunk, handed over when the consumer comes back
        self.error: BaseException | None = None  # FAILED: what the reader gets
        self.outage = Outage()

    def wake(self) -> None:
        if self.state is not _ASKED:
            self._fetcher.ask(self)

    def hand(self, stream_id: int, position: int, value: bytes | None) -> None:
        """News carried the committed chunk at ``position`` of stream ``stream_id``: a reader
        waiting for exactly that one takes it and runs no query; one whose consumer is busy with the
        chunks before it keeps it for when its consumer comes back (one chunk, no query either); one
        that has it already lets it be; any other reads, as for a plain ping. So does a reader that
        does not know its stream's id yet, or knows another (a pruned workflow's stream of the same
        id and key)."""
        if stream_id != self.sid:
            self.wake()
            return
        if position < self.offset:
            return
        if position == self.offset:
            state = self.state
            if (state is _WAITING and not self.runs_fetch and self._signal is not None
                    and not self._signal.done()):
                self._take(value)
                self._signal.set_result(None)
                return
            if (state is _HELD or state is _READY) and self.kept_at in (-1, position):
                # Its consumer has not come back for the next chunk yet (its loop was busy a moment):
                # without this, the chunk would wait for a query, and so would every one after it
                # that comes while that query runs; a reader a chunk behind would stay in queries.
                self.kept_at, self.kept = position, value
                return
        self.wake()

    def _take(self, value: bytes | None) -> None:
        """Take the chunk at ``offset`` a ping carried: READY, with it in ``handed``."""
        self.offset += 1
        self.handed = value  # (no list of one: a reader in step with its writer gets each chunk so)
        self.state = _READY
        self._fetcher.handed += 1

    def signal(self) -> None:
        if self._signal is not None and not self._signal.done():
            self._signal.set_result(None)

    # Iterating a StreamRead gives the batches of its stream's chunks from ``offset`` on, until it can
    # grow no more (closed, or its workflow ended and every chunk it wrote has been read). It is its
    # own async iterator rather than an async generator: a reader in lock step with its writer takes
    # one batch per chunk, and one frame less per batch is a share of the reader's CPU.

    def __aiter__(self) -> StreamRead:
        return self

    async def __anext__(self) -> Chunks:
        while True:
            # Until this reader has chunks, an end or an error (running the query when it is its turn).
            step = self.step()
            if step is HANDED:
                return [(self.offset - 1, self.handed)]
            if isinstance(step, asyncio.Future):
                await step
            elif step is not None:
                return step
            elif self.runs_fetch:
                self.runs_fetch = False
                await self._fetcher.run()
            elif self.state is _FAILED:
                assert self.error is not None
                self.stop()
                raise self.error
            else:  # ended or closed
                self.stop()
                raise StopAsyncIteration

    def step(self) -> Chunks | asyncio.Future[None] | None:
        """One move of the reader, as a plain call (``__anext__`` is made of them; ``stream_async``
        makes them itself: a reader in step with its writer takes each chunk so, and a coroutine less
        per chunk is less for the application's garbage collector to count). Gives the chunks in
        hand; or ``HANDED`` (the one in ``handed``); or the future to await before the next move; or
        None, when only ``__anext__`` can move on (to run the query for everyone, or to end or fail)."""
        state = self.state
        if state is _HELD:
            self._fetcher.idle(self)
        elif state is _NEW:
            self._start()
        if self.runs_fetch:
            return None
        state = self.state
        if state is _READY:
            chunks, self.chunks = self.chunks, None
            self.state = _HELD  # asked while held, it would have to run the next query for everyone
            return HANDED if chunks is None else chunks
        if state in _DONE:
            return None
        self._signal = signal = self._loop.create_future()
        return signal

    def _start(self) -> None:
        self.state = _WAITING
        if self._waiters is not None:
            for k in stream_keys(self.workflow_id, self.key):
                self._waiters.add(k, self)
        self._fetcher.ask(self)

    def stop(self) -> None:
        """The reader is done with the stream (also when it stops early): nothing wakes it any more."""
        if self.state is _CLOSED:
            return
        if self._waiters is not None and self.state is not _NEW:
            for k in stream_keys(self.workflow_id, self.key):
                self._waiters.remove(k, self)
        self._fetcher.drop(self)

    async def aclose(self) -> None:
        self.stop()


class ChunkFetcher:
    """Shares reads among the readers of one loop."""

    def __init__(self, store: Callable[[], Awaitable[Engine]], ticks: PollTicks) -> None:
        self._store = store
        self._ticks = ticks
        self._asked: list[StreamRead] = []
        self._busy = False  # a query is under way, or a reader has been told to run one
        self.queries = 0
        self.handed = 0  # chunks taken from the pings that carried them, with no query

    def ask(self, read: StreamRead) -> None:
        """Have ``read`` fetched by the next query (or again after the one it is in)."""
        if read.state is _ASKED or read.state in _DONE:
            return
        if read.state in _BUSY:
            read.again = True
            return
        read.state = _ASKED
        self._asked.append(read)
        if not self._busy:
            self._busy = True
            read.runs_fetch = True
            read.signal()

    def idle(self, read: StreamRead) -> None:
        """``read`` has taken its chunks: hand it the next one if a ping carried it meanwhile; else
        fetch again at once if it was pinged meanwhile, else wait for the next ping or poll tick."""
        if read.kept_at >= 0:  # (kept only while READY or HELD, when no query moves its offset)
            assert read.kept_at == read.offset
            kept, read.kept_at, read.kept = read.kept, -1, None
            read._take(kept)
            return
        read.state = _WAITING
        if read.again:
            read.again = False
            self.ask(read)
        else:
            self._ticks.add(read)

    def drop(self, read: StreamRead) -> None:
        """``read``'s reader has stopped; if it was to run the next query, another asked reader does."""
        if read.state is _ASKED:
            self._asked.remove(read)
        read.state = _CLOSED
        if read.runs_fetch:
            read.runs_fetch = False
            if self._asked:
                self._asked[0].runs_fetch = True
                self._asked[0].signal()
            else:
                self._busy = False

    async def run(self) -> None:
        """Answer every asked reader, in queries of up to ``STREAMS_PER_READ`` streams."""
        try:
            with anyio.CancelScope(shield=True):
                # Readers pinged by the same notification are asked right after this one: let them
                # be, so one query answers them all.
                await asyncio.sleep(0)
                while self._asked:
                    batch = self._next_batch()
                    for read in batch:
                        read.state = _FETCHING
                    try:
                        await self._answer(batch)
                    finally:
                        for read in batch:  # (unanswered: the query was cut short) a ping asks again
                            if read.state is _FETCHING:
                                read.state = _WAITING
        finally:
            self._busy = False

    def _next_batch(self) -> list[StreamRead]:
        """A read whose next chunk is too big to share a query, alone; else the next asked, up to
        ``STREAMS_PER_READ``."""
        for read in self._asked:
            if read.alone:
                self._asked.remove(read)
                read.alone = False
                return [read]
        batch, self._asked = self._asked[:STREAMS_PER_READ], self._asked[STREAMS_PER_READ:]
        return batch

    async def _answer(self, batch: list[StreamRead]) -> None:
        """Answer a batch in one query. When it fails, the halves are tried apart, so a read that
        breaks the query (whatever slipped past the checks) fails alone and the others are answered.
        A query that fails because the server is away is nobody's fault: every reader of it waits
        for the next ping or poll, until the outage has lasted too long."""
        await apart(batch, self._read, self._refused)

    async def _read(self, batch: list[StreamRead]) -> None:
        store = await self._store()
        budget = min(READ_BYTES, QUERY_BYTES // len(batch))
        found, cut, learnt, states = await store.chunks.read_streams(
            [r.sid for r in batch], [r.workflow_id for r in batch], [r.key for r in batch],
            [r.offset for r in batch], READ_BATCH, budget, WHOLE if len(batch) == 1 else budget)
        self.queries += 1
        for n, read in enumerate(batch):
            if read.state is _CLOSED:
                continue
            if learnt:
                read.sid = learnt.get(n, read.sid)
            read.outage.over()
            chunks = found[n]
            if chunks:  # the usual answer, first: the reader is woken with its chunks in hand
                read.offset = chunks[-1][0] + 1
                read.chunks = chunks
                read.state = _READY
                if len(chunks) >= READ_BATCH or n in cut:
                    read.again = True  # more is waiting (cut by count or by size): no need for a ping
                signal = read._signal
                if signal is not None and not signal.done():
                    signal.set_result(None)
                continue
            if n in cut:  # its next chunk alone is over the share of a query of many: one of its own
                read.alone = True
                read.state = _WAITING
                self.ask(read)
                continue
            status, closed = states[n]
            if status is None:
                self._fail(read, UnknownWorkflow(f"no workflow with id {read.workflow_id!r}"))
            elif closed or status in ENDED:
                read.state = _ENDED
                read.signal()
            else:
                self.idle(read)  # nothing new yet

    def _refused(self, batch: list[StreamRead], exc: Exception) -> None:
        if isinstance(exc, psycopg.Error) and unreachable(exc):
            for read in batch:
                self._bear(read, exc)
            return
        [read] = batch
        if read.state is not _CLOSED:
            self._fail(read, exc)

    def _bear(self, read: StreamRead, exc: psycopg.Error) -> None:
        if read.state is _CLOSED:
            return
        try:
            read.outage.bear(exc)
        except psycopg.Error as fatal:  # noqa: BLE001 - the outage lasted too long: the reader gets it
            self._fail(read, fatal)
            return
        self.idle(read)

    @staticmethod
    def _fail(read: StreamRead, exc: BaseException) -> None:
        read.error = exc
        read.state = _FAILED
        read.signal()


def read_batches(fetcher: ChunkFetcher, waiters: Waiters, workflow_id: str, key: str, offset: int) -> StreamRead:
    """Batches of a stream's chunks from ``offset`` on, until it can grow no more (closed, or its
    workflow ended and every chunk it wrote has been read): an async iterator, closed by ``aclose``."""
    return StreamRead(fetcher, waiters, workflow_id, key, offset)


def decoder(decode_as: Any) -> Callable[[bytes], Any]:
    """How a reader decodes each chunk: into builtins, or into ``decode_as``."""
    return codec.untyped.decode if decode_as is Any else functools.partial(codec.decode, type_=decode_as)
