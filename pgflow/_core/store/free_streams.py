"""The statements of free-standing Durable Streams (``pgflow streams serve``): tables of 0029.

Each method is one transaction. A write locks its stream's row first (``FOR UPDATE``): appends to one
stream are serialised, so the producer checks, the chunks and the new tail commit together or not at
all (a retried request finds either everything or nothing). Appends are group-committed: a batch of
them, to any streams, is one transaction of three statements (``append_many``), however many chunks
and streams it holds. Expiry is decided by the server's clock (``now()``), so every process agrees; an
expired stream is deleted by the first request that finds it (or by the prune), and answers as if it
had never been.

Positions count bytes, or messages in JSON mode; a fork shares its source's positions below its fork
point and reads the source's rows there (clipped at the point), so nothing is copied.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from psycopg import AsyncConnection

from .statements import Statements

_COLUMNS = ("id, path, content_type, tail, closed, closed_by, ttl_seconds, expires_at, stream_seq,"
            " forked_from, fork_offset, fork_anchor, fork_sub, deleted")
_EXPIRED = ("((expires_at IS NOT NULL AND expires_at <= now()) OR (ttl_seconds IS NOT NULL"
            " AND touched_at + ttl_seconds * interval '1 second' <= now()))")
_FIND = f"SELECT {_COLUMNS}, {_EXPIRED} FROM {{s}}.free_streams WHERE path = %(path)s"
_LOCK = _FIND + " FOR UPDATE"
_HAS_FORKS = "SELECT EXISTS (SELECT 1 FROM {s}.free_streams WHERE forked_from = %(id)s)"
_INSERT = (
    "INSERT INTO {s}.free_streams (path, content_type, closed, ttl_seconds, expires_at, forked_from,"
    " fork_offset, fork_anchor, fork_sub, tail) VALUES (%(path)s, %(content_type)s, false, %(ttl)s,"
    " %(expires_at)s, %(forked_from)s, %(fork_offset)s, %(fork_anchor)s, %(fork_sub)s, %(tail)s)"
    " ON CONFLICT (path) DO NOTHING RETURNING id"
)
_CHUNKS = (
    "INSERT INTO {s}.free_chunks (stream_id, end_pos, size, batch_end, data)"
    " SELECT %(id)s, e, n, %(batch_end)s, d FROM unnest(%(ends)s::bigint[], %(sizes)s::bigint[],"
    " %(datas)s::bytea[]) AS u(e, n, d)"
)
_SET_TAIL = (
    "UPDATE {s}.free_streams SET tail = %(tail)s, closed = closed OR %(close)s,"
    " closed_by = CASE WHEN %(close)s AND NOT closed THEN %(closed_by)s ELSE closed_by END,"
    " stream_seq = coalesce(%(stream_seq)s, stream_seq), touched_at = now() WHERE id = %(id)s"
)
# Group commit: the streams of a batch of appends locked in id order (so two batches cannot deadlock),
# with the state of every producer the batch names; then every write of the batch in one statement.
_LOCK_MANY = (
    f"SELECT {_COLUMNS}, {_EXPIRED}, p.producer, p.epoch, p.seq FROM {{s}}.free_streams s"
    " LEFT JOIN {s}.free_producers p ON p.stream_id = s.id AND p.producer = ANY(%(producers)s::text[])"
    " WHERE s.path = ANY(%(paths)s::text[]) ORDER BY s.id FOR UPDATE OF s"
)
_APPEND_MANY = (
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
    " WHERE s.id = u.id"
)
_TOUCH = "UPDATE {s}.free_streams SET touched_at = now() WHERE id = %(id)s AND ttl_seconds IS NOT NULL"
# The rows that hold positions from %(start)s on, below %(stop)s, at most %(rows)s of them and
# %(budget)s bytes (the first whatever its size), from the one that holds %(start)s.
_READ = (
    "SELECT end_pos, size, batch_end, data FROM (SELECT end_pos, size, batch_end, data,"
    "  sum(octet_length(data)) OVER (ORDER BY end_pos) - octet_length(data) AS before"
    "  FROM {s}.free_chunks WHERE stream_id = %(id)s AND end_pos > %(start)s AND end_pos - size < %(stop)s"
    "  ORDER BY end_pos LIMIT %(rows)s) r WHERE before < %(budget)s OR before = 0 ORDER BY end_pos"
)
# Shared reads: for each (path, start) asked, the stream's row and its own chunks from start on (a page
# each), in one statement for every reader of a batch. A fork read below its fork point is read apart.
_S_COLUMNS = ", ".join("s." + c.strip() for c in _COLUMNS.split(","))
_S_EXPIRED = ("((s.expires_at IS NOT NULL AND s.expires_at <= now()) OR (s.ttl_seconds IS NOT NULL"
              " AND s.touched_at + s.ttl_seconds * interval '1 second' <= now()))")
_READ_MANY = (
    f"SELECT r.n, {_S_COLUMNS}, {_S_EXPIRED},"
    " c.end_pos, c.size, c.batch_end, c.data"
    " FROM unnest(%(paths)s::text[], %(starts)s::bigint[]) WITH ORDINALITY AS r(path, start, n)"
    " JOIN {s}.free_streams s ON s.path = r.path"
    " LEFT JOIN LATERAL (SELECT end_pos, size, batch_end, data FROM (SELECT end_pos, size, batch_end, data,"
    "   sum(octet_length(data)) OVER (ORDER BY end_pos) - octet_length(data) AS before"
    "   FROM {s}.free_chunks WHERE stream_id = s.id AND end_pos > r.start AND end_pos - size < s.tail"
    "   ORDER BY end_pos LIMIT %(rows)s) w WHERE before < %(budget)s OR before = 0) c ON true"
    " ORDER BY r.n, c.end_pos"
)
_TOUCH_MANY = "UPDATE {s}.free_streams SET touched_at = now() WHERE id = ANY(%(ids)s::bigint[])"
_SOURCE = f"SELECT {_COLUMNS}, false FROM {{s}}.free_streams WHERE id = %(id)s"
_DELETE = "DELETE FROM {s}.free_streams WHERE id = %(id)s RETURNING forked_from"
_SOFT_DELETE = "UPDATE {s}.free_streams SET deleted = true WHERE id = %(id)s"
_EXPIRED_IDS = (f"SELECT path FROM {{s}}.free_streams WHERE (ttl_seconds IS NOT NULL OR expires_at IS NOT NULL)"
                f" AND NOT deleted AND {_EXPIRED} LIMIT %(batch)s")


@dataclass(frozen=True)
class FreeStream:
    """A stream's row."""

    id: int
    path: str
    content_type: str
    tail: int
    closed: bool
    closed_by: str | None
    ttl: int | None
    expires_at: datetime | None
    stream_seq: str | None
    forked_from: int | None
    fork_offset: int | None
    fork_anchor: int | None
    fork_sub: int | None
    deleted: bool


def _row(values: tuple[Any, ...]) -> tuple[FreeStream, bool]:
    return FreeStream(*values[:14]), bool(values[14])


@dataclass(frozen=True)
class Producer:
    """An idempotent producer's headers."""

    id: str
    epoch: int
    seq: int

    def mark(self) -> str:
        return f"{self.epoch}:{self.seq}:{self.id}"


@dataclass(frozen=True)
class Fork:
    """What a PUT asks to fork: the source's path, and where (None: at its tail)."""

    source: str
    anchor: int | None
    sub: int


@dataclass(frozen=True)
class Created:
    """``outcome``: "created", "exists" (same configuration), "conflict", "gone" (a deleted stream
    that forks still read holds the path), "no_source", "source_gone", "bad_offset"."""

    outcome: str
    stream: FreeStream | None = None
    reason: str = ""


@dataclass(frozen=True)
class Appended:
    """``outcome``: "ok", "duplicate", "missing", "gone", "closed", "type", "seq", "stale_epoch",
    "epoch_seq" (a new epoch that does not start at 0), "gap". ``epoch``/``seq``: the producer's
    state the answer reports; ``expected``: the seq a gap wanted."""

    outcome: str
    stream: FreeStream | None = None
    epoch: int = 0
    seq: int = 0
    expected: int = 0


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


@dataclass(frozen=True)
class Chunk:
    """Positions [start, end) of a stream, and the append they came in ending at ``batch_end``."""

    start: int
    end: int
    batch_end: int
    data: bytes


def base_type(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


class FreeStreams(Statements):
    """Create, append, read, delete free-standing streams; delete the expired ones."""

    async def _find(self, conn: AsyncConnection[Any], path: str, lock: bool) -> FreeStream | None:
        """The stream at ``path``, deleting it first if it has expired (None then)."""
        cur = await conn.execute(self._sql(_LOCK if lock else _FIND), {"path": path})
        found = await cur.fetchone()
        if found is None:
            return None
        stream, expired = _row(found)
        if expired and not stream.deleted:
            await self._remove(conn, stream.id)
            return None
        return stream

    async def _remove(self, conn: AsyncConnection[Any], stream_id: int) -> bool:
        """Delete a stream, or only mark it deleted while forks read it; then its sources that were
        kept for it alone. True when it went for good."""
        cur = await conn.execute(self._sql(_HAS_FORKS), {"id": stream_id})
        row = await cur.fetchone()
        if row is not None and row[0]:
            await conn.execute(self._sql(_SOFT_DELETE), {"id": stream_id})
            return False
        current: int | None = stream_id
        while current is not None:
            cur = await conn.execute(self._sql(_DELETE), {"id": current})
            gone = await cur.fetchone()
            source = gone[0] if gone else None
            current = None
            if source is not None:
                cur = await conn.execute(self._sql(_SOURCE) + " FOR UPDATE", {"id": source})
                found = await cur.fetchone()
                if found is not None and found[13]:
                    cur = await conn.execute(self._sql(_HAS_FORKS), {"id": source})
                    still = await cur.fetchone()
                    if still is not None and not still[0]:
                        current = source
        return True

    async def get(self, path: str) -> FreeStream | None:
        """The stream at ``path`` (soft-deleted ones too: ``deleted``), or None."""
        async with self.pool.connection() as conn:  # one statement, no transaction: the usual case
            cur = await conn.execute(self._sql(_FIND), {"path": path})
            found = await cur.fetchone()
            if found is None:
                return None
            stream, expired = _row(found)
            if not expired or stream.deleted:
                return stream
            async with conn.transaction():  # expired: deleted under its lock, if it still is
                return await self._find(conn, path, lock=True)

    async def create(self, path: str, content_type: str, ttl: int | None, expires_at: datetime | None,
                     closed: bool, json_mode: bool, units: list[bytes], fork: Fork | None) -> Created:
        """PUT: a new stream (201), or the same one again (200), else why not."""
        async with self.pool.connection() as conn, conn.transaction():
            existing = await self._find(conn, path, lock=True)
            if existing is not None:
                if existing.deleted:
                    return Created("gone", existing)
                same = (base_type(existing.content_type) == base_type(content_type) and existing.ttl == ttl
                        and _same_time(existing.expires_at, expires_at) and existing.closed == closed
                        and (fork is None) == (existing.forked_from is None))
                if same and fork is not None:
                    source = await self._find(conn, fork.source, lock=False)
                    same = (source is not None and source.id == existing.forked_from
                            and fork.anchor in (None, existing.fork_anchor) and fork.sub == (existing.fork_sub or 0))
                return Created("exists" if same else "conflict", existing)
            tail, forked_from, fork_offset = 0, None, None
            if fork is not None:
                source = await self._find(conn, fork.source, lock=True)
                if source is None:
                    return Created("no_source")
                if source.deleted:
                    return Created("source_gone")
                if base_type(source.content_type) != base_type(content_type):
                    return Created("conflict", reason="the Content-Type differs from the source stream's")
                anchor = source.tail if fork.anchor is None else fork.anchor
                if anchor > source.tail:
                    return Created("bad_offset", reason="Stream-Fork-Offset is past the source stream's tail")
                fork_offset = anchor
                if fork.sub:
                    boundary = await self._boundary(conn, source, anchor)
                    if boundary is None or anchor + fork.sub > boundary:
                        return Created("bad_offset", reason="Stream-Fork-Sub-Offset goes past the append at"
                                                            " Stream-Fork-Offset")
                    fork_offset = anchor + fork.sub
                tail, forked_from = fork_offset, source.id
                if ttl is None and expires_at is None:
                    ttl, expires_at = source.ttl, source.expires_at
            cur = await conn.execute(self._sql(_INSERT), {
                "path": path, "content_type": content_type, "ttl": ttl, "expires_at": expires_at,
                "forked_from": forked_from, "fork_offset": fork_offset,
                "fork_anchor": None if fork is None else fork_offset if fork.anchor is None else fork.anchor,
                "fork_sub": None if fork is None else fork.sub, "tail": tail})
            row = await cur.fetchone()
            if row is None:  # another PUT made it meanwhile
                return Created("conflict", reason="created concurrently")
            stream_id = int(row[0])
            tail = await self._write(conn, stream_id, tail, json_mode, units, closed, None, None)
            cur = await conn.execute(self._sql(_SOURCE), {"id": stream_id})  # (even if it expires at once)
            found = await cur.fetchone()
            assert found is not None
            return Created("created", _row(found)[0])

    async def _boundary(self, conn: AsyncConnection[Any], stream: FreeStream, position: int) -> int | None:
        """Where the append that holds ``position`` ends (None: nothing there)."""
        chunks = await self._read_range(conn, stream, position, stream.tail, 1, 1)
        return chunks[0].batch_end if chunks else None

    async def _write(self, conn: AsyncConnection[Any], stream_id: int, tail: int, json_mode: bool,
                     units: list[bytes], close: bool, closed_by: str | None, stream_seq: str | None) -> int:
        """The chunks of one request, in one statement; the new tail (and closure) on the row."""
        if units:
            sizes = [1 if json_mode else len(u) for u in units]
            ends, at = [], tail
            for size in sizes:
                at += size
                ends.append(at)
            await conn.execute(self._sql(_CHUNKS), {"id": stream_id, "ends": ends, "sizes": sizes,
                                                    "datas": units, "batch_end": at})
            tail = at
        await conn.execute(self._sql(_SET_TAIL), {"id": stream_id, "tail": tail, "close": close,
                                                  "closed_by": closed_by, "stream_seq": stream_seq})
        return tail

    async def append_many(self, appends: list[Append]) -> list[Appended | Exception]:
        """Group commit: a batch of appends (to any streams) in one transaction of three statements, each
        judged as ``append`` judges it, in the order given, on the state the ones before it left. An
        append refused (or whose body ``units_of`` refuses: its exception is its answer) writes nothing;
        the others are unaffected."""
        async with self.pool.connection() as conn, conn.transaction():
            cur = await conn.execute(self._sql(_LOCK_MANY), {
                "paths": sorted({a.path for a in appends}),
                "producers": sorted({a.producer.id for a in appends if a.producer is not None})})
            streams: dict[str, FreeStream] = {}
            states: dict[tuple[int, str], tuple[int, int]] = {}
            for row in await cur.fetchall():
                stream, expired = _row(row)
                if expired and not stream.deleted:
                    await self._remove(conn, stream.id)
                    continue
                streams[stream.path] = stream
                if row[15] is not None:
                    states[(stream.id, str(row[15]))] = (int(row[16]), int(row[17]))
            results: list[Appended | Exception] = []
            chunks: tuple[list[int], list[int], list[int], list[int], list[bytes]] = ([], [], [], [], [])
            written: dict[int, FreeStream] = {}
            touched: dict[tuple[int, str], tuple[int, int]] = {}
            for append in appends:
                try:
                    result = _judge(append, streams.get(append.path), states)
                except Exception as exc:  # noqa: BLE001 - the body's own refusal: this append's answer alone
                    results.append(exc)
                    continue
                if isinstance(result, Appended):
                    results.append(result)
                    continue
                stream, units = result
                json_mode = base_type(stream.content_type) == "application/json"
                tail = stream.tail
                for unit in units:
                    size = 1 if json_mode else len(unit)
                    tail += size
                    chunks[0].append(stream.id)
                    chunks[1].append(tail)
                    chunks[2].append(size)
                    chunks[4].append(unit)
                chunks[3].extend([tail] * len(units))
                producer = append.producer
                closing = append.close and not stream.closed
                after = replace(stream, tail=tail, closed=stream.closed or append.close,
                                closed_by=(producer.mark() if producer else "") if closing else stream.closed_by,
                                stream_seq=append.stream_seq if append.stream_seq is not None else stream.stream_seq)
                streams[stream.path] = written[stream.id] = after
                if producer is not None:
                    states[(stream.id, producer.id)] = touched[(stream.id, producer.id)] = (producer.epoch,
                                                                                            producer.seq)
                results.append(Appended("ok", after, producer.epoch if producer else 0,
                                        producer.seq if producer else 0))
            if written:
                ids = list(written)
                await conn.execute(self._sql(_APPEND_MANY), {
                    "c_ids": chunks[0], "c_ends": chunks[1], "c_sizes": chunks[2], "c_batch_ends": chunks[3],
                    "c_datas": chunks[4],
                    "p_ids": [k[0] for k in touched], "p_names": [k[1] for k in touched],
                    "p_epochs": [v[0] for v in touched.values()], "p_seqs": [v[1] for v in touched.values()],
                    "s_ids": ids, "s_tails": [written[i].tail for i in ids],
                    "s_closed": [written[i].closed for i in ids], "s_closed_by": [written[i].closed_by for i in ids],
                    "s_seqs": [written[i].stream_seq for i in ids]})
            return results

    async def read_many(self, asks: list[tuple[str, int]], rows: int,
                        budget: int) -> list[tuple[FreeStream | None, list[Chunk]]]:
        """Shared reads: for each (path, start), the stream (None: there is none, or it expired) and a
        page of its chunks from ``start`` on, for every reader of a batch in one statement (and one more
        when some of the streams have a sliding TTL, which a read moves on)."""
        found: list[tuple[FreeStream | None, list[Chunk]]] = [(None, []) for _ in asks]
        async with self.pool.connection() as conn:
            cur = await conn.execute(self._sql(_READ_MANY), {
                "paths": [a[0] for a in asks], "starts": [a[1] for a in asks], "rows": rows, "budget": budget})
            expired: list[int] = []
            for row in await cur.fetchall():
                n = int(row[0]) - 1
                stream, gone = _row(row[1:16])
                if gone and not stream.deleted:
                    expired.append(n)
                    continue
                chunks = found[n][1]
                found[n] = (stream, chunks)
                if row[16] is not None:
                    end, size, batch_end, data = int(row[16]), int(row[17]), int(row[18]), bytes(row[19])
                    first, start = end - size, asks[n][1]
                    if first < start:  # (bytes: an offset inside an append)
                        data, first = data[start - first:], start
                    chunks.append(Chunk(first, end, batch_end, data))
            for n, (fork, _) in enumerate(found):
                if fork is not None and fork.forked_from is not None and fork.fork_offset is not None \
                        and asks[n][1] < fork.fork_offset:
                    found[n] = (fork, await self._read_range(conn, fork, asks[n][1], fork.tail, rows, budget))
            touched = [s.id for s, _ in found if s is not None and s.ttl is not None]
            if touched:
                await conn.execute(self._sql(_TOUCH_MANY), {"ids": touched})
        for n in expired:  # deleted by the request that found them
            found[n] = (await self.get(asks[n][0]), [])
        return found

    async def read(self, stream: FreeStream, start: int, rows: int, budget: int) -> list[Chunk]:
        """The chunks from ``start`` on (a fork's inherited ones first), one bounded page; the read
        moves a sliding TTL on."""
        async with self.pool.connection() as conn:
            if stream.ttl is not None:
                await conn.execute(self._sql(_TOUCH), {"id": stream.id})
            return await self._read_range(conn, stream, start, stream.tail, rows, budget)

    async def touch(self, stream: FreeStream) -> None:
        if stream.ttl is not None:
            async with self.pool.connection() as conn:
                await conn.execute(self._sql(_TOUCH), {"id": stream.id})

    async def _read_range(self, conn: AsyncConnection[Any], stream: FreeStream, start: int, stop: int,
                          rows: int, budget: int) -> list[Chunk]:
        """Positions [start, stop) of ``stream``: from its source chain below its fork point."""
        if stream.forked_from is not None and stream.fork_offset is not None and start < stream.fork_offset:
            cur = await conn.execute(self._sql(_SOURCE), {"id": stream.forked_from})
            found = await cur.fetchone()
            if found is not None:
                source, _ = _row(found)
                inherited = await self._read_range(conn, source, start, min(stop, stream.fork_offset), rows, budget)
                if inherited:
                    used = sum(len(c.data) for c in inherited)
                    if inherited[-1].end < stream.fork_offset or len(inherited) >= rows or used >= budget:
                        return inherited  # (a page cut short: the rest is for the next read)
                    return inherited + await self._read_range(conn, stream, stream.fork_offset, stop,
                                                               rows - len(inherited), budget - used)
            start = stream.fork_offset
        cur = await conn.execute(self._sql(_READ), {"id": stream.id, "start": start, "stop": stop, "rows": rows,
                                                    "budget": budget})
        chunks = []
        for end, size, batch_end, data in await cur.fetchall():
            first = end - size
            data = bytes(data)
            if size > 1 or first < start or end > stop:  # (bytes: clip to the range asked)
                lo, hi = max(start, first), min(stop, end)
                data, first, end = data[lo - first:hi - first], lo, hi
            chunks.append(Chunk(first, end, min(batch_end, stop), data))
        return chunks

    async def delete(self, path: str) -> str:
        """DELETE: "deleted", "missing" or "gone" (already deleted while forks read it)."""
        async with self.pool.connection() as conn, conn.transaction():
            stream = await self._find(conn, path, lock=True)
            if stream is None:
                return "missing"
            if stream.deleted:
                return "gone"
            await self._remove(conn, stream.id)
            return "deleted"

    async def delete_expired(self, batch: int) -> int:
        """The prune's share: up to ``batch`` expired streams deleted (kept as deleted while forks
        read them). Returns how many."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(self._sql(_EXPIRED_IDS), {"batch": batch})
            paths = [str(r[0]) for r in await cur.fetchall()]
        for path in paths:
            async with self.pool.connection() as conn, conn.transaction():
                await self._find(conn, path, lock=True)  # deletes it if it is (still) expired
        return len(paths)


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


def _same_time(a: datetime | None, b: datetime | None) -> bool:
    return a == b if a is None or b is None else abs((a - b).total_seconds()) < 0.001


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
