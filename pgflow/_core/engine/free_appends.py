"""The statements that write to free-standing streams: appends, their idempotent producers, closure.

Appends are group-committed: a batch of them, to any streams, is one transaction, however many chunks
and streams it holds, so one WAL flush serves them all; its pings ride on its commit. The batch is
judged (``free_judging.Batch``: each append in the order given, on the state the ones before it left,
by the protocol's checks; one refused writes nothing and leaves the others be) on one of two states:

- what this process knows of its streams (``free_known``: what it last committed to them), in one round
  trip: BEGIN, the locks, the writes (made only if the server finds every stream and producer judged
  on exactly as it was judged on, under the locks), the pings and COMMIT, pipelined;
- else (a stream not known, or the check failed), what its locks read, in two: BEGIN, the locks and
  the producers' state; then the writes, the pings and COMMIT.

The streams are locked (``FOR UPDATE``) in id order, so two batches cannot deadlock, and appends to one
stream are serialised: the producer checks, the chunks and the new tail commit together or not at all
(a retried request finds either everything or nothing).
"""

from __future__ import annotations

from typing import Any, TypedDict, cast

from . import wire
from .channel import NO_PINGS, Pings, Riding
from .database import BEGIN, COMMIT, Database, Session, Sql
from .free_judging import Append, Appended, Appending, Batch, Producer
from .free_known import Known
from .free_rows import COLUMNS, EXPIRED, FreeStream, FreeStreamRows, StreamRow, row_of

__all__ = ["Append", "Appended", "Batch", "FreeAppends", "Producer"]

class Chunking(TypedDict):
    id: int
    batch_end: int
    ends: list[int]
    sizes: list[int]
    datas: list[bytes]


class Tail(TypedDict):
    id: int
    tail: int
    close: bool
    closed_by: str | None
    stream_seq: str | None


# One request's chunks, and the stream's new tail (and closure) on its row.
CHUNKS = Sql(
    "INSERT INTO {s}.free_chunks (stream_id, end_pos, size, batch_end, data)"
    " SELECT %(id)s, e, n, %(batch_end)s, d FROM unnest(%(ends)s::bigint[], %(sizes)s::bigint[],"
    " %(datas)s::bytea[]) AS u(e, n, d)",
    row=None, params=Chunking)
SET_TAIL = Sql(
    "UPDATE {s}.free_streams SET tail = %(tail)s, closed = closed OR %(close)s,"
    " closed_by = CASE WHEN %(close)s AND NOT closed THEN %(closed_by)s ELSE closed_by END,"
    " stream_seq = coalesce(%(stream_seq)s, stream_seq), touched_at = now() WHERE id = %(id)s",
    row=None, params=Tail)
class Locking(TypedDict):
    paths: wire.Texts


class ProducersOf(TypedDict):
    paths: wire.Texts
    producers: wire.Texts


# Group commit, in two round trips (``append_many``): the streams of a batch of appends locked in id order
# (so two batches cannot deadlock), BEGIN before; then, in a snapshot taken once they are locked, the state
# of every producer the batch names (a producer's row changes only under its stream's lock, so it is the
# state the batch's writes follow: read in the locking statement itself, it would be that statement's
# snapshot's, from before a writer it waited for committed); then every write of the batch in one
# statement, COMMIT after. (The producers are probed by the primary key, stream by stream: the OFFSET
# keeps the planner from hashing the whole table instead.)
LOCK_STREAMS = wire.Statement(
    f"SELECT {COLUMNS}, {EXPIRED} FROM {{s}}.free_streams WHERE path = ANY(%(paths)s) ORDER BY id FOR UPDATE",
    row=cast("type[StreamRow]", StreamRow), params=Locking)
PRODUCER_STATES = wire.Statement(
    "SELECT s.id, p.producer, p.epoch, p.seq FROM {s}.free_streams s"
    " JOIN LATERAL (SELECT p.producer, p.epoch, p.seq FROM {s}.free_producers p"
    "  WHERE p.stream_id = s.id AND p.producer = ANY(%(producers)s) OFFSET 0) p ON true"
    " WHERE s.path = ANY(%(paths)s)",
    row=tuple[int, str, int, int], params=ProducersOf)
# Every write of a batch in one statement, made only when every live stream it names (e_*) and every
# producer it judged (k_*: epoch and seq -1 for one that had not written) is, under the batch's locks,
# as the batch was judged on; its one row says whether they were (false: nothing written). Each producer
# is one probe of the primary key (the LATERAL's LIMIT keeps the planner from hashing the whole table:
# with a plain join it read every producer ever written, 0.5 ms a batch at 2,300 of them).
APPEND_MANY = wire.Statement(
    "WITH held AS MATERIALIZED (SELECT (SELECT count(*) FROM unnest(%(e_ids)s::bigint[], %(e_tails)s::bigint[],"
    "   %(e_closed)s::boolean[], %(e_closed_by)s::text[], %(e_seqs)s::text[]) AS e(id, tail, closed, closed_by, sq)"
    "   JOIN {s}.free_streams s ON s.id = e.id AND s.tail = e.tail AND s.closed = e.closed"
    "    AND s.closed_by IS NOT DISTINCT FROM e.closed_by AND s.stream_seq IS NOT DISTINCT FROM e.sq"
    f"   AND NOT s.deleted AND NOT {EXPIRED}) = cardinality(%(e_ids)s::bigint[])"
    "  AND NOT EXISTS (SELECT FROM unnest(%(k_ids)s::bigint[], %(k_names)s::text[], %(k_epochs)s::bigint[],"
    "   %(k_seqs)s::bigint[]) AS k(stream_id, producer, epoch, seq) LEFT JOIN LATERAL (SELECT p.epoch, p.seq"
    "   FROM {s}.free_producers p WHERE p.stream_id = k.stream_id AND p.producer = k.producer LIMIT 1) p ON true"
    "   WHERE coalesce(p.epoch, -1) <> k.epoch OR coalesce(p.seq, -1) <> k.seq) AS ok),"
    " chunks AS (INSERT INTO {s}.free_chunks (stream_id, end_pos, size, batch_end, data)"
    "  SELECT * FROM unnest(%(c_ids)s::bigint[], %(c_ends)s::bigint[], %(c_sizes)s::bigint[],"
    "  %(c_batch_ends)s::bigint[], %(c_datas)s::bytea[]) WHERE (SELECT ok FROM held)),"
    " producers AS (INSERT INTO {s}.free_producers (stream_id, producer, epoch, seq)"
    "  SELECT * FROM unnest(%(p_ids)s::bigint[], %(p_names)s::text[], %(p_epochs)s::bigint[], %(p_seqs)s::bigint[])"
    "  WHERE (SELECT ok FROM held)"
    "  ON CONFLICT (stream_id, producer) DO UPDATE SET epoch = excluded.epoch, seq = excluded.seq),"
    " streams AS (UPDATE {s}.free_streams s SET tail = u.tail, closed = u.closed, closed_by = u.closed_by,"
    "  stream_seq = u.stream_seq, touched_at = now() FROM unnest(%(s_ids)s::bigint[], %(s_tails)s::bigint[],"
    "  %(s_closed)s::boolean[], %(s_closed_by)s::text[], %(s_seqs)s::text[])"
    "  AS u(id, tail, closed, closed_by, stream_seq) WHERE s.id = u.id AND (SELECT ok FROM held))"
    " SELECT ok FROM held",
    row=tuple[bool], params=Appending)
# The batch's pings, sent with its commit (``Signals.ride``): no NOTIFY transaction of the notifier's.
PINGS = wire.Statement("SELECT count(pg_notify(x.c, x.p)) FROM unnest(%(pings_channels)s, %(pings)s) AS x(c, p)",
                       row=tuple[int], params=Riding)


class FreeAppends(FreeStreamRows):
    """Append to free-standing streams (and close them), one request or a group commit."""

    def __init__(self, db: Database) -> None:
        super().__init__(db)
        self.known = Known()
        # Batches committed in one round trip on what was known, found changed (then locked), locked.
        self.batches = {"known": 0, "changed": 0, "locked": 0}

    async def _write(self, s: Session, stream_id: int, tail: int, json_mode: bool,
                     units: list[bytes], close: bool, closed_by: str | None, stream_seq: str | None) -> int:
        """The chunks of one request, in one statement; the new tail (and closure) on the row."""
        if units:
            sizes = [1 if json_mode else len(u) for u in units]
            ends, at = [], tail
            for size in sizes:
                at += size
                ends.append(at)
            await s.run(CHUNKS, id=stream_id, ends=ends, sizes=sizes, datas=units, batch_end=at)
            tail = at
        await s.run(SET_TAIL, id=stream_id, tail=tail, close=close, closed_by=closed_by, stream_seq=stream_seq)
        return tail

    async def append_many(self, appends: list[Append], pings: Pings = NO_PINGS) -> list[Appended | Exception]:
        """Group commit: a batch of appends (to any streams) in one transaction, each append judged as
        ``append`` judges it, in the order given, on the state the ones before it left: in one round
        trip when this process knows the state of every stream and producer the batch names and the
        server finds them unchanged, else in two (the locks and what they guard, then the writes). An
        append refused (or whose body ``units_of`` refuses: its exception is its answer) writes nothing;
        the others are unaffected. The ``pings`` go out with the commit, only with writes."""
        paths = {append.path for append in appends}
        try:
            known = self.known.batch(appends)
            if known is not None:
                done = await self.db.pipelined(lambda s: self._as_known(s, appends, known, pings))
                if done is not None:
                    return done
            return await self.db.pipelined(lambda s: self._locked(s, appends, pings))
        except BaseException:
            self.known.forget(paths)  # (it may have committed: what it left is the server's to say)
            raise

    async def _as_known(self, s: Session, appends: list[Append], known: Batch,
                        pings: Pings) -> list[Appended | Exception] | None:
        """The batch judged on what is known, in one round trip; None when the server found a stream or
        producer changed (nothing written; those streams are contended)."""
        batch = Batch(dict(known.before), dict(known.before_states))  # (afresh: the body may run twice)
        results = [batch.take(append) for append in appends]
        _, rows, [(held,)], *_ = await s.pipeline(
            BEGIN.step(), LOCK_STREAMS.step(paths=sorted(batch.streams)), APPEND_MANY.step(**batch.params()),
            *self._pings(batch, pings), COMMIT.step())
        if not held:
            changed = {stream.path for stream, expired in map(row_of, rows) if self.known.differs(stream, expired)}
            self.known.contend(changed or set(batch.streams))
            self.batches["changed"] += 1
            return None
        self.known.learn(appends, batch)
        self.batches["known"] += 1
        return results

    async def _locked(self, s: Session, appends: list[Append], pings: Pings) -> list[Appended | Exception]:
        """The batch judged on what its locks read, in two round trips."""
        batch = await self._lock_batch(s, appends)
        results = [batch.take(append) for append in appends]
        if batch.written:
            [(held,)], *_ = await s.pipeline(APPEND_MANY.step(**batch.params()), *self._pings(batch, pings),
                                             COMMIT.step())
            if not held:  # (the rows are locked, the producers read since: nobody else could change them)
                raise RuntimeError("a batch of appends found the streams it had locked changed")
        self.known.learn(appends, batch)
        self.batches["locked"] += 1
        return results

    @staticmethod
    def _pings(batch: Batch, pings: Pings) -> list[wire.Step[Any]]:
        if not batch.written or not pings.payloads:
            return []
        return [PINGS.step(pings_channels=pings.channels, pings=pings.payloads)]

    async def _lock_batch(self, s: Session, appends: list[Append]) -> Batch:
        """Begin, lock the streams the appends name (deleting the expired ones), and read their
        producers' state."""
        paths = sorted({a.path for a in appends})
        _, rows, producers = await s.pipeline(
            BEGIN.step(), LOCK_STREAMS.step(paths=paths),
            PRODUCER_STATES.step(paths=paths,
                                 producers=sorted({a.producer.id for a in appends if a.producer is not None})))
        streams: dict[str, FreeStream] = {}
        for row in rows:
            stream, expired = row_of(row)
            if expired and not stream.deleted:
                await self._remove(s, stream.id)
                continue
            streams[stream.path] = stream
        live = {stream.id for stream in streams.values()}
        return Batch(streams, {(stream_id, producer): (epoch, seq)
                               for stream_id, producer, epoch, seq in producers if stream_id in live})
