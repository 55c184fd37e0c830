"""The Durable Streams server as an ASGI application: the guard, then a workflow's stream or a free one.

The guard reuses the dashboard's rules (``dashboard/access.py``): the Host header first (DNS
rebinding), then the token as ``Authorization: Bearer`` (compared in constant time, wrong ones bounded
per client address). There are no cookies here, so no session and no CSRF: a script or the TypeScript
client sends the header itself. Browsers on other origins are let in only when named (``cors``): a page
anywhere on the web could otherwise read a loopback server's streams, or append to them with a simple
POST. Every answer carries the protocol's browser headers (nosniff, Cross-Origin-Resource-Policy,
``Cache-Control: no-store``: the data may be anyone's), and live answers are bounded per process.
Any error that escapes a handler is logged and answered 500 without detail; every malformed input is
a 4xx before it reaches the database.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from urllib.parse import urlsplit

from ..app import App
from ..dashboard.access import Access, Hosts, client_of
from .free import FreeStreamsHttp
from .http import Message, Receive, Scope, Send, answer, headers_of, refusal, request_of
from .protocol import Refused
from .workflows import PREFIX, WorkflowStreamsHttp

log = logging.getLogger("pgflow.durable_streams")

LONG_POLL = 20.0  # seconds a long-poll waits for data before a 204
MAX_BODY = 4 * 1024 * 1024  # bytes of one append
MAX_LIVE = 1000  # long-polls and SSE answers open at once in one process
BASE_HEADERS = {"x-content-type-options": "nosniff", "cross-origin-resource-policy": "cross-origin",
                "cache-control": "no-store"}
REQUEST_HEADERS = ("content-type, authorization, if-none-match, stream-seq, stream-ttl, stream-expires-at,"
                   " stream-closed, producer-id, producer-epoch, producer-seq, stream-forked-from,"
                   " stream-fork-offset, stream-fork-sub-offset")
HOSTS_REMEMBERED = 64  # Host headers whose verdict is remembered
EXPOSED_HEADERS = ("stream-next-offset, stream-cursor, stream-up-to-date, stream-closed, stream-ttl,"
                   " stream-expires-at, stream-sse-data-encoding, producer-epoch, producer-seq,"
                   " producer-expected-seq, producer-received-seq, etag, content-type, location")
_BASE = [(k.encode(), v.encode()) for k, v in BASE_HEADERS.items()]
_EXPOSED = EXPOSED_HEADERS.encode()


class StreamsApp:
    """The ASGI application (see the module's docstring)."""

    def __init__(self, app: App, *, token: str | None = None, allowed_hosts: Iterable[str] = (),
                 bind: str | None = None, cors: Iterable[str] = (), long_poll: float = LONG_POLL,
                 max_body: int = MAX_BODY, max_live: int = MAX_LIVE) -> None:
        if not (math.isfinite(long_poll) and 0 < long_poll <= 300):
            raise ValueError(f"long_poll is seconds, more than 0 and at most 300, got {long_poll!r}")
        self.access = Access(token)
        self.hosts = Hosts(list(allowed_hosts), bind)
        self.cors = frozenset(o.rstrip("/") for o in cors)
        self.free = FreeStreamsHttp(app, long_poll, max_body)
        self.workflows = WorkflowStreamsHttp(app, long_poll)
        self.max_live = max_live
        self.live = 0
        self._hosts_seen: dict[str, tuple[int, str] | None] = {}

    def _origin_ok(self, origin: str | None, host: str | None) -> bool:
        """No Origin (not a browser's cross-origin request), this server's own, or one named in ``cors``."""
        if origin is None or "*" in self.cors or origin.rstrip("/") in self.cors:
            return True
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and bool(parts.netloc) and parts.netloc == host

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        started = False

        async def send_headers(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                extra = _BASE
                if cors_origin is not None:
                    extra = extra + [(b"access-control-allow-origin", cors_origin.encode()),
                                     (b"access-control-expose-headers", _EXPOSED), (b"vary", b"origin")]
                given = list(message.get("headers", []))
                names = {k.lower() for k, _ in given}
                message["headers"] = given + [(k, v) for k, v in extra if k not in names]
            await send(message)

        cors_origin: str | None = None
        try:
            headers = headers_of(scope)
            refused = self._host_refusal(headers.get("host"))
            if refused is not None:
                raise Refused(*refused)
            origin = headers.get("origin")
            if not self._origin_ok(origin, headers.get("host")):
                raise Refused(403, "requests from this origin are not allowed: start the server with"
                                   " --cors-origin naming it")
            if origin is not None:
                cors_origin = "*" if "*" in self.cors and self.access.token is None else origin
            if scope.get("method") == "OPTIONS":
                await answer(send_headers, 204, {
                    "access-control-allow-methods": "GET, HEAD, POST, PUT, DELETE, OPTIONS",
                    "access-control-allow-headers": REQUEST_HEADERS, "access-control-max-age": "600"})
                return
            self._check_token(scope, headers)
            request = request_of(scope, headers)
            live = request.method == "GET" and any(v in ("long-poll", "sse") for v in request.query.get("live", []))
            if live and self.live >= self.max_live:
                raise Refused(503, f"this server holds {self.max_live} live reads at most: try again later",
                              {"retry-after": "5"})
            self.live += live
            try:
                handler = self.workflows if request.path.startswith(PREFIX) else self.free
                await handler.handle(request, receive, send_headers)
            finally:
                self.live -= live
        except Refused as exc:
            if not started:
                await refusal(send_headers, exc)
        except Exception:
            log.exception("durable streams: %s %s failed", scope.get("method"), scope.get("path"))
            if not started:
                await refusal(send_headers, Refused(500, "the server failed to answer: see its log"))

    def _host_refusal(self, host: str | None) -> tuple[int, str] | None:
        """``Hosts.refusal``, remembered for the few Host headers a server sees (it parses addresses)."""
        if host in self._hosts_seen:
            return self._hosts_seen[host]
        found = self.hosts.refusal(host)
        if host is not None and len(host) <= 255 and len(self._hosts_seen) < HOSTS_REMEMBERED:
            self._hosts_seen[host] = found
        return found

    def _check_token(self, scope: Scope, headers: dict[str, str]) -> None:
        if self.access.token is None:
            return
        credential = self.access.bearer(headers)
        client = client_of(scope)
        wait = self.access.attempts.blocked(client)
        if wait > 0:
            raise Refused(429, "too many wrong tokens from this address: try again later",
                          {"retry-after": str(math.ceil(wait))})
        if credential is not None and self.access.login(credential):
            return
        if credential is not None:
            self.access.attempts.failed(client)
        raise Refused(401, "this server asks for its token: send Authorization: Bearer <token>",
                      {"www-authenticate": 'Bearer realm="pgflow streams"'})


def asgi_app(app: App, *, token: str | None = None, allowed_hosts: Iterable[str] = (), bind: str | None = None,
             cors: Iterable[str] = (), long_poll: float = LONG_POLL, max_body: int = MAX_BODY,
             max_live: int = MAX_LIVE) -> StreamsApp:
    """The Durable Streams server over ``app``'s database, as an ASGI application to mount in Starlette
    or FastAPI (or serve with uvicorn): ``/workflows/{workflow_id}/{key}`` reads a workflow's stream,
    every other path is a free-standing stream. With no ``token`` it answers loopback clients only, as
    ``pgflow streams serve`` does; ``allowed_hosts`` names more Host headers, ``cors`` the browser origins
    let in (``"*"`` for any)."""
    return StreamsApp(app, token=token, allowed_hosts=allowed_hosts, bind=bind, cors=cors, long_poll=long_poll,
                      max_body=max_body, max_live=max_live)


__all__ = ["StreamsApp", "asgi_app"]
