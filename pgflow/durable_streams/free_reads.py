"""The read path of free-standing streams: HEAD, GET (a page), long-poll and Server-Sent Events.

A read takes its chunks in a read shared with every reader asking meanwhile (``FreeStreamsAccess.reads``).
A live reader at the tail waits on pings of its stream's key and on the slow poll (``_wait``), and reads
again when either comes: it never depends on a ping, the table is the only truth. An SSE answer follows
its stream (``following``): it takes the appends this process commits to it from their writer when they
alone woke it and follow on from where it is, and reads the table otherwise.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import anyio
import psycopg

from .._core.engine.free_streams import Chunk, FreeStream, FreeStreams
from .._core.signals import Outage
from . import protocol as p
from .following import Follower, following
from .free_access import READ_BYTES, READ_ROWS, FreeStreamsAccess, ping_key
from .http import Receive, Request, Send, answer, sse_control, sse_data, until_disconnect
from .protocol import Refused

SSE_SECONDS = 60.0  # an SSE answer ends after this long, so that clients reconnect (PROTOCOL.md 10.2)


@dataclass(frozen=True)
class _Ask:
    """What a GET or HEAD asks: ``offset`` as given, ``start`` the position it names (None: the tail)."""

    offset: str | None
    live: str | None
    cursor: str | None
    start: int | None

    @classmethod
    def of(cls, request: Request) -> _Ask:
        offset = request.one("offset")
        live = request.one("live")
        client_cursor = request.one("cursor")
        p.check_read(offset, live)
        start = 0 if offset in (None, "-1") else None if offset == "now" else p.parse_offset(offset)
        return cls(offset, live, client_cursor, start)


class FreeReads(FreeStreamsAccess):
    """The handlers of HEAD and GET, plain, long-poll or SSE."""

    async def read(self, request: Request, receive: Receive, send: Send) -> None:
        ask = _Ask.of(request)
        stream, chunks = await self._first_read(request, ask.start)
        if request.method == "HEAD":
            await answer(send, 200, _meta(stream) | {"etag": _etag(stream, -1, stream.tail)})
            return
        position = stream.tail if ask.start is None else ask.start
        if position > stream.tail:
            raise Refused(400, "offset is past the stream's tail (an offset of another stream at this path?)")
        if ask.live == "sse":
            await self.sse(request.path, stream, chunks, position, ask.cursor, receive, send)
            return
        if ask.offset == "now" and ask.live is None:
            await self._answer_tail(stream, send)
            return
        if not chunks and ask.live == "long-poll" and not stream.closed:
            found = await self._wait(request.path, position, self.long_poll)
            if found is None:
                out = {p.NEXT_OFFSET: p.offset_text(position), p.UP_TO_DATE: "true", p.CURSOR: p.cursor(ask.cursor)}
                await answer(send, 204, out)
                return
            stream, chunks = found
            if stream.deleted:
                raise Refused(410, "this stream was deleted")
        await self._answer_page(request, send, stream, chunks, position, ask)

    async def _first_read(self, request: Request, start: int | None) -> tuple[FreeStream, list[Chunk]]:
        """The stream (and its chunks from ``start`` on, for a GET from a position), or why not."""
        got: tuple[FreeStream | None, list[Chunk]]
        if request.method == "HEAD" or start is None:
            got = await self.db(lambda s: s.get(request.path)), []
        else:  # the stream and its chunks, in a read shared with every reader asking meanwhile
            got = await self.reads.submit((request.path, start))
        maybe, chunks = got
        if maybe is None:
            raise Refused(404, "no stream at this path")
        if maybe.deleted:
            raise Refused(410, "this stream was deleted")
        return maybe, chunks

    async def _answer_tail(self, stream: FreeStream, send: Send) -> None:
        """``offset=now``, not live: nothing, and the tail (the read moves a sliding TTL on)."""
        await self.db(functools.partial(_touch, stream))
        out = {"content-type": stream.content_type, p.NEXT_OFFSET: p.offset_text(stream.tail), p.UP_TO_DATE: "true"}
        if stream.closed:
            out[p.CLOSED] = "true"
        await answer(send, 200, out, b"[]" if p.is_json(stream.content_type) else b"")

    async def _answer_page(self, request: Request, send: Send, stream: FreeStream, chunks: list[Chunk],
                           position: int, ask: _Ask) -> None:
        """A page of chunks from ``position`` (none: a long-poll of a closed stream, at its end)."""
        end = chunks[-1].end if chunks else position
        at_tail = end >= stream.tail
        out = {"content-type": stream.content_type, p.NEXT_OFFSET: p.offset_text(end)}
        if at_tail:
            out[p.UP_TO_DATE] = "true"
            if stream.closed:
                out[p.CLOSED] = "true"
        if ask.live == "long-poll":
            if not chunks:  # closed, at its end
                await answer(send, 204, out)
                return
            out[p.CURSOR] = p.cursor(ask.cursor)
        etag = _etag(stream, position, end, closed=stream.closed and at_tail)
        if request.headers.get("if-none-match") == etag:
            await answer(send, 304, {"etag": etag})
            return
        out["etag"] = etag
        if stream.content_type.split(";")[0].strip().lower() == "application/octet-stream":
            out["content-disposition"] = "attachment"
        await answer(send, 200, out, _body(chunks, p.is_json(stream.content_type)))

    async def _wait(self, path: str, position: int, timeout: float) -> tuple[FreeStream, list[Chunk]] | None:
        """Wait for chunks from ``position`` (or the stream's closure or deletion), on pings of the stream
        and the poll; None when ``timeout`` passes first."""

        async def check() -> tuple[FreeStream, list[Chunk]] | None:
            stream, chunks = await self.reads.submit((path, position))
            if stream is None:
                raise Refused(404, "the stream was deleted")
            if stream.deleted:
                return stream, []
            return (stream, chunks) if chunks or stream.closed else None

        runtime = self.app._internals().runtime()
        return await runtime.wait_for([ping_key(path)], check, timeout)

    async def sse(self, path: str, stream: FreeStream, chunks: list[Chunk], position: int,
                  client_cursor: str | None, receive: Receive, send: Send) -> None:
        """Server-Sent Events: each data event followed by its control event; closed at the stream's end,
        or after ``SSE_SECONDS`` (the client reconnects from the last control's offset)."""
        json_mode = p.is_json(stream.content_type)
        mode = "json" if json_mode else "text" if p.is_text(stream.content_type) else "base64"
        head = {"content-type": "text/event-stream", "cache-control": "no-cache", "x-accel-buffering": "no"}
        if mode == "base64":
            head[p.SSE_ENCODING] = "base64"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(k.encode(), v.encode()) for k, v in head.items()]})

        async def event(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        runtime = self.app._internals().runtime()
        async with anyio.create_task_group() as group:
            group.start_soon(until_disconnect, receive, group.cancel_scope)
            with following(self.followers, runtime.signals.waiters, path, ping_key(path)) as follower, \
                    anyio.move_on_after(SSE_SECONDS):
                while True:
                    data = b""  # sent with its control event, in one write: a reader sees both or neither
                    if chunks:
                        data = sse_data(_body(chunks, json_mode), mode)
                        position = chunks[-1].end
                    at_tail = position >= stream.tail
                    control: dict[str, object] = {"streamNextOffset": p.offset_text(position)}
                    if stream.closed and at_tail:
                        control.update(streamClosed=True, upToDate=True)
                        await event(data + sse_control(control))
                        break
                    control["streamCursor"] = p.cursor(client_cursor)
                    if at_tail:
                        control["upToDate"] = True
                    if chunks or at_tail:
                        await event(data + sse_control(control))
                    if at_tail:  # wait for more (handed by this process's writes, or read)
                        found = await self._follow(path, position, follower)
                        if found is None:  # deleted meanwhile: the answer ends
                            break
                        stream, chunks = found
                    else:  # a page cut short: the next one at once
                        latest, chunks = await self.reads.submit((path, position))
                        if latest is None:
                            break
                        stream = latest
                    if stream.deleted:
                        break
            group.cancel_scope.cancel()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _follow(self, path: str, position: int, follower: Follower) -> tuple[FreeStream, list[Chunk]] | None:
        """The chunks from ``position`` on (or the stream's closure or deletion), once there are some:
        handed by this process's appends or read from the table (``following``). None when the stream
        is no more. Waits as long as the answer lasts; a database out of reach counts as "nothing yet"
        for as long as waiters bear it (``Outage``)."""
        outage = Outage()
        while True:
            if not await follower.wait(SSE_SECONDS):
                continue  # (the answer's own time runs out first)
            found = follower.take(position, READ_ROWS, READ_BYTES)
            if found is None:
                try:
                    got = await self.reads.submit((path, position))
                    outage.over()
                except psycopg.Error as exc:
                    outage.bear(exc)
                    continue
                maybe, chunks = got
                if maybe is None:
                    return None
                found = maybe, chunks
            stream, chunks = found
            if chunks or stream.closed or stream.deleted:
                return found


async def _touch(stream: FreeStream, statements: FreeStreams) -> None:
    await statements.touch(stream)


def _body(chunks: list[Chunk], json_mode: bool) -> bytes:
    if json_mode:
        return b"[" + b",".join(c.data for c in chunks) + b"]"
    return b"".join(c.data for c in chunks)


def _etag(stream: FreeStream, start: int, end: int, closed: bool | None = None) -> str:
    closed = stream.closed if closed is None else closed
    return f'"{stream.id}:{start}:{end}{":c" if closed else ""}"'


def _meta(stream: FreeStream) -> dict[str, str]:
    out = {"content-type": stream.content_type, p.NEXT_OFFSET: p.offset_text(stream.tail)}
    if stream.closed:
        out[p.CLOSED] = "true"
    if stream.ttl is not None:
        out[p.TTL] = str(stream.ttl)
    if stream.expires_at is not None:
        out[p.EXPIRES_AT] = p.http_time(stream.expires_at)
    return out
