"""The statements that write to free-standing streams: appends, their idempotent producers, closure.

Appends are group-committed: a batch of them, to any streams, is one transaction of two round trips
(``append_many``: lock and read, then every write at once), however many chunks and streams it holds, so
one WAL flush serves them all. Each append of a batch is judged in the order given, on the state the ones before
it left, by the protocol's checks (``_judge``, ``_check_producer``); one refused writes nothing and leaves
the others be. The streams are locked (``FOR UPDATE``) in id order, so two batches cannot deadlock, and
appends to one stream are serialised: the producer checks, the chunks and the new tail commit together
or not at all (a retried request finds either everything or nothing).

Positions count bytes, or messages in JSON mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TypedDict, cast

from . import wire
from .channel import NO_PINGS, Pings, Riding
from .database import BEGIN, COMMIT, Session, Sql
from .free_rows import COLUMNS, EXPIRED, FreeStream, FreeStreamRows, StreamRow, base_type, row_of

# One request's chunks, and the stream's new tail (and closure) on its row.
CHUNKS = Sql(
    "INSERT INTO {s}.free_chunks (stream_id, end_pos, size, batch_end, data)"
    " SELECT %(id)s, e, n, %(batch_end)s, d FROM unnest(%(ends)s::bigint[], %(sizes)s::bigint[],"
    " %(datas)s::bytea[]) AS u(e, n, d)"
)
SET_TAIL = Sql(
    "UPDATE {s}.free_streams SET tail = %(tail)s, closed = closed OR %(close)s,"
    " closed_by = CASE WHEN %(close)s AND NOT closed THEN %(closed_by)s ELSE closed_by END,"
    " stream_seq = coalesce(%(stream_seq)s, stream_seq), touched_at = now() WHERE id = %(id)s"
)
# Group commit, in two round trips (``append_many``): the streams of a batch of appends locked in id order
# (so two batches cannot deadlock), BEGIN before; then, in a snapshot taken once they are locked, the state
# of every producer the batch names (a producer's row changes only under its stream's lock, so it is the
# state the batch's writes follow: read in the locking statement itself, it would be that statement's
# snapshot's, from before a writer it waited for committed); then every write of the batch in one
# statement, COMMIT after.
class Locking(TypedDict):
    paths: wire.Texts


class ProducersOf(TypedDict):
    paths: wire.Texts
    producers: wire.Texts


class Appending(TypedDict):
    """Every write of a batch, as arrays: its chunks (c_*), its producers' new state (p_*), its streams'
    new tail, closure and Stream-Seq (s_*)."""

    c_ids: wire.Int8s
    c_ends: wire.Int8s
    c_sizes: wire.Int8s
    c_batch_ends: wire.Int8s
    c_datas: wire.Byteas
    p_ids: wire.Int8s
    p_names: wire.Texts
    p_epochs: wire.Int8s
    p_seqs: wire.Int8s
    s_ids: wire.Int8s
    s_tails: wire.Int8s
    s_closed: wire.Bools
    s_closed_by: wire.Texts
    s_seqs: wire.Texts


LOCK_STREAMS = wire.Statement(
    f"SELECT {COLUMNS}, {EXPIRED} FROM {{s}}.free_streams WHERE path = ANY(%(paths)s) ORDER BY id FOR UPDATE",
    row=cast("type[StreamRow]", StreamRow), params=Locking)
PRODUCER_STATES = wire.Statement(
    "SELECT p.stream_id, p.producer, p.epoch, p.seq FROM {s}.free_streams s"
    " JOIN {s}.free_producers p ON p.stream_id = s.id"
    " WHERE s.path = ANY(%(paths)s) AND p.producer = ANY(%(producers)s)",
    row=tuple[int, str, int, int], params=ProducersOf)
APPEND_MANY = wire.Statement(
    "WITH chunks AS (INSERT INTO {s}.free_chunks (stream_id, end_pos, size, batch_end, data)"
    "  SELECT * FROM unnest(%(c_ids)s::bigint[], %(c_ends)s::bigint[], %(c_sizes)s::bigint[],"
    "  %(c_batch_ends)s::bigint[], %(c_datas)s::bytea[])),"
    " producers AS (INSERT INTO {s}.free_producers (stream_id, producer, epoch, seq)"
    "  SELECT * FROM unnest(%(p_ids)s::bigint[], %(p_names)s::text[], %(p_epochs)s::bigint[], %(p_seqs)s::bigint[])"
    "  ON CONFLICT (stream_id, producer) DO UPDATE SET epoch = excluded.epoch, seq = excluded.seq)"
    " UPDATE {s}.free_streams s SET tail = u.tail, closed = u.closed, closed_by = u.closed_by,"
    " stream_seq = u.stream_seq, touched_at = now() FROM unnest(%(s_ids)s::bigint[], %(s_tails)s::bigint[],"
    " %(s_closed)s::boolean[], %(s_closed_by)s::text[], %(s_seqs)s::text[])"
    " AS u(id, tail, closed, closed_by, stream_seq)"
    " WHERE s.id = u.id",
    row=None, params=Appending)
# The batch's pings, sent with its commit (``Signals.ride``): no NOTIFY transaction of the notifier's.
PINGS = wire.Statement("SELECT count(pg_notify(x.c, x.p)) FROM unnest(%(pings_channels)s, %(pings)s) AS x(c, p)",
                       row=tuple[int], params=Riding)


@dataclass(frozen=True)
class Producer:
    """An idempotent producer's headers."""

    id: str
    epoch: int
    seq: int

    def mark(self) -> str:
        return f"{self.epoch}:{self.seq}:{self.id}"


@dataclass(frozen=True)
class Appended:
    """``outcome``: "ok", "duplicate", "missing", "gone", "closed", "type", "seq", "stale_epoch",
    "epoch_seq" (a new epoch that does not start at 0), "gap". ``epoch``/``seq``: the producer's
    state the answer reports; ``expected``: the seq a gap wanted; ``units``: what an "ok" wrote, ending
    at ``stream.tail``."""

    outcome: str
    stream: FreeStream | None = None
    epoch: int = 0
    seq: int = 0
    expected: int = 0
    units: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class Append:
    """One POST: its body's units as ``units_of(stream)`` splits them (by the stream's mode; it may raise,
    for a body the stream's mode refuses), and what its headers ask."""

    path: str
    content_type: str | None
    has_body: bool
    units_of: Callable[[FreeStream], list[bytes]]
    close: bool
    stream_seq: str | None
    producer: Producer | None


@dataclass
class _Batch:
    """A group commit being judged: the state of its streams and producers as the appends judged so far
    left it, and the writes they make, gathered as the arrays of ``APPEND_MANY``."""

    streams: dict[str, FreeStream]
    states: dict[tuple[int, str], tuple[int, int]]
    chunk_ids: list[int] = field(default_factory=list)
    chunk_ends: list[int] = field(default_factory=list)
    chunk_sizes: list[int] = field(default_factory=list)
    chunk_batch_ends: list[int] = field(default_factory=list)
    chunk_datas: list[bytes] = field(default_factory=list)
    written: dict[int, FreeStream] = field(default_factory=dict)
    touched: dict[tuple[int, str], tuple[int, int]] = field(default_factory=dict)

    def take(self, append: Append) -> Appended | Exception:
        """Judge ``append`` on the batch's state; if it goes on, add its writes and move the state on."""
        try:
            result = _judge(append, self.streams.get(append.path), self.states)
        except Exception as exc:  # noqa: BLE001 - the body's own refusal: this append's answer alone
            return exc
        if isinstance(result, Appended):
            return result
        stream, units = result
        return self._add(append, stream, units)

    def _add(self, append: Append, stream: FreeStream, units: list[bytes]) -> Appended:
        json_mode = base_type(stream.content_type) == "application/json"
        tail = stream.tail
        for unit in units:
            size = 1 if json_mode else len(unit)
            tail += size
            self.chunk_ids.append(stream.id)
            self.chunk_ends.append(tail)
            self.chunk_sizes.append(size)
            self.chunk_datas.append(unit)
        self.chunk_batch_ends.extend([tail] * len(units))
        producer = append.producer
        closing = append.close and not stream.closed
        after = replace(stream, tail=tail, closed=stream.closed or append.close,
                        closed_by=(producer.mark() if producer else "") if closing else stream.closed_by,
                        stream_seq=append.stream_seq if append.stream_seq is not None else stream.stream_seq)
        self.streams[stream.path] = self.written[stream.id] = after
        if producer is None:
            return Appended("ok", after, 0, 0, units=tuple(units))
        self.states[(stream.id, producer.id)] = self.touched[(stream.id, producer.id)] = (producer.epoch,
                                                                                          producer.seq)
        return Appended("ok", after, producer.epoch, producer.seq, units=tuple(units))

    def params(self) -> Appending:
        """The parameters of ``APPEND_MANY``: every write of the batch."""
        ids = list(self.written)
        return {
            "c_ids": self.chunk_ids, "c_ends": self.chunk_ends, "c_sizes": self.chunk_sizes,
            "c_batch_ends": self.chunk_batch_ends, "c_datas": self.chunk_datas,
            "p_ids": [k[0] for k in self.touched], "p_names": [k[1] for k in self.touched],
            "p_epochs": [v[0] for v in self.touched.values()], "p_seqs": [v[1] for v in self.touched.values()],
            "s_ids": ids, "s_tails": [self.written[i].tail for i in ids],
            "s_closed": [self.written[i].closed for i in ids],
            "s_closed_by": [self.written[i].closed_by for i in ids],
            "s_seqs": [self.written[i].stream_seq for i in ids]}


class FreeAppends(FreeStreamRows):
    """Append to free-standing streams (and close them), one request or a group commit."""

    async def _write(self, s: Session, stream_id: int, tail: int, json_mode: bool,
                     units: list[bytes], close: bool, closed_by: str | None, stream_seq: str | None) -> int:
        """The chunks of one request, in one statement; the new tail (and closure) on the row."""
        if units:
            sizes = [1 if json_mode else len(u) for u in units]
            ends, at = [], tail
            for size in sizes:
                at += size
                ends.append(at)
            await s.run(CHUNKS, {"id": stream_id, "ends": ends, "sizes": sizes, "datas": units, "batch_end": at})
            tail = at
        await s.run(SET_TAIL, {"id": stream_id, "tail": tail, "close": close, "closed_by": closed_by,
                               "stream_seq": stream_seq})
        return tail

    async def append_many(self, appends: list[Append], pings: Pings = NO_PINGS) -> list[Appended | Exception]:
        """Group commit: a batch of appends (to any streams) in one transaction of two round trips (the
        locks and the state they guard, then the writes, the ``pings`` and the commit), each append
        judged as ``append`` judges it, in the order given, on the state the ones before it left. An
        append refused (or whose body ``units_of`` refuses: its exception is its answer) writes nothing;
        the others are unaffected. The pings go out only with writes (a batch that writes nothing has
        nothing to tell)."""
        return await self.db.pipelined(lambda s: self._append_many(s, appends, pings))

    async def _append_many(self, s: Session, appends: list[Append], pings: Pings) -> list[Appended | Exception]:
        batch = await self._lock_batch(s, appends)
        results = [batch.take(append) for append in appends]
        if batch.written:
            told = [PINGS.step(pings_channels=pings.channels, pings=pings.payloads)] if pings.payloads else []
            await s.pipeline(APPEND_MANY.step(**batch.params()), *told, COMMIT.step())
        return results

    async def _lock_batch(self, s: Session, appends: list[Append]) -> _Batch:
        """Begin, lock the streams the appends name (deleting the expired ones), and read their
        producers' state."""
        paths = sorted({a.path for a in appends})
        _, rows, producers = await s.pipeline(
            BEGIN.step(), LOCK_STREAMS.step(paths=paths),
            PRODUCER_STATES.step(paths=paths,
                                 producers=sorted({a.producer.id for a in appends if a.producer is not None})))
        batch = _Batch({}, {})
        for row in rows:
            stream, expired = row_of(row)
            if expired and not stream.deleted:
                await self._remove(s, stream.id)
                continue
            batch.streams[stream.path] = stream
        live = {stream.id for stream in batch.streams.values()}
        for stream_id, producer, epoch, seq in producers:
            if stream_id in live:
                batch.states[(stream_id, producer)] = (epoch, seq)
        return batch


def _judge(append: Append, stream: FreeStream | None,
           states: dict[tuple[int, str], tuple[int, int]]) -> Appended | tuple[FreeStream, list[bytes]]:
    """The protocol's checks of one append, in its order (closed first): the refusal, or the stream and
    the units to write."""
    producer = append.producer
    if stream is None:
        return Appended("missing")
    if stream.deleted:
        return Appended("gone", stream)
    if stream.closed:
        if producer is not None and stream.closed_by == producer.mark():
            return Appended("duplicate", stream, producer.epoch, producer.seq)
        return Appended("closed" if append.has_body else "duplicate", stream)
    units = append.units_of(stream)
    if units and append.content_type is not None and base_type(append.content_type) != base_type(stream.content_type):
        return Appended("type", stream)
    if producer is not None:
        refused = _check_producer(stream, states.get((stream.id, producer.id)), producer)
        if refused is not None:
            return refused
    if append.stream_seq is not None and stream.stream_seq is not None and append.stream_seq <= stream.stream_seq:
        return Appended("seq", stream)
    return stream, units


def _check_producer(stream: FreeStream, state: tuple[int, int] | None, producer: Producer) -> Appended | None:
    """The idempotent producer's rules (PROTOCOL.md 5.2.1); None when the append goes on."""
    if state is None:
        if producer.seq != 0:
            return Appended("gap", stream, producer.epoch, producer.seq, expected=0)
        return None
    epoch, last = state
    if producer.epoch < epoch:
        return Appended("stale_epoch", stream, epoch, last)
    if producer.epoch > epoch:
        return None if producer.seq == 0 else Appended("epoch_seq", stream, producer.epoch, producer.seq)
    if producer.seq <= last:
        return Appended("duplicate", stream, epoch, last)
    if producer.seq > last + 1:
        return Appended("gap", stream, epoch, last, expected=last + 1)
    return None
