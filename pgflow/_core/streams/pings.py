"""A stream's ping, and the chunk it may carry.

A batch of chunks pings ``s:<workflow id>:<key>`` for every stream it grew, with its commit. When a
stream has a single chunk in the batch and that chunk is small, the ping carries it instead:
``c:<position>:<base64 value, or - for the close marker>:s:<workflow id>:<key>``. A reader waiting at
exactly that position takes the chunk from the ping and runs no query; any other reader of the
stream (behind, busy, or not yet started) takes it as the plain ping it ends with, and reads. A
ping is only sent by the commit that wrote its chunk, so what it carries is durable, and pings of
one stream arrive in the order their batches committed.

(Processes of a version before this one know no ``c:`` key, and find these chunks on their slow poll.)
"""

from __future__ import annotations

import binascii

CARRIED_CHUNK = "c:"
CARRY_AT_MOST = 600  # bytes of a chunk's encoded value carried in its ping; a bigger one is only pinged
CLOSED = "-"  # the value of a carried close marker (no base64 text is "-")


def stream_ping(workflow_id: str, key: str) -> str:
    return f"s:{workflow_id}:{key}"


def carrying(ping: str, position: int, value: bytes | None) -> str:
    """The ping of a stream's only chunk in a batch: the chunk itself when it is small enough."""
    if value is None:
        return f"c:{position}:-:{ping}"
    if len(value) > CARRY_AT_MOST:
        return ping
    return f"c:{position}:{binascii.b2a_base64(value, newline=False).decode()}:{ping}"


def carried(key: str) -> tuple[str, int, str]:
    """(stream ping, position, encoded value) of a ``c:`` key; ValueError for one that does not parse."""
    _, position, value, ping = key.split(":", 3)
    return ping, int(position), value


def carried_value(value: str) -> bytes | None:
    """A carried chunk's value (None: the close marker); ValueError for one that does not decode."""
    if value == CLOSED:
        return None
    try:
        return binascii.a2b_base64(value, strict_mode=True)
    except binascii.Error as exc:
        raise ValueError(str(exc)) from None
