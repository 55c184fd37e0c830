"""What a ping names: the vocabulary of the signals layer, and the only place its prefixes are spelled.

A key names something that changed, so that whoever waits on it goes and looks at the table:

- ``ended(id)``: a workflow finished or was cancelled (or was resumed, which changes its outcome);
- ``queue(name)``: work was enqueued on a queue, fell due, or a limited queue's slot came free;
- ``stream(id, key)``: a stream of a workflow grew (named by a digest of the two);
- ``event(id)``: a workflow set an event; ``message(id)``: a message was sent to a workflow;
- ``WAKE_ALL``: everybody looks (a flush with too many keys to name).

Waiters register under these strings; payloads carry them sealed (``payload.py``), so no other role
learns them.
"""

from __future__ import annotations

import base64
import hashlib

WAKE_ALL = "*"
_ENDED = "wf:"
_QUEUE = "q:"
_STREAM = "s:"
_EVENT = "e:"
_MESSAGE = "m:"
_PERSON = b"pgflow.stream"  # the digest's personalisation: these digests name nothing else


def ended(workflow_id: str) -> str:
    return _ENDED + workflow_id


def queue(name: str) -> str:
    return _QUEUE + name


def stream(workflow_id: str, key: str) -> str:
    """A 96-bit digest of the stream's name rather than the name itself: a batch's news names a stream
    for each chunk it carries, and the names (a workflow id and a key, 48 bytes in a typical app) were
    half of every payload. Two streams of one digest would only wake each other's readers: a key is a
    hint, and a carried chunk is taken only by a reader of the stream id it names (``reader.py``).
    The id's length makes the name one-to-one: workflow "a", key "b:c" and workflow "a:b", key "c"
    are different streams."""
    name = f"{len(workflow_id)}:{workflow_id}:{key}".encode()
    return _STREAM + base64.b64encode(hashlib.blake2b(name, digest_size=12, person=_PERSON).digest()).decode()


def event(workflow_id: str) -> str:
    return _EVENT + workflow_id


def message(workflow_id: str) -> str:
    return _MESSAGE + workflow_id


def is_stream(key: str) -> bool:
    """Whether a key names a stream (its news goes on the schema's stream channel)."""
    return key.startswith(_STREAM)


def ended_workflow(key: str) -> str | None:
    """The workflow a key says ended, or None for a key of any other kind."""
    return key[len(_ENDED):] if key.startswith(_ENDED) else None
