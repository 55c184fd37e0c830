"""What one payload says, and how a set of news is cut into payloads that fit in a NOTIFY.

A payload's plaintext is a msgpack ``News``: plain keys (``keys.py``: "go and look"), and the truth
some of them may carry, each sent only once it is durable: the ends of workflows (so a caller waiting
for a result needs no read of the row) and small stream chunks (so a reader keeping up runs no
query). Each carried thing names what it is bound to, so that a payload heard late, or replayed by
somebody who recorded it, can at most cause a read, never pass for newer news:

- an ``End`` names the workflow's ``born`` (its row's creation time, in microseconds: a workflow
  started again under the same id after the old one was pruned is another) and its ``attempt``
  (a resumed run's end has a higher one; see ``ends.py``);
- a ``Chunk`` names its stream's id, which is never handed out twice, and its position: a chunk
  once committed never changes.

The plaintext is sealed by ``sealing.py``; nothing here is readable on the channel.
"""

from __future__ import annotations

from typing import Any

import msgspec

from . import keys as signal_keys

# Plaintext bytes per payload: a sealed payload (base64 of 42 bytes of header and tag plus the
# plaintext) must stay under PostgreSQL's 8000-byte NOTIFY limit.
PLAINTEXT_LIMIT = 5800
CARRY_END_AT_MOST = 3000  # bytes of an encoded end carried in a payload; a bigger end is only named
CARRY_CHUNK_AT_MOST = 600  # bytes of a chunk's value carried; a bigger chunk is only named
WAKE_ALL_ABOVE = 2000  # keys in one flush beyond which a single "wake all" is cheaper


class End(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A workflow's end as its row recorded it. (Neither it nor ``Chunk`` can hold a cycle: untracked
    by the garbage collector, a News of many costs the reader's process no collections.)"""

    workflow_id: str
    born: int  # the row's created_at, in microseconds since the epoch
    attempt: int
    name: str
    status: str
    output: bytes | None
    error: dict[str, Any] | None


class Chunk(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A committed chunk of a stream (``value`` None: the close marker)."""

    stream: str  # the stream's key (``keys.stream``)
    stream_id: int
    position: int
    value: bytes | None


class News(msgspec.Struct, array_like=True):
    """What changed: keys to look at, and the ends and chunks that come with theirs."""

    keys: list[str] = msgspec.field(default_factory=list)
    ends: list[End] = msgspec.field(default_factory=list)
    chunks: list[Chunk] = msgspec.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.keys or self.ends or self.chunks)

    def plain(self) -> News:
        """The same news without what it carries: the keys of the ends and the chunks."""
        return News([*self.keys, *(signal_keys.ended(e.workflow_id) for e in self.ends),
                     *{c.stream for c in self.chunks}])


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(News)


def decode(plaintext: bytes) -> News | None:
    """The news of an opened payload; None for one that does not decode (a sender of another
    version, or a bug: it verified, so it is nobody's forgery)."""
    try:
        return _decoder.decode(plaintext)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def by_channel(news: News) -> tuple[News, News]:
    """``news`` as what goes on the schema's main channel and what goes on its stream channel (the
    chunks, and the keys of streams); a "wake all" goes on both."""
    keys = [key for key in news.keys if not signal_keys.is_stream(key)]
    streams = [key for key in news.keys if signal_keys.is_stream(key) or key == signal_keys.WAKE_ALL]
    return News(keys, news.ends), News(streams, [], news.chunks)


def carried_end(end: End) -> bool:
    """Whether an end is small enough to ride in a payload."""
    size = len(end.workflow_id) + len(end.name) + (len(end.output) if end.output is not None else 0)
    if size > CARRY_END_AT_MOST:
        return False
    return end.error is None or size + len(_encoder.encode(end.error)) <= CARRY_END_AT_MOST


def plaintexts(news: News) -> list[bytes]:
    """The plaintexts of the payloads that tell ``news``: one "wake all" when it names very many
    keys, else as few payloads as fit. News too big for one payload is cut by the estimated size of
    each thing, so each part is encoded once (a stream batch carries a chunk per stream: halving the
    whole until it fits would encode it four times over); a part the estimate got wrong is halved."""
    if len(news.keys) + len(news.ends) + len(news.chunks) > WAKE_ALL_ABOVE:
        return [_encoder.encode(News([signal_keys.WAKE_ALL]))]
    if not news:
        return []
    parts = _parts(news)
    return [text for part in parts for text in _halves(part)] if len(parts) > 1 else _halves(news)


def _parts(news: News) -> list[News]:
    """``news`` cut into parts whose estimated encoding fits a payload (msgpack adds a few bytes of
    header to each string, bytes value and integer: 22 covers a chunk's, 3 a key's when it is ASCII)."""
    parts = [News()]
    size = 0

    def room(needed: int) -> News:
        nonlocal size
        if size + needed > PLAINTEXT_LIMIT - 16 and size:
            parts.append(News())
            size = 0
        size += needed
        return parts[-1]

    for key in news.keys:
        room(len(key) + 3).keys.append(key)
    for end in news.ends:
        room(len(_encoder.encode(end))).ends.append(end)
    for chunk in news.chunks:
        room(len(chunk.stream) + (len(chunk.value) if chunk.value is not None else 0) + 22).chunks.append(chunk)
    return parts


def _halves(news: News) -> list[bytes]:
    whole = _encoder.encode(news)
    if len(whole) <= PLAINTEXT_LIMIT:
        return [whole]
    if len(news.keys) + len(news.ends) + len(news.chunks) == 1:
        # A single thing too big for any payload (an enormous id or key): wake everybody instead.
        return [_encoder.encode(News([signal_keys.WAKE_ALL]))]
    first, second = _split(news)
    return _halves(first) + _halves(second)


def _split(news: News) -> tuple[News, News]:
    """Two parts of ``news`` (which holds two things at least): the longest of its lists is halved,
    or, when none holds two, moved whole into the second part."""
    head: list[list[Any]] = [news.keys, news.ends, news.chunks]
    tail: list[list[Any]] = [[], [], []]
    i = max(range(3), key=lambda n: len(head[n]))
    middle = len(head[i]) // 2
    head[i], tail[i] = (head[i][:middle], head[i][middle:]) if middle else ([], head[i])
    return News(*head), News(*tail)
