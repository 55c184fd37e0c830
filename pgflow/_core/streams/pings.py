"""A stream's ping, and the chunk it may carry.

A batch of chunks pings ``s:<workflow id>:<key>`` for every stream it grew, with its commit. When a
stream has a single chunk in the batch and that chunk is small, the ping carries it instead:
``c:<position>:<base64 value, or - for the close marker>:<length of the workflow id>:s:<workflow
id>:<key>`` (the length tells apart the streams whose plain pings are alike, such as workflow ``a`` key
``b:c`` and workflow ``a:b`` key ``c``). A reader waiting at exactly that position takes the chunk from
the ping and runs no query; any other reader of the stream (behind, busy, or not yet started) takes it
as the plain ping it ends with, and reads. A batch carries chunks only when every chunk in it was
written (a fenced-out writer's batch pings plainly), and its pings go out with its commit, so what
they carry is durable; one stream's pings arrive in the order their batches committed.

(Processes of a version before this one know no ``c:`` key, and find these chunks on their slow poll.)
"""

from __future__ import annotations

import binascii

STREAM_PING = "s:"
CARRIED_CHUNK = "c:"
CARRY_AT_MOST = 600  # bytes of a chunk's encoded value carried in its ping; a bigger one is only pinged
CARRY_PING_AT_MOST = 300  # characters of a plain ping that may carry (JSON may escape each as 6 bytes)
CARRY_PER_BATCH = 32_000  # characters of carried keys per batch; the rest of a very wide batch pings plainly
CLOSED = "-"  # the value of a carried close marker (no base64 text is "-")


def stream_ping(workflow_id: str, key: str) -> str:
    return f"{STREAM_PING}{workflow_id}:{key}"


def carrying(ping: str, workflow_id: str, position: int, value: bytes | None) -> str:
    """The ping of a stream's only chunk in a batch: the chunk itself when it is small enough."""
    if len(ping) > CARRY_PING_AT_MOST or (value is not None and len(value) > CARRY_AT_MOST):
        return ping
    encoded = CLOSED if value is None else binascii.b2a_base64(value, newline=False).decode()
    return f"{CARRIED_CHUNK}{position}:{encoded}:{len(workflow_id)}:{ping}"


def carried(key: str) -> tuple[str, int, str, int]:
    """(stream ping, position, encoded value, length of the workflow id) of a ``c:`` key; ValueError
    for one that does not parse."""
    _, position, value, id_length, ping = key.split(":", 4)
    return ping, int(position), value, int(id_length)


def carried_value(value: str) -> bytes | None:
    """A carried chunk's value (None: the close marker); ValueError for one that does not decode."""
    if value == CLOSED:
        return None
    try:
        return binascii.a2b_base64(value, strict_mode=True)
    except binascii.Error as exc:
        raise ValueError(str(exc)) from None
