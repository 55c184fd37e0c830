"""A workflow's stream over the protocol, read-only, in JSON mode: ``/workflows/{workflow_id}/{key}``.

Each chunk is one message (decoded from pgflow's encoding and written as JSON); position n of the
stream is offset ``...n``. Catch-up reads are one query; live reads (long-poll, SSE) are pgflow's own
stream readers (``runtime.read_stream``), so they share their loop's fetches and wait on the coalesced
pings plus the poll like every other reader. A stream ends for its readers when it is closed or its
workflow ends in any way. Writes are refused: a workflow's stream is written by its workflow.
"""

from __future__ import annotations

import hashlib

import anyio
import msgspec

from .._core import codec
from .._core.checks import check_id, check_key
from .._core.status import ENDED
from .._core.streams.reader import READ_BATCH, StreamRead
from ..app import App
from ..errors import UnknownWorkflow
from . import protocol as p
from .http import Receive, Request, Send, answer, sse_control, sse_event, until_disconnect
from .protocol import Refused

PREFIX = "/workflows/"
SSE_SECONDS = 60.0
Batch = list[tuple[int, bytes | None]]


def split(path: str) -> tuple[str, str]:
    """(workflow id, key) of ``/workflows/{id}/{key}``; 400 for anything else."""
    workflow_id, slash, key = path[len(PREFIX):].partition("/")
    try:
        if not slash:
            raise ValueError("a workflow's stream is at /workflows/{workflow_id}/{key}")
        check_id(workflow_id)
        check_key(key)
    except (TypeError, ValueError) as exc:
        raise Refused(400, str(exc)) from None
    return workflow_id, key


def _json(value: bytes) -> bytes:
    return msgspec.json.encode(codec.untyped.decode(value))


def _messages(batch: Batch) -> tuple[list[bytes], int | None, bool]:
    """The JSON messages of a batch, the position after its last one, and whether it held the close
    marker (the stream's last chunk)."""
    out: list[bytes] = []
    end: int | None = None
    for position, value in batch:
        if value is None:
            return out, end if end is not None else position, True
        out.append(_json(value))
        end = position + 1
    return out, end, False


class WorkflowStreamsHttp:
    def __init__(self, app: App, long_poll: float) -> None:
        self.app = app
        self.long_poll = long_poll

    async def handle(self, request: Request, receive: Receive, send: Send) -> None:
        workflow_id, key = split(request.path)
        if request.method not in ("GET", "HEAD"):
            raise Refused(405, "a workflow's stream is written by its workflow (pgflow.write_stream): here it is"
                               " read-only (GET, HEAD)", {"allow": "GET, HEAD, OPTIONS"})
        offset = request.one("offset")
        live = request.one("live")
        p.check_read(offset, live)
        tail, ended = await self._tail(workflow_id, key)
        if request.method == "HEAD" or (offset == "now" and live is None):
            out = {"content-type": "application/json", p.NEXT_OFFSET: p.offset_text(tail), p.UP_TO_DATE: "true"}
            if ended:
                out[p.CLOSED] = "true"
            await answer(send, 200, out, b"" if request.method == "HEAD" else b"[]")
            return
        position = tail if offset == "now" else 0 if offset in (None, "-1") else p.parse_offset(offset)
        if position > tail:
            raise Refused(400, "offset is past the stream's tail")
        if live == "sse":
            await self._sse(workflow_id, key, position, request.one("cursor"), receive, send)
            return
        messages: list[bytes] = []
        end: int | None = None
        closed = False
        if position < tail:  # there is data: a pgflow reader's first batch comes at once
            messages, end, closed, ended = await self._next(workflow_id, key, position)
        elif not ended and live == "long-poll":
            with anyio.move_on_after(self.long_poll):
                messages, end, closed, ended = await self._next(workflow_id, key, position)
        end = position if end is None else end
        over = closed or (ended and end >= tail)
        out = {"content-type": "application/json", p.NEXT_OFFSET: p.offset_text(end)}
        if end >= tail or over:
            out[p.UP_TO_DATE] = "true"
        if over:
            out[p.CLOSED] = "true"
        if live == "long-poll":
            if not over:
                out[p.CURSOR] = p.cursor(request.one("cursor"))
            if not messages:
                out[p.UP_TO_DATE] = "true"
                await answer(send, 204, out)
                return
        digest = hashlib.blake2b(f"{workflow_id}\0{key}".encode(), digest_size=6).hexdigest()
        etag = f'"wf{digest}:{position}:{end}{":c" if over else ""}"'
        if request.headers.get("if-none-match") == etag:
            await answer(send, 304, {"etag": etag})
            return
        out["etag"] = etag
        await answer(send, 200, out, b"[" + b",".join(messages) + b"]")

    async def _tail(self, workflow_id: str, key: str) -> tuple[int, bool]:
        """The stream's length and whether it has ended (HEAD, offset=now)."""
        try:
            info = await self.app.handle(workflow_id).info_async()
        except UnknownWorkflow:
            raise Refused(404, f"no workflow with id {workflow_id!r}") from None
        ended = info.record.status in ENDED
        for stream in info.streams:
            if stream.key == key:
                return stream.length, stream.closed or ended
        return 0, ended

    async def _next(self, workflow_id: str, key: str, position: int) -> tuple[list[bytes], int | None, bool, bool]:
        """The next batch a pgflow reader gets from ``position``: (messages, end, closed, ended)."""
        read: StreamRead = self.app._internals().runtime().read_stream(workflow_id, key, position)
        try:
            batch = await read.__anext__()
        except StopAsyncIteration:
            return [], None, False, True
        finally:
            read.stop()
        messages, end, closed = _messages(batch)
        return messages, end, closed, False

    async def _sse(self, workflow_id: str, key: str, position: int, client_cursor: str | None,
                   receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                                (b"x-accel-buffering", b"no")]})

        async def event(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        read: StreamRead = self.app._internals().runtime().read_stream(workflow_id, key, position)
        async with anyio.create_task_group() as group:
            group.start_soon(until_disconnect, receive, group.cancel_scope)
            try:
                with anyio.move_on_after(SSE_SECONDS):
                    await event(sse_control({"streamNextOffset": p.offset_text(position),
                                             "streamCursor": p.cursor(client_cursor)}))
                    while True:
                        try:
                            batch = await read.__anext__()
                        except StopAsyncIteration:
                            await event(sse_control({"streamNextOffset": p.offset_text(position),
                                                     "streamClosed": True, "upToDate": True}))
                            break
                        messages, end, closed = _messages(batch)
                        data = b""  # sent with its control event, in one write
                        if messages:
                            data = sse_event("data", "[" + ",".join(m.decode() for m in messages) + "]")
                        position = end if end is not None else position
                        control: dict[str, object] = {"streamNextOffset": p.offset_text(position)}
                        if closed:
                            control.update(streamClosed=True, upToDate=True)
                            await event(data + sse_control(control))
                            break
                        control["streamCursor"] = p.cursor(client_cursor)
                        if len(batch) < READ_BATCH:
                            control["upToDate"] = True
                        await event(data + sse_control(control))
            finally:
                read.stop()
            group.cancel_scope.cancel()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
