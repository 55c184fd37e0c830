"""Free-standing streams: the whole protocol (PUT, POST, GET, HEAD, DELETE) on pgflow's tables.

Each request is one transaction of ``FreeStreams`` (``_core/store/free_streams.py``); after an append
commits, its stream's key is pinged, and readers waiting on it (long-poll, SSE, here or in any process
of the fleet) look again, as they also do on the slow poll. So a reader never depends on a ping: the
table is the only truth.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar
from urllib.parse import quote

import anyio

from .._core.signals import News
from .._core.store import Store
from .._core.store.free_streams import Append, Appended, Chunk, Created, Fork, FreeStream, FreeStreams, Producer
from ..app import App
from . import protocol as p
from .http import Receive, Request, Send, answer, read_body, sse_control, sse_data, until_disconnect
from .protocol import Refused

T = TypeVar("T")
A = TypeVar("A")
R = TypeVar("R")
READ_ROWS = 1000  # rows of one answer, at most
READ_BYTES = 1024 * 1024  # bytes of one answer, at most (its first chunk whatever its size)
SSE_SECONDS = 60.0  # an SSE answer ends after this long, so that clients reconnect (PROTOCOL.md 10.2)
BATCH = 256  # appends in one transaction, at most
_KEY_PERSON = b"pgflow.freestrm"


class Batcher(Generic[A, R]):
    """Requests that arrive while a batch is being run go together in the next one (``run`` answers a
    list of them at once, in order, an exception standing for a request's own failure), each request
    awaiting its own answer; alone, a request waits for nobody. A batch that fails as a whole is run
    again one request at a time, so that only the culprit fails.

    Appends use it for group commit (one transaction, one WAL flush, for every append of a batch:
    ``FreeStreams.append_many``), readers for shared reads (one query for every reader woken together:
    ``FreeStreams.read_many``)."""

    def __init__(self, run: Callable[[list[A]], Awaitable[list[R | Exception]]], most: int) -> None:
        self._run = run
        self._most = most
        self._pending: dict[asyncio.AbstractEventLoop, list[tuple[A, asyncio.Future[R]]]] = {}
        self._flushers: dict[asyncio.AbstractEventLoop, asyncio.Task[None]] = {}
        self.batches = 0

    async def submit(self, request: A) -> R:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._pending.setdefault(loop, []).append((request, future))
        if loop not in self._flushers:
            self._flushers[loop] = loop.create_task(self._flush(loop))
        return await future

    async def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            while self._pending.get(loop):
                pending = self._pending[loop]
                batch, self._pending[loop] = pending[:self._most], pending[self._most:]
                self.batches += 1
                try:
                    results = await self._run([request for request, _ in batch])
                except Exception as exc:  # noqa: BLE001 - each one alone, so that only the culprit fails
                    results = [exc] if len(batch) == 1 else [await self._alone(request) for request, _ in batch]
                for (_, future), result in zip(batch, results, strict=True):
                    if future.done():  # (its request was cancelled: its client left)
                        continue
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        finally:
            del self._flushers[loop]
            if not self._pending.get(loop):
                self._pending.pop(loop, None)

    async def _alone(self, request: A) -> R | Exception:
        try:
            return (await self._run([request]))[0]
        except Exception as exc:  # noqa: BLE001 - this request's own failure
            return exc


def ping_key(path: str) -> str:
    """The signal key of a free stream: a digest, so a payload does not carry the path."""
    digest = hashlib.blake2b(path.encode("utf-8", "surrogateescape"), digest_size=12, person=_KEY_PERSON).digest()
    return "fs:" + base64.b64encode(digest).decode()


class FreeStreamsHttp:
    """The handlers; ``long_poll`` seconds a long-poll waits, ``max_body`` bytes an append may carry."""

    def __init__(self, app: App, long_poll: float, max_body: int) -> None:
        self.app = app
        self.long_poll = long_poll
        self.max_body = max_body
        self._statements: dict[int, FreeStreams] = {}
        self.appends: Batcher[Append, Appended] = Batcher(self._append_many, BATCH)
        self.reads: Batcher[tuple[str, int], tuple[FreeStream | None, list[Chunk]]] = Batcher(self._read_many, BATCH)

    async def _append_many(self, appends: list[Append]) -> list[Appended | Exception]:
        return await self.db(lambda s: s.append_many(appends))

    async def _read_many(self, asks: list[tuple[str, int]]) -> list[tuple[FreeStream | None, list[Chunk]] | Exception]:
        return list(await self.db(lambda s: s.read_many(asks, READ_ROWS, READ_BYTES)))

    async def db(self, fn: Callable[[FreeStreams], Awaitable[T]]) -> T:
        runtime = self.app._client.runtime()

        async def run(store: Store) -> T:
            statements = self._statements.get(id(store))
            if statements is None or statements.pool is not store.pool:
                statements = self._statements[id(store)] = FreeStreams(store.pool, store.schema)
            return await fn(statements)

        return await runtime.db(run)

    def ping(self, path: str) -> None:
        self.app._client.runtime().signals.announce(News([ping_key(path)]))

    async def handle(self, request: Request, receive: Receive, send: Send) -> None:
        if request.path in ("", "/"):
            raise Refused(404, "a stream lives at a path: PUT /some/name creates one")
        method = request.method
        if method == "PUT":
            await self.create(request, receive, send)
        elif method == "POST":
            await self.append(request, receive, send)
        elif method in ("GET", "HEAD"):
            await self.read(request, receive, send)
        elif method == "DELETE":
            outcome = await self.db(lambda s: s.delete(request.path))
            if outcome == "missing":
                raise Refused(404, "no stream at this path")
            if outcome == "gone":
                raise Refused(410, "this stream was deleted (forks of it still read its data)")
            self.ping(request.path)
            await answer(send, 204, {})
        else:
            raise Refused(405, f"{method} is not a method of a stream: PUT, POST, GET, HEAD, DELETE",
                          {"allow": "PUT, POST, GET, HEAD, DELETE, OPTIONS"})

    # -- PUT ------------------------------------------------------------------------------------------

    async def create(self, request: Request, receive: Receive, send: Send) -> None:
        headers = request.headers
        media = p.content_type(headers.get("content-type"))
        ttl, expires_at = p.expiry(headers)
        fork = _fork(headers)
        close = p.closing(headers)
        body = await read_body(receive, headers, self.max_body)
        if fork is not None and media is None:
            source = await self.db(lambda s: s.get(fork.source))
            media = source.content_type if source is not None else "application/octet-stream"
        media = media or "application/octet-stream"
        json_mode = p.is_json(media)
        units = (p.json_messages(body, allow_empty=True) if json_mode else [body]) if body else []
        created: Created = await self.db(lambda s: s.create(request.path, media, ttl, expires_at, close, json_mode,
                                                            units, fork))
        stream = created.stream
        if created.outcome == "no_source":
            raise Refused(404, "Stream-Forked-From names no stream")
        if created.outcome in ("source_gone", "gone"):
            raise Refused(409, "that stream was deleted (forks of it still read its data): its path stays taken"
                          if created.outcome == "gone" else "the source stream was deleted: it cannot be forked")
        if created.outcome == "bad_offset":
            raise Refused(400, created.reason)
        if created.outcome == "conflict":
            raise Refused(409, created.reason or "a stream exists at this path with another configuration"
                          " (content type, TTL, expiry, closure or fork)")
        assert stream is not None
        if created.outcome == "created" and units:
            self.ping(request.path)
        out = {"content-type": stream.content_type, p.NEXT_OFFSET: p.offset_text(stream.tail)}
        if stream.closed:
            out[p.CLOSED] = "true"
        if created.outcome == "created":
            out["location"] = _location(request)
        await answer(send, 201 if created.outcome == "created" else 200, out)

    # -- POST -----------------------------------------------------------------------------------------

    async def append(self, request: Request, receive: Receive, send: Send) -> None:
        headers = request.headers
        producer = _producer(headers)
        seq = p.text_header(headers, p.SEQ)
        close = p.closing(headers)
        media = p.content_type(headers.get("content-type"))
        body = await read_body(receive, headers, self.max_body)
        if not body and not close:
            raise Refused(400, "an append needs a body (or Stream-Closed: true to close the stream)")
        if body and media is None:
            raise Refused(400, "an append with a body needs its Content-Type")

        def units_of(stream: FreeStream) -> list[bytes]:
            if not body:
                return []
            if p.is_json(stream.content_type) and media is not None and p.is_json(media):
                return p.json_messages(body, allow_empty=False)
            return [body]

        done = await self.appends.submit(Append(request.path, media, bool(body), units_of, close, seq, producer))
        await self._appended(request.path, done, producer, send, not body)

    async def _appended(self, path: str, done: Appended, producer: Producer | None, send: Send,
                        appended_nothing: bool) -> None:
        stream = done.stream
        outcome = done.outcome
        if outcome == "missing":
            raise Refused(404, "no stream at this path: PUT creates one")
        if outcome == "gone":
            raise Refused(410, "this stream was deleted (forks of it still read its data)")
        assert stream is not None
        tail = {p.NEXT_OFFSET: p.offset_text(stream.tail)}
        if stream.closed:
            tail[p.CLOSED] = "true"
        if outcome == "closed":
            raise Refused(409, "the stream is closed: it takes no more appends", tail)
        if outcome == "type":
            raise Refused(409, f"the stream's content type is {stream.content_type}")
        if outcome == "seq":
            raise Refused(409, "Stream-Seq must be greater than the last one (compared as text)")
        if outcome == "stale_epoch":
            raise Refused(403, "a newer epoch of this producer has written: this one is fenced",
                          {p.PRODUCER_EPOCH: str(done.epoch)})
        if outcome == "epoch_seq":
            raise Refused(400, "a new Producer-Epoch starts at Producer-Seq 0")
        if outcome == "gap":
            raise Refused(409, f"Producer-Seq {producer.seq if producer else 0} skips ahead: expected {done.expected}",
                          {p.EXPECTED_SEQ: str(done.expected),
                           p.RECEIVED_SEQ: str(producer.seq if producer else 0)})
        if producer is not None:
            tail[p.PRODUCER_EPOCH] = str(done.epoch)
            tail[p.PRODUCER_SEQ] = str(done.seq)
        if outcome == "ok":
            self.ping(path)
            await answer(send, 200 if producer is not None and not appended_nothing else 204, tail)
            return
        await answer(send, 204, tail)  # a duplicate: already there

    # -- GET and HEAD ---------------------------------------------------------------------------------

    async def read(self, request: Request, receive: Receive, send: Send) -> None:
        offset = request.one("offset")
        live = request.one("live")
        client_cursor = request.one("cursor")
        if live not in (None, "long-poll", "sse"):
            raise Refused(400, "live is long-poll or sse")
        if offset == "":
            raise Refused(400, "offset is empty: give -1, now, or a Stream-Next-Offset")
        if live is not None and offset is None:
            raise Refused(400, f"live={live} needs an offset (-1 for the start, now for the tail)")
        start = 0 if offset in (None, "-1") else None if offset == "now" else p.parse_offset(offset)
        got: tuple[FreeStream | None, list[Chunk]]
        if request.method == "HEAD" or start is None:
            got = await self.db(lambda s: s.get(request.path)), []
        else:  # the stream and its chunks, in a read shared with every reader asking meanwhile
            got = await self.reads.submit((request.path, start))
        maybe, chunks = got
        if maybe is None:
            raise Refused(404, "no stream at this path")
        stream = maybe
        if stream.deleted:
            raise Refused(410, "this stream was deleted")
        if request.method == "HEAD":
            await answer(send, 200, _meta(stream) | {"etag": _etag(stream, -1, stream.tail)})
            return
        position = stream.tail if start is None else start
        if position > stream.tail:
            raise Refused(400, "offset is past the stream's tail (an offset of another stream at this path?)")
        if live == "sse":
            await self.sse(request.path, stream, chunks, position, client_cursor, receive, send)
            return
        json_mode = p.is_json(stream.content_type)
        if offset == "now" and live is None:
            await self.db(functools.partial(_touch, stream))
            out = {"content-type": stream.content_type, p.NEXT_OFFSET: p.offset_text(stream.tail), p.UP_TO_DATE: "true"}
            if stream.closed:
                out[p.CLOSED] = "true"
            await answer(send, 200, out, b"[]" if json_mode else b"")
            return
        if not chunks and live == "long-poll" and not stream.closed:
            found = await self._wait(request.path, position, self.long_poll)
            if found is None:
                out = {p.NEXT_OFFSET: p.offset_text(position), p.UP_TO_DATE: "true", p.CURSOR: p.cursor(client_cursor)}
                await answer(send, 204, out)
                return
            stream, chunks = found
            if stream.deleted:
                raise Refused(410, "this stream was deleted")
        end = chunks[-1].end if chunks else position
        at_tail = end >= stream.tail
        out = {"content-type": stream.content_type, p.NEXT_OFFSET: p.offset_text(end)}
        if at_tail:
            out[p.UP_TO_DATE] = "true"
            if stream.closed:
                out[p.CLOSED] = "true"
        if live == "long-poll":
            if not chunks:  # closed, at its end
                await answer(send, 204, out)
                return
            out[p.CURSOR] = p.cursor(client_cursor)
        etag = _etag(stream, position, end, closed=stream.closed and at_tail)
        if request.headers.get("if-none-match") == etag:
            await answer(send, 304, {"etag": etag})
            return
        out["etag"] = etag
        if stream.content_type.split(";")[0].strip().lower() == "application/octet-stream":
            out["content-disposition"] = "attachment"
        await answer(send, 200, out, _body(chunks, json_mode))

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

        runtime = self.app._client.runtime()
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

        async with anyio.create_task_group() as group:
            group.start_soon(until_disconnect, receive, group.cancel_scope)
            with anyio.move_on_after(SSE_SECONDS):
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
                    if at_tail:  # wait for more (the wait's own read brings it)
                        try:
                            found = await self._wait(path, position, SSE_SECONDS)
                        except Refused:  # deleted meanwhile: the answer ends
                            break
                        if found is None:
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


async def _touch(stream: FreeStream, statements: FreeStreams) -> None:
    await statements.touch(stream)


def _body(chunks: list[Chunk], json_mode: bool) -> bytes:
    if json_mode:
        return b"[" + b",".join(c.data for c in chunks) + b"]"
    return b"".join(c.data for c in chunks)


def _location(request: Request) -> str:
    """The new stream's absolute URL (what a 201's Location is), from the Host the client used."""
    return f"{request.scheme}://{request.headers.get('host', 'localhost')}{quote(request.path)}"


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


def _fork(headers: dict[str, str]) -> Fork | None:
    source = p.text_header(headers, p.FORKED_FROM)
    offset, sub = headers.get(p.FORK_OFFSET), headers.get(p.FORK_SUB_OFFSET)
    if source is None:
        if offset is not None or sub is not None:
            raise Refused(400, "Stream-Fork-Offset and Stream-Fork-Sub-Offset need Stream-Forked-From")
        return None
    if not source.startswith("/"):
        raise Refused(400, "Stream-Forked-From is the path of a stream of this server, /...")
    anchor = p.parse_offset(offset.strip(), what="Stream-Fork-Offset") if offset is not None else None
    sub_value = p.decimal(sub, "Stream-Fork-Sub-Offset", p.MAX_POSITION) if sub is not None else 0
    if sub_value and anchor is None:
        raise Refused(400, "Stream-Fork-Sub-Offset needs Stream-Fork-Offset")
    return Fork(source, anchor, sub_value)


def _producer(headers: dict[str, str]) -> Producer | None:
    given = [headers.get(n) for n in (p.PRODUCER_ID, p.PRODUCER_EPOCH, p.PRODUCER_SEQ)]
    if all(v is None for v in given):
        return None
    if any(v is None for v in given):
        raise Refused(400, "Producer-Id, Producer-Epoch and Producer-Seq go together: give all three or none")
    producer_id = p.text_header(headers, p.PRODUCER_ID)
    if not producer_id or not producer_id.strip():
        raise Refused(400, "Producer-Id is empty")
    epoch = p.decimal(given[1] or "", "Producer-Epoch", p.MAX_SAFE)
    seq = p.decimal(given[2] or "", "Producer-Seq", p.MAX_SAFE)
    return Producer(producer_id, epoch, seq)


