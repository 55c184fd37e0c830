"""Group-committed stream writes, one writer per worker.

Writing a chunk is an INSERT, but not one per chunk: the chunks of every execution in a worker are
gathered while earlier batches commit (two may be in flight) and then written in one multi-row INSERT,
and each writer awaits its batch's commit. Under load batches grow by themselves; when idle a chunk
goes out at once. Writers that keep in step with their commits (each awaits its chunk before it writes
the next, as a token stream does) all land in one batch per round trip. With the server on another
machine, the worker would then sit idle for a network round trip each round and the server while the
worker runs the next chunks: there a long enough queue, with no batch in flight, goes out as two
cohorts, and from then on each cohort's writers write while the other's statement runs. With the
server on this machine the statement runs on the cores the worker would overlap it with, and the
second statement a round costs CPU on both ends and a wakeup of the server that takes the worker's
core: one batch a round is faster there (benchmarks/README.md, session 21: 9-18% more chunks a
second with ``start_many``, and less CPU per chunk in the worker and the server).

A batch's news rides on its commit (one NOTIFY naming its streams, and carrying the
chunk of every stream that has just one in the batch, when it is small): the batch is already the
coalescing, and a second transaction per batch would double the round trips of the hot path. A batch
with a fenced-out chunk sends nothing with its commit (a chunk that was not written must not reach a
reader through its news): its streams are named plainly afterwards, through the notifier.

Positions are dense per (workflow, key). The execution that holds a workflow's lease is the only writer
of its streams (fencing refuses the others), so it assigns positions in memory, from the stream ends
read once when it starts. A batch that fails is retried whole; if it cannot be written, every execution
that had a chunk in it is interrupted and given back to the queue, so no later chunk of theirs lands
behind a gap, and the execution that resumes them reads the ends afresh.

A chunk goes out only while its run has no reason to stop (its ``RunState``): looked at as a batch is
taken, and again before each half of a batch the server refused, so nothing of a run lands after a
chunk of its that did not. What the writer learns (a lease lost, a cancel, a batch that failed or was
refused) it tells the run's state, which keeps the reason that decides (run_state.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from .. import telemetry
from ..batches import GroupCommit, apart
from ..engine import Engine, Pings, retrying, unreachable
from ..engine.chunks import Written
from ..run_state import ChunkRefused, RunOver, RunState, StreamWriteFailed
from ..signals import Chunk, News, Signals
from ..signals import keys as signal_keys
from ..signals.payload import CARRY_CHUNK_AT_MOST

CARRY_PER_BATCH = 32_000  # bytes of chunks carried by one batch's news; the rest of a wide batch is named
COHORT_AT_LEAST = 32  # chunks: with cohorts, a queue of twice this and nothing in flight goes as two batches

log = logging.getLogger("pgflow.streams")

class Owner(Protocol):
    """The run a chunk is written for (``run_streams.RunStreams``): its fencing token, and its state,
    which is told when it must stop."""

    workflow_id: str
    lease_token: int
    state: RunState
    named_streams: dict[str, Stream]  # per key, what the writer knows of the stream
    fence: tuple[str, int] | None  # the worker fence it was claimed under, while that holds
    chunks_in_flight: int  # of its chunks, those in a batch being written
    fence_cut: str | None  # the worker whose fence a batch of its chunks held when it was cut off
    settled: asyncio.Future[None] | None  # done once none is (see ``StreamWriter.settle``)


class Stream:
    """One stream of an execution as the writer knows it: its signal key, made once, and its id in
    the table once it is known (asked for with the first batch that holds a chunk of it). The
    object itself names the stream in the writer's bookkeeping: no tuple per chunk."""

    __slots__ = ("ping", "id")

    def __init__(self, ping: str) -> None:
        self.ping = ping
        self.id: int | None = None


class _Pending:
    """A chunk waiting for its batch; its writer awaits ``done`` (a bare future: the cheapest
    thing to wait on, and there is one per chunk), which fails with the reason when the chunk was
    not written."""

    __slots__ = ("owner", "key", "position", "value", "stream", "done")

    def __init__(self, owner: Owner, key: str, position: int, value: bytes | None, stream: Stream,
                 done: asyncio.Future[None]) -> None:
        self.owner = owner
        self.key = key
        self.position = position
        self.value = value
        self.stream = stream
        self.done = done

    def resolve(self, error: BaseException | None = None) -> None:
        if not self.done.done():  # its writer may have been cancelled meanwhile
            if error is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(error)


class StreamWriter(GroupCommit[_Pending]):
    """Group commit for the chunks of every execution in one worker. A stream's chunks never ride in
    two batches in flight at once: each batch commits a stream's chunks in order, after every earlier
    one, so a reader never sees a gap, and a batch that fails leaves nothing of its streams committed
    behind it."""

    def __init__(self, store: Engine, signals: Signals, *, cohorts: bool, max_batch: int = 5000,
                 max_in_flight: int = 2) -> None:
        super().__init__(max_batch, max_in_flight)
        self._store = store
        self._signals = signals
        self.cohorts = cohorts  # whether writers in step are cut in two (the server is elsewhere)
        self._busy: set[Stream] = set()  # the streams with a chunk in a batch in flight
        self._loop = asyncio.get_running_loop()
        self.batches = 0
        self.chunks = 0

    def put(self, owner: Owner, key: str, position: int, value: bytes | None) -> asyncio.Future[None]:
        """Queue one chunk: the future is done once its batch has committed. (The writer awaits the
        future itself, not a coroutine around it: one frame less to resume for every chunk.)"""
        stream = owner.named_streams.get(key)
        if stream is None:
            stream = owner.named_streams[key] = Stream(signal_keys.stream(owner.workflow_id, key))
        done: asyncio.Future[None] = self._loop.create_future()
        self._put(_Pending(owner, key, position, value, stream, done))
        return done

    def _take_batch(self) -> list[_Pending]:
        batch: list[_Pending] = []
        waiting: list[_Pending] = []
        limit = self._max_batch
        if self.cohorts and not self._in_flight and len(self._queue) >= 2 * COHORT_AT_LEAST:
            # Nothing in flight: half now and half right after, so that the writers of one half
            # write their next chunks while the other half's statement runs (see the module's doc).
            limit = min(limit, (len(self._queue) + 1) // 2)
        busy = self._busy
        for p in self._queue:
            reason = p.owner.state.reason
            if reason is not None:
                p.resolve(reason)  # a run that must stop (a failed batch's included): nothing more goes out
            elif len(batch) >= limit or p.stream in busy:
                waiting.append(p)
            else:
                batch.append(p)
        self._queue = waiting
        busy.update([p.stream for p in batch])
        for p in batch:
            p.owner.chunks_in_flight += 1
        return batch

    def _sent(self, batch: list[_Pending]) -> None:
        self._busy.difference_update([p.stream for p in batch])
        for p in batch:
            owner = p.owner
            owner.chunks_in_flight -= 1
            if not owner.chunks_in_flight and owner.settled is not None and not owner.settled.done():
                owner.settled.set_result(None)

    def settle(self, owner: Owner) -> asyncio.Future[None] | None:
        """Stop an execution's chunks before its workflow changes hands (its end, a retry, a wait,
        a release): none queued goes out from now on, and the future, when there is one, is done once
        the batches holding some of them are. A batch fenced by its worker does not look at the
        workflow's row, so one that committed after the row moved on could land in a stream its next
        owner writes, or after the end its readers saw."""
        state = owner.state
        if state.reason is None:  # (the usual case: no reason is made when a stronger one stands)
            state.interrupt(RunOver(f"the run of workflow {owner.workflow_id!r} is over"))
        if not owner.chunks_in_flight:
            return None
        if owner.settled is None:
            owner.settled = self._loop.create_future()
        return owner.settled

    async def _flush(self, batch: list[_Pending]) -> None:
        """Write a batch. A batch refused by the server for its content (not an outage) is split
        and its halves written apart, so one execution's bad chunk interrupts that execution only;
        a later half skips the executions an earlier half interrupted, so no stream gets a gap."""
        await apart(batch, self._write, self._refused)

    async def _write(self, batch: list[_Pending]) -> None:
        batch = [p for p in batch if not self._must_stop(p)]
        if not batch:
            return
        # What the statement sends: the executions of the batch, each named once (a chunk names its
        # own by its index), and each chunk's columns.
        index: dict[Owner, int] = {}
        for p in batch:
            index.setdefault(p.owner, len(index) + 1)
        owners = [(owner.workflow_id, owner.lease_token) for owner in index]
        chunk_owners = [index[p.owner] for p in batch]
        positions = [p.position for p in batch]
        values = [p.value for p in batch]
        unnamed = [p for p in batch if p.stream.id is None]
        maybe_written = False  # an earlier try may have committed (its answer was lost)

        # One worker fence for the whole batch when every execution in it was claimed under the same
        # one (the usual case); otherwise each workflow's row is the fence.
        fences = {owner.fence for owner in index}
        fence = fences.pop() if len(fences) == 1 else None

        async def write(pings: Pings) -> Written:
            nonlocal maybe_written
            stream_ids = [p.stream.id for p in batch]
            assert None not in stream_ids
            try:
                return await self._store.chunks.write_chunks(
                    owners, chunk_owners, stream_ids, positions, values, pings,  # type: ignore[arg-type]
                    again=maybe_written, fence=fence)
            except Exception as exc:
                maybe_written = maybe_written or unreachable(exc)
                raise

        if unnamed:  # the first chunks of their streams: the streams are named first
            await retrying(lambda: self._name(unnamed), f"naming {len(unnamed)} streams")
        news = self._news(batch)
        try:
            (fenced, cancelled, fence_held), rode = await retrying(lambda: self._signals.ride(news, write),
                                                                   f"a batch of {len(batch)} chunks")
        except Exception:
            if fence is not None and maybe_written:
                # A try cut off may still be running on the server, under the fence's lock and past
                # its check: whoever gives these workflows back waits for it (``Engine.release``).
                for owner in index:
                    owner.fence_cut = fence[0]
            raise
        if not fence_held:  # taken over, or lost with a crash: their rows fence them from now on
            for owner in index:
                owner.fence = None
        self.batches += 1
        self.chunks += len(batch)
        telemetry.chunks_written.add(len(batch))
        telemetry.batch_sizes.record(len(batch))
        self._answer(batch, news, rode, fenced, cancelled)

    def _answer(self, batch: list[_Pending], news: News, rode: bool, fenced: set[tuple[str, int]],
                cancelled: set[str]) -> None:
        """Answer each writer of a batch that was sent: written, or stopped by what the batch found."""
        if not fenced and not cancelled:  # the usual case: every chunk of the batch is in
            for p in batch:
                p.resolve(p.owner.state.reason)  # (an execution stopped meanwhile: its writer stops here)
            self._signals.told(news, rode)
            return
        for p in batch:
            state = p.owner.state
            if (p.owner.workflow_id, p.owner.lease_token) in fenced:
                p.resolve(state.lose_lease())
                continue
            if p.owner.workflow_id in cancelled and not state.cancelled:
                state.cancel()
            p.resolve(state.reason)  # committed, but its writer stops here
        if fenced:  # nothing rode: the streams are named, plainly, to every process
            self._signals.announce(news.plain())
        else:
            self._signals.told(news, rode)

    async def _name(self, unnamed: list[_Pending]) -> None:
        ids = await self._store.chunks.stream_ids([p.owner.workflow_id for p in unnamed], [p.key for p in unnamed])
        for p in unnamed:
            p.stream.id = ids[(p.owner.workflow_id, p.key)]

    @staticmethod
    def _news(batch: list[_Pending]) -> News:
        """The news of a batch: each stream it grew, with the stream's chunk when the batch holds
        only one of it (the usual case for a writer in step with its commits) and that one is small,
        up to ``CARRY_PER_BATCH`` bytes of carried chunks."""
        only: dict[Stream, _Pending | None] = {}
        for p in batch:
            only[p.stream] = None if p.stream in only else p
        keys: list[str] = []
        chunks: list[Chunk] = []
        budget = CARRY_PER_BATCH
        for stream, single in only.items():
            if single is not None and budget > 0 and (single.value is None or len(single.value) <= CARRY_CHUNK_AT_MOST):
                assert stream.id is not None
                chunks.append(Chunk(stream.ping, stream.id, single.position, single.value))
                budget -= len(stream.ping) + (len(single.value) if single.value is not None else 0)
            else:
                keys.append(stream.ping)
        return News(keys, [], chunks)

    @staticmethod
    def _refused(batch: list[_Pending], exc: Exception) -> None:
        """An outage past ``retrying``'s patience: every execution of the batch stops and is run
        again from its journal. Otherwise the server refuses this one chunk itself: trying it again
        cannot help, so its workflow fails with the reason instead of being run again and again."""
        if unreachable(exc):
            log.error("a batch of %d chunks could not be written: %s", len(batch), exc)
            for p in batch:
                p.resolve(p.owner.state.interrupt(StreamWriteFailed(
                    f"chunks of workflow {p.owner.workflow_id!r} could not be written: {exc}")))
            return
        [p] = batch
        log.error("a chunk of stream %r of workflow %r was refused: %s", p.key, p.owner.workflow_id, exc)
        p.resolve(p.owner.state.interrupt(ChunkRefused(
            f"a chunk of stream {p.key!r} could not be stored ({type(exc).__name__}: {exc})")))

    @staticmethod
    def _must_stop(p: _Pending) -> bool:
        """Whether ``p``'s run has a reason to stop (its chunk is then answered with it, not sent).
        The reason of a chunk not written is never replaced by a weaker one (run_state.py), so the
        later half of a split batch skips every chunk after the one refused."""
        reason = p.owner.state.reason
        if reason is not None:
            p.resolve(reason)
            return True
        return False
