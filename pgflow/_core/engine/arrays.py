"""Arrays for the hot statements, packed in PostgreSQL's binary array format by a few C calls.

psycopg dumps a binary array element by element in Python (a call, a length and two appends per
element); a stream batch sends several 256-element arrays per commit, which made that a real share of
the writer's CPU. Here an int array is one ``struct.pack`` and a bytes array one ``join``; the result
goes to the server as it is, through a dumper that returns it unchanged.
"""

from __future__ import annotations

import struct
import weakref
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from psycopg import AsyncConnection
from psycopg.adapt import Dumper
from psycopg.pq import Format

_HEAD = struct.Struct(">iiIii")  # dimensions, has nulls, element type, length, lower bound
_LEN = struct.Struct(">i").pack
_NULL = _LEN(-1)
_BOOL, _INT4, _INT8, _BYTEA, _TEXT, _TIMESTAMPTZ = 16, 23, 20, 17, 25, 1184
_I8 = struct.Struct(">q").pack


class Int4Array(bytes):
    """An int4[] already packed."""


class Int8Array(bytes):
    """An int8[] already packed."""


class ByteaArray(bytes):
    """A bytea[] already packed."""


class TextArray(bytes):
    """A text[] already packed."""


def _dumper(array_oid: int) -> type[Dumper]:
    class Packed(Dumper):
        format = Format.BINARY
        oid = array_oid

        def dump(self, obj: Any) -> bytes:
            return bytes(obj)

    return Packed


_DUMPERS: list[tuple[type[bytes], type[Dumper]]] = [
    (Int4Array, _dumper(1007)), (Int8Array, _dumper(1016)), (ByteaArray, _dumper(1001)),
    (TextArray, _dumper(1009))]
_ready: weakref.WeakSet[AsyncConnection[Any]] = weakref.WeakSet()


def ready(conn: AsyncConnection[Any]) -> None:
    """Let ``conn`` send packed arrays (once per connection)."""
    if conn not in _ready:
        for cls, dumper in _DUMPERS:
            conn.adapters.register_dumper(cls, dumper)
        _ready.add(conn)


@lru_cache(maxsize=64)
def _ints(code: str, n: int) -> struct.Struct:
    return struct.Struct(f">{code * n}")


def _head(oid: int, n: int, nulls: int = 0) -> bytes:
    return _HEAD.pack(1, nulls, oid, n, 1) if n else _HEAD.pack(0, 0, oid, 0, 0)[:12]  # empty: no dimension


def int4s(values: Sequence[int]) -> Int4Array:
    n = len(values)
    pairs = [4] * (2 * n)
    pairs[1::2] = values
    return Int4Array(_head(_INT4, n) + _ints("ii", n).pack(*pairs))


def int8s(values: Sequence[int]) -> Int8Array:
    n = len(values)
    pairs = [8] * (2 * n)
    pairs[1::2] = values
    return Int8Array(_head(_INT8, n) + _ints("iq", n).pack(*pairs))


def byteas(values: Sequence[bytes | None]) -> ByteaArray:
    return ByteaArray(_pieces(_BYTEA, values))


def texts(values: Sequence[str | None]) -> TextArray:
    return TextArray(_pieces(_TEXT, [None if value is None else value.encode() for value in values]))


def bools(values: Sequence[bool]) -> bytes:
    return _pieces(_BOOL, [b"\x01" if value else b"\x00" for value in values])


def timestamptzs(microseconds: Sequence[int | None]) -> bytes:
    """A timestamptz[] of microseconds since 2000-01-01 UTC (PostgreSQL's own form; None: NULL)."""
    return _pieces(_TIMESTAMPTZ, [None if value is None else _I8(value) for value in microseconds])


def _pieces(oid: int, values: Sequence[bytes | None]) -> bytes:
    parts = [_head(oid, len(values))]
    nulls = 0
    for value in values:
        if value is None:
            parts.append(_NULL)
            nulls = 1
        else:
            parts.append(_LEN(len(value)))
            parts.append(value)
    if nulls:
        parts[0] = _head(oid, len(values), 1)
    return b"".join(parts)
