"""The statements of free-standing Durable Streams (``pgflow streams serve``) that create, read and
manage them: tables of 0029. ``FreeStreams`` is the whole set, the writes included (``free_appends``).

Each method is one transaction. Create (PUT), read (a stream's row for HEAD, a page of its chunks for
GET, shared by every reader of a batch in one statement), delete, and the prune's deletion of expired
streams live here; appends, producers and closure are ``free_appends``'s, a stream's row and its
expiry on sight ``free_rows``'s. Expiry is decided by the server's clock (``now()``), so every process
agrees; an expired stream is deleted by the first request that finds it (or by the prune), and answers
as if it had never been.

Positions count bytes, or messages in JSON mode; a fork shares its source's positions below its fork
point and reads the source's rows there (clipped at the point), so nothing is copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TypedDict

from .database import Session, Sql
from .free_appends import Append, Appended, FreeAppends, Producer
from .free_rows import COLUMNS, EXPIRED, FIND, SOURCE, FreeStream, OfStream, base_type, row_of
from .statement import Batch

__all__ = ["Append", "Appended", "Chunk", "Created", "Fork", "FreeStream", "FreeStreams", "Producer", "base_type"]


class Inserting(TypedDict):
    path: str
    content_type: str
    ttl: int | None
    expires_at: datetime | None
    forked_from: int | None
    fork_offset: int | None
    fork_anchor: int | None
    fork_sub: int | None
    tail: int


class Reading(TypedDict):
    """A page of a stream's chunks: positions [start, stop), at most ``rows`` rows and ``budget`` bytes."""

    id: int
    start: int
    stop: int
    rows: int
    budget: int


class ReadingMany(TypedDict):
    """Shared reads: each stream's path and where its reader is; a page's bounds for each."""

    paths: list[str]
    starts: list[int]
    rows: int
    budget: int


class OfStreams(TypedDict):
    ids: list[int]


# A new stream's row, unless its path is taken.
INSERT = Sql(
    "INSERT INTO {s}.free_streams (path, content_type, closed, ttl_seconds, expires_at, forked_from,"
    " fork_offset, fork_anchor, fork_sub, tail) VALUES (%(path)s, %(content_type)s, false, %(ttl)s,"
    " %(expires_at)s, %(forked_from)s, %(fork_offset)s, %(fork_anchor)s, %(fork_sub)s, %(tail)s)"
    " ON CONFLICT (path) DO NOTHING RETURNING id",
    row=tuple[int], params=Inserting)
# A read moves a sliding TTL on.
TOUCH = Sql("UPDATE {s}.free_streams SET touched_at = now() WHERE id = %(id)s AND ttl_seconds IS NOT NULL",
            row=None, params=OfStream)
# The rows that hold positions from %(start)s on, below %(stop)s, at most %(rows)s of them and
# %(budget)s bytes (the first whatever its size), from the one that holds %(start)s. Its rows (end, size,
# the append's end, data) are tuples, as psycopg reads them: a page holds many.
READ = Sql(
    "SELECT end_pos, size, batch_end, data FROM (SELECT end_pos, size, batch_end, data,"
    "  sum(octet_length(data)) OVER (ORDER BY end_pos) - octet_length(data) AS before"
    "  FROM {s}.free_chunks WHERE stream_id = %(id)s AND end_pos > %(start)s AND end_pos - size < %(stop)s"
    "  ORDER BY end_pos LIMIT %(rows)s) r WHERE before < %(budget)s OR before = 0 ORDER BY end_pos",
    row=tuple[int, int, int, bytes], params=Reading)
# Shared reads: for each (path, start) asked, the stream's row and its own chunks from start on (a page
# each), in one statement for every reader of a batch. A fork read below its fork point is read apart.
_S_COLUMNS = ", ".join("s." + c.strip() for c in COLUMNS.split(","))
_S_EXPIRED = ("((s.expires_at IS NOT NULL AND s.expires_at <= now()) OR (s.ttl_seconds IS NOT NULL"
              " AND s.touched_at + s.ttl_seconds * interval '1 second' <= now()))")
READ_MANY = Sql(
    f"SELECT r.n, {_S_COLUMNS}, {_S_EXPIRED},"
    " c.end_pos, c.size, c.batch_end, c.data"
    " FROM unnest(%(paths)s::text[], %(starts)s::bigint[]) WITH ORDINALITY AS r(path, start, n)"
    " JOIN {s}.free_streams s ON s.path = r.path"
    " LEFT JOIN LATERAL (SELECT end_pos, size, batch_end, data FROM (SELECT end_pos, size, batch_end, data,"
    "   sum(octet_length(data)) OVER (ORDER BY end_pos) - octet_length(data) AS before"
    "   FROM {s}.free_chunks WHERE stream_id = s.id AND end_pos > r.start AND end_pos - size < s.tail"
    "   ORDER BY end_pos LIMIT %(rows)s) w WHERE before < %(budget)s OR before = 0) c ON true"
    " ORDER BY r.n, c.end_pos",
    # (the ask's number; the stream's row, a StreamRow; a chunk's end, size, append's end and data, or NULLs)
    row=tuple[int, int, str, str, int, bool, str | None, int | None, datetime | None, str | None, int | None,
              int | None, int | None, int | None, bool, bool, int | None, int | None, int | None, bytes | None],
    params=ReadingMany)
# A shared read moves the sliding TTLs of the streams it read on.
TOUCH_MANY = Sql("UPDATE {s}.free_streams SET touched_at = now() WHERE id = ANY(%(ids)s::bigint[])", row=None,
                 params=OfStreams)
# Up to a batch of streams that have expired (the prune deletes them).
EXPIRED_PATHS = Sql(f"SELECT path FROM {{s}}.free_streams WHERE (ttl_seconds IS NOT NULL OR expires_at IS NOT NULL)"
                    f" AND NOT deleted AND {EXPIRED} LIMIT %(batch)s", row=tuple[str], params=Batch)


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
class Chunk:
    """Positions [start, end) of a stream, and the append they came in ending at ``batch_end``."""

    start: int
    end: int
    batch_end: int
    data: bytes


class FreeStreams(FreeAppends):
    """Create, append, read, delete free-standing streams; delete the expired ones."""

    async def get(self, path: str) -> FreeStream | None:
        """The stream at ``path`` (soft-deleted ones too: ``deleted``), or None."""
        async with self.db.session() as s:  # one statement, no transaction: the usual case
            found = await s.row(FIND, path=path)
            if found is None:
                return None
            stream, expired = row_of(found)
            if not expired or stream.deleted:
                return stream
            async with s.transaction():  # expired: deleted under its lock, if it still is
                return await self._find(s, path, lock=True)

    async def create(self, path: str, content_type: str, ttl: int | None, expires_at: datetime | None,
                     closed: bool, json_mode: bool, units: list[bytes], fork: Fork | None) -> Created:
        """PUT: a new stream (201), or the same one again (200), else why not."""
        async with self.db.session() as s, s.transaction():
            existing = await self._find(s, path, lock=True)
            if existing is not None:
                if existing.deleted:
                    return Created("gone", existing)
                same = (base_type(existing.content_type) == base_type(content_type) and existing.ttl == ttl
                        and _same_time(existing.expires_at, expires_at) and existing.closed == closed
                        and (fork is None) == (existing.forked_from is None))
                if same and fork is not None:
                    source = await self._find(s, fork.source, lock=False)
                    same = (source is not None and source.id == existing.forked_from
                            and fork.anchor in (None, existing.fork_anchor) and fork.sub == (existing.fork_sub or 0))
                return Created("exists" if same else "conflict", existing)
            tail, forked_from, fork_offset = 0, None, None
            if fork is not None:
                source = await self._find(s, fork.source, lock=True)
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
                    boundary = await self._boundary(s, source, anchor)
                    if boundary is None or anchor + fork.sub > boundary:
                        return Created("bad_offset", reason="Stream-Fork-Sub-Offset goes past the append at"
                                                            " Stream-Fork-Offset")
                    fork_offset = anchor + fork.sub
                tail, forked_from = fork_offset, source.id
                if ttl is None and expires_at is None:
                    ttl, expires_at = source.ttl, source.expires_at
            row = await s.row(
                INSERT, path=path, content_type=content_type, ttl=ttl, expires_at=expires_at,
                forked_from=forked_from, fork_offset=fork_offset,
                fork_anchor=None if fork is None else fork_offset if fork.anchor is None else fork.anchor,
                fork_sub=None if fork is None else fork.sub, tail=tail)
            if row is None:  # another PUT made it meanwhile
                return Created("conflict", reason="created concurrently")
            (stream_id,) = row
            tail = await self._write(s, stream_id, tail, json_mode, units, closed, None, None)
            found = await s.row(SOURCE, id=stream_id)  # (even if it expires at once)
            assert found is not None
            return Created("created", row_of(found)[0])

    async def _boundary(self, s: Session, stream: FreeStream, position: int) -> int | None:
        """Where the append that holds ``position`` ends (None: nothing there)."""
        chunks = await self._read_range(s, stream, position, stream.tail, 1, 1)
        return chunks[0].batch_end if chunks else None

    async def read_many(self, asks: list[tuple[str, int]], rows: int,
                        budget: int) -> list[tuple[FreeStream | None, list[Chunk]]]:
        """Shared reads: for each (path, start), the stream (None: there is none, or it expired) and a
        page of its chunks from ``start`` on, for every reader of a batch in one statement (and one more
        when some of the streams have a sliding TTL, which a read moves on)."""
        found: list[tuple[FreeStream | None, list[Chunk]]] = [(None, []) for _ in asks]
        async with self.db.session() as s:
            expired: list[int] = []
            for row in await s.rows(READ_MANY, paths=[a[0] for a in asks], starts=[a[1] for a in asks],
                                    rows=rows, budget=budget):
                n = row[0] - 1
                stream, gone = row_of(row[1:16])
                if gone and not stream.deleted:
                    expired.append(n)
                    continue
                chunks = found[n][1]
                found[n] = (stream, chunks)
                end, size, batch_end, data = row[16:20]
                if end is not None and size is not None and batch_end is not None and data is not None:
                    first, start = end - size, asks[n][1]
                    if first < start:  # (bytes: an offset inside an append)
                        data, first = data[start - first:], start
                    chunks.append(Chunk(first, end, batch_end, data))
            for n, (fork, _) in enumerate(found):
                if fork is not None and fork.forked_from is not None and fork.fork_offset is not None \
                        and asks[n][1] < fork.fork_offset:
                    found[n] = (fork, await self._read_range(s, fork, asks[n][1], fork.tail, rows, budget))
            touched = [stream.id for stream, _ in found if stream is not None and stream.ttl is not None]
            if touched:
                await s.run(TOUCH_MANY, ids=touched)
        for n in expired:  # deleted by the request that found them
            found[n] = (await self.get(asks[n][0]), [])
        return found

    async def read(self, stream: FreeStream, start: int, rows: int, budget: int) -> list[Chunk]:
        """The chunks from ``start`` on (a fork's inherited ones first), one bounded page; the read
        moves a sliding TTL on."""
        async with self.db.session() as s:
            if stream.ttl is not None:
                await s.run(TOUCH, id=stream.id)
            return await self._read_range(s, stream, start, stream.tail, rows, budget)

    async def touch(self, stream: FreeStream) -> None:
        if stream.ttl is not None:
            await self.db.run(TOUCH, id=stream.id)

    async def _read_range(self, s: Session, stream: FreeStream, start: int, stop: int,
                          rows: int, budget: int) -> list[Chunk]:
        """Positions [start, stop) of ``stream``: from its source chain below its fork point."""
        if stream.forked_from is not None and stream.fork_offset is not None and start < stream.fork_offset:
            found = await s.row(SOURCE, id=stream.forked_from)
            if found is not None:
                source, _ = row_of(found)
                inherited = await self._read_range(s, source, start, min(stop, stream.fork_offset), rows, budget)
                if inherited:
                    used = sum(len(c.data) for c in inherited)
                    if inherited[-1].end < stream.fork_offset or len(inherited) >= rows or used >= budget:
                        return inherited  # (a page cut short: the rest is for the next read)
                    return inherited + await self._read_range(s, stream, stream.fork_offset, stop,
                                                               rows - len(inherited), budget - used)
            start = stream.fork_offset
        chunks = []
        for end, size, batch_end, data in await s.rows(READ, id=stream.id, start=start, stop=stop, rows=rows,
                                                       budget=budget):
            first = end - size
            if size > 1 or first < start or end > stop:  # (bytes: clip to the range asked)
                lo, hi = max(start, first), min(stop, end)
                data, first, end = data[lo - first:hi - first], lo, hi
            chunks.append(Chunk(first, end, min(batch_end, stop), data))
        return chunks

    async def delete(self, path: str) -> str:
        """DELETE: "deleted", "missing" or "gone" (already deleted while forks read it)."""
        self.known.forget({path})
        async with self.db.session() as s, s.transaction():
            stream = await self._find(s, path, lock=True)
            if stream is None:
                return "missing"
            if stream.deleted:
                return "gone"
            await self._remove(s, stream.id)
            return "deleted"

    async def delete_expired(self, batch: int) -> int:
        """The prune's share: up to ``batch`` expired streams deleted (kept as deleted while forks
        read them). Returns how many."""
        paths = [path for (path,) in await self.db.rows(EXPIRED_PATHS, batch=batch)]
        for path in paths:
            async with self.db.session() as s, s.transaction():
                await self._find(s, path, lock=True)  # deletes it if it is (still) expired
        return len(paths)


def _same_time(a: datetime | None, b: datetime | None) -> bool:
    return a == b if a is None or b is None else abs((a - b).total_seconds()) < 0.001
