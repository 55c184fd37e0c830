"""The plain ASGI plumbing both kinds of stream share: a request read within bounds, answers, and
Server-Sent Events. No framework: the protocol is a handful of headers on a handful of methods, and
every byte of a request is bounded here before anything looks at it."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

import anyio

from .protocol import Refused

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

MAX_QUERY = 4096  # bytes of a query string
MAX_PATH = 1024  # bytes of a stream's path
_LINES = re.compile(r"\r\n|\r|\n")
_CONTROL = re.compile("[\x00-\x1f\x7f]")


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    scheme: str = "http"

    def one(self, name: str) -> str | None:
        """A query parameter given at most once."""
        values = self.query.get(name)
        if values is None:
            return None
        if len(values) > 1:
            raise Refused(400, f"give the {name} parameter once")
        return values[0]


def headers_of(scope: Scope) -> dict[str, str]:
    """The request's headers by lower-case name (the last of a repeated one)."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def request_of(scope: Scope, headers: dict[str, str] | None = None) -> Request:
    """The request's method, path, query and ``headers`` (read from the scope when not given), checked
    for size and form (400 otherwise)."""
    raw_query: bytes = scope.get("query_string", b"")
    if len(raw_query) > MAX_QUERY:
        raise Refused(414, f"the query string is over {MAX_QUERY} bytes")
    path: str = scope.get("path", "/")
    try:
        encoded = path.encode("utf-8")
    except UnicodeEncodeError:
        raise Refused(400, "the path is not UTF-8") from None
    if len(encoded) > MAX_PATH:
        raise Refused(414, f"a stream's path is at most {MAX_PATH} bytes")
    if _CONTROL.search(path):
        raise Refused(400, "the path holds control characters")
    query: dict[str, list[str]] = {}
    try:
        for name, value in parse_qsl(raw_query.decode("latin-1"), keep_blank_values=True, errors="strict",
                                     max_num_fields=32):
            query.setdefault(name, []).append(value)
    except (UnicodeDecodeError, ValueError):
        raise Refused(400, "the query string is malformed") from None
    if headers is None:
        headers = headers_of(scope)
    scheme = "https" if scope.get("scheme") == "https" else "http"
    return Request(scope.get("method", "GET").upper(), path, query, headers, scheme)


async def read_body(receive: Receive, headers: dict[str, str], limit: int) -> bytes:
    """The whole body, refused (413) past ``limit`` bytes before more is read; a client that leaves
    mid-body gets nothing written."""
    declared = headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise Refused(400, "Content-Length is not a number")
        if int(declared) > limit:
            raise Refused(413, f"the body is over {limit} bytes: split it into several appends")
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Refused(400, "the client left before its body was read")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise Refused(413, f"the body is over {limit} bytes: split it into several appends")
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


async def answer(send: Send, status: int, headers: dict[str, str], body: bytes = b"") -> None:
    head = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    if status not in (204, 304):
        head.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body if status not in (204, 304) else b""})


async def refusal(send: Send, refused: Refused) -> None:
    """A refusal as plain text, with its headers."""
    await answer(send, refused.status, {"content-type": "text/plain; charset=utf-8", **refused.headers},
                 (refused.message + "\n").encode())


def sse_event(kind: str, text: str) -> bytes:
    """One event; every line of ``text`` its own ``data:`` line (so no line break in it ends the event)."""
    lines = _LINES.split(text)
    return (f"event: {kind}\n" + "".join(f"data:{line}\n" for line in lines) + "\n").encode()


def sse_data(data: bytes, mode: str) -> bytes:
    """A data event's payload: JSON text, UTF-8 text, or base64 for any other type."""
    if mode == "base64":
        return sse_event("data", base64.b64encode(data).decode("ascii"))
    return sse_event("data", data.decode("utf-8", "replace"))


def sse_control(fields: dict[str, object]) -> bytes:
    return sse_event("control", json.dumps(fields, separators=(",", ":")))


async def until_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    """Cancel ``scope`` when the client goes (a live answer must not outlive its reader)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return
