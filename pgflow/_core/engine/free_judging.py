"""The protocol's rules for appends to free-standing streams, apart from the SQL: what a POST asks
(``Append``), what it comes to (``Appended``), and a group commit's judging (``Batch``): each append of a
batch judged in the order given, on the state the ones before it left, by the protocol's checks (closed
first, then the body, the producer, Stream-Seq), and the writes of those that go on gathered as the
arrays of one statement. Pure: the state judged on is given (read under the streams' locks, or what
this process knows of them, ``free_known``), so the same appends on the same state come to the same
answers and writes.

Positions count bytes, or messages in JSON mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypedDict

from . import wire
from .free_rows import FreeStream, base_type

ABSENT = (-1, -1)  # (epoch, seq) of a producer that has not written to a stream: as the statements say it


class Appending(TypedDict):
    """The parameters of ``free_appends.APPEND_MANY``, as arrays: the state a batch was judged on (its live
    streams, e_*; the producers it judged, k_*), its chunks (c_*), its producers' new state (p_*), its
    streams' new tail, closure and Stream-Seq (s_*)."""

    e_ids: wire.Int8s
    e_tails: wire.Int8s
    e_closed: wire.Bools
    e_closed_by: wire.Texts
    e_seqs: wire.Texts
    k_ids: wire.Int8s
    k_names: wire.Texts
    k_epochs: wire.Int8s
    k_seqs: wire.Int8s
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
class Batch:
    """A group commit being judged: the state of its streams and producers as the appends judged so far
    left it, and the writes they make, gathered as the arrays of ``APPEND_MANY``; ``expected`` is the
    state it was judged on, which the server checks before it writes."""

    streams: dict[str, FreeStream]
    states: dict[tuple[int, str], tuple[int, int]]
    named: set[tuple[int, str]] = field(default_factory=set)  # (stream id, producer) of every producer judged
    before: dict[str, FreeStream] = field(default_factory=dict)
    before_states: dict[tuple[int, str], tuple[int, int]] = field(default_factory=dict)
    chunk_ids: list[int] = field(default_factory=list)
    chunk_ends: list[int] = field(default_factory=list)
    chunk_sizes: list[int] = field(default_factory=list)
    chunk_batch_ends: list[int] = field(default_factory=list)
    chunk_datas: list[bytes] = field(default_factory=list)
    written: dict[int, FreeStream] = field(default_factory=dict)
    touched: dict[tuple[int, str], tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.before, self.before_states = dict(self.streams), dict(self.states)

    def take(self, append: Append) -> Appended | Exception:
        """Judge ``append`` on the batch's state; if it goes on, add its writes and move the state on."""
        stream = self.streams.get(append.path)
        if stream is not None and append.producer is not None:
            self.named.add((stream.id, append.producer.id))
        try:
            result = _judge(append, stream, self.states)
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
        after = FreeStream(  # (dataclasses.replace, field by field, took a fifth of the judging's CPU)
            stream.id, stream.path, stream.content_type, tail, stream.closed or append.close,
            (producer.mark() if producer else "") if closing else stream.closed_by, stream.ttl, stream.expires_at,
            append.stream_seq if append.stream_seq is not None else stream.stream_seq, stream.forked_from,
            stream.fork_offset, stream.fork_anchor, stream.fork_sub, stream.deleted)
        self.streams[stream.path] = self.written[stream.id] = after
        if producer is None:
            return Appended("ok", after, 0, 0, units=tuple(units))
        self.states[(stream.id, producer.id)] = self.touched[(stream.id, producer.id)] = (producer.epoch,
                                                                                          producer.seq)
        return Appended("ok", after, producer.epoch, producer.seq, units=tuple(units))

    def params(self) -> Appending:
        """The parameters of ``APPEND_MANY``: the state the batch was judged on (every live stream it
        names, every producer it judged), and every write of the batch."""
        live = [stream for stream in self.before.values() if not stream.deleted]
        named = sorted(self.named)
        ids = list(self.written)
        return {
            "e_ids": [s.id for s in live], "e_tails": [s.tail for s in live], "e_closed": [s.closed for s in live],
            "e_closed_by": [s.closed_by for s in live], "e_seqs": [s.stream_seq for s in live],
            "k_ids": [k[0] for k in named], "k_names": [k[1] for k in named],
            "k_epochs": [self.before_states.get(k, ABSENT)[0] for k in named],
            "k_seqs": [self.before_states.get(k, ABSENT)[1] for k in named],
            "c_ids": self.chunk_ids, "c_ends": self.chunk_ends, "c_sizes": self.chunk_sizes,
            "c_batch_ends": self.chunk_batch_ends, "c_datas": self.chunk_datas,
            "p_ids": [k[0] for k in self.touched], "p_names": [k[1] for k in self.touched],
            "p_epochs": [v[0] for v in self.touched.values()], "p_seqs": [v[1] for v in self.touched.values()],
            "s_ids": ids, "s_tails": [self.written[i].tail for i in ids],
            "s_closed": [self.written[i].closed for i in ids],
            "s_closed_by": [self.written[i].closed_by for i in ids],
            "s_seqs": [self.written[i].stream_seq for i in ids]}


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
