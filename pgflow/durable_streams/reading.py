"""Reading a free-standing stream from Python: what a workflow does with a stream that a browser or
another service writes over HTTP (``@durable-streams/client``'s IdempotentProducer, say).

Read it in a step, so that the workflow's journal records what was read and a replay returns it
rather than reading again (a live stream gives a different answer later)::

    @app.step()
    async def take_orders(path: str, offset: str) -> tuple[list[Any], str]:
        got = []
        async for offset, message in read_free_stream_async(app, path, offset, live=False):
            got.append(message)
        return got, offset      # the next step resumes from the offset it returned

The reader waits like the server's own readers: on the stream's pings and pgflow's poll.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec

from ..app import App
from . import protocol as p
from .free import FreeStreamsHttp
from .server import LONG_POLL, MAX_BODY


async def read_free_stream_async(app: App, path: str, offset: str = "-1", *, live: bool = True,
                                 wait: float = LONG_POLL) -> AsyncIterator[tuple[str, Any]]:
    """Every message of the free-standing stream at ``path`` from ``offset`` on, with the offset after
    it (to resume from): decoded JSON in JSON mode, the bytes of each append otherwise. Ends when the
    stream is closed and read to its end; with ``live=False``, as soon as it is read to its tail.
    Raises ``LookupError`` when there is no stream at ``path``."""
    streams = FreeStreamsHttp(app, wait, MAX_BODY)
    position = 0 if offset == "-1" else p.parse_offset(offset)
    while True:
        stream, chunks = await streams.reads.submit((path, position))
        if stream is None or stream.deleted:
            raise LookupError(f"no stream at {path!r}")
        json_mode = p.is_json(stream.content_type)
        for chunk in chunks:
            position = chunk.end
            yield p.offset_text(position), msgspec.json.decode(chunk.data) if json_mode else chunk.data
        if chunks and position < stream.tail:
            continue
        if stream.closed or not live:
            return
        if not chunks:
            await streams._wait(path, position, wait)


def read_free_stream(app: App, path: str, offset: str = "-1", *, live: bool = True,
                     wait: float = LONG_POLL) -> Iterator[tuple[str, Any]]:
    """Blocking twin of ``read_free_stream_async``."""
    return app._internals().iterate(read_free_stream_async(app, path, offset, live=live, wait=wait))
