"""A free-standing stream's row (table ``free_streams`` of 0029), and the answers of its statements.

What both the writes (``free_appends``) and the rest (``free_streams``: create, read, delete, expire)
stand on: the row and its types, and the two steps every one of them may take. ``_find`` reads a
stream's row, deleting it first when it has expired (by the server's clock, ``now()``, so every process
agrees: an expired stream answers as if it had never been); ``_remove`` deletes one, or only marks it
deleted while forks still read its rows, and then the sources kept for it alone.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import datetime
from typing import TypedDict, cast

from .database import Port, Session, Sql

COLUMNS = ("id, path, content_type, tail, closed, closed_by, ttl_seconds, expires_at, stream_seq,"
           " forked_from, fork_offset, fork_anchor, fork_sub, deleted")
EXPIRED = ("((expires_at IS NOT NULL AND expires_at <= now()) OR (ttl_seconds IS NOT NULL"
           " AND touched_at + ttl_seconds * interval '1 second' <= now()))")
# A row of ``COLUMNS`` then ``EXPIRED``, as psycopg reads it (``row_of`` makes it a ``FreeStream``).
StreamRow = tuple[int, str, str, int, bool, str | None, int | None, datetime | None, str | None, int | None,
                  int | None, int | None, int | None, bool, bool]
_ROW = cast("type[StreamRow]", StreamRow)


class ByPath(TypedDict):
    path: str


class OfStream(TypedDict):
    """The parameters of a statement about one stream, by its id."""

    id: int


# A stream's row by its path, and whether it has expired (locked, for a change that follows).
_FIND = f"SELECT {COLUMNS}, {EXPIRED} FROM {{s}}.free_streams WHERE path = %(path)s"
FIND, LOCK = Sql(_FIND, row=_ROW, params=ByPath), Sql(_FIND + " FOR UPDATE", row=_ROW, params=ByPath)
# A stream's row by its id, as if unexpired (a fork's source: locked, while a removal looks at it).
_SOURCE = f"SELECT {COLUMNS}, false FROM {{s}}.free_streams WHERE id = %(id)s"
SOURCE, SOURCE_LOCKED = (Sql(_SOURCE, row=_ROW, params=OfStream),
                         Sql(_SOURCE + " FOR UPDATE", row=_ROW, params=OfStream))
# A removal: whether forks still read the stream, its row deleted (its source back) or marked deleted.
HAS_FORKS = Sql("SELECT EXISTS (SELECT 1 FROM {s}.free_streams WHERE forked_from = %(id)s)", row=tuple[bool],
                params=OfStream)
DELETE = Sql("DELETE FROM {s}.free_streams WHERE id = %(id)s RETURNING forked_from", row=tuple[int | None],
             params=OfStream)
SOFT_DELETE = Sql("UPDATE {s}.free_streams SET deleted = true WHERE id = %(id)s", row=None, params=OfStream)


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


def row_of(values: StreamRow) -> tuple[FreeStream, bool]:
    """A row of ``COLUMNS`` then ``EXPIRED``: the stream, and whether it has expired."""
    return FreeStream(*values[:14]), bool(values[14])


@functools.lru_cache(maxsize=256)
def base_type(content_type: str) -> str:
    """The media type without its parameters (``application/json; charset=utf-8``: ``application/json``);
    remembered, since a server sees few and asks for every append."""
    return content_type.split(";", 1)[0].strip().lower()


class FreeStreamRows(Port):
    """Finding a stream's row (an expired one deleted on sight) and removing a stream."""

    async def _find(self, s: Session, path: str, lock: bool) -> FreeStream | None:
        """The stream at ``path``, deleting it first if it has expired (None then)."""
        found = await s.row(LOCK if lock else FIND, path=path)
        if found is None:
            return None
        stream, expired = row_of(found)
        if expired and not stream.deleted:
            await self._remove(s, stream.id)
            return None
        return stream

    async def _remove(self, s: Session, stream_id: int) -> bool:
        """Delete a stream, or only mark it deleted while forks read it; then its sources that were
        kept for it alone. True when it went for good."""
        row = await s.row(HAS_FORKS, id=stream_id)
        if row is not None and row[0]:
            await s.run(SOFT_DELETE, id=stream_id)
            return False
        current: int | None = stream_id
        while current is not None:
            gone = await s.row(DELETE, id=current)
            source = gone[0] if gone else None
            current = None
            if source is not None:
                found = await s.row(SOURCE_LOCKED, id=source)
                if found is not None and row_of(found)[0].deleted:
                    still = await s.row(HAS_FORKS, id=source)
                    if still is not None and not still[0]:
                        current = source
        return True
