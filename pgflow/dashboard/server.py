"""The dashboard's HTTP server: Starlette routes over ``data.Reader``, served by uvicorn.

Every request is hostile until shown otherwise: parameters are checked before any statement is
sent (a bad one is a 400 saying what is expected), ids are what ``app.handle`` accepts, a POST is
bounded and must come from this server's own page (``access``), and the actions are off unless the
dashboard was started with them on, and never on without a token. Before any route, ``access.Guard``
checks the Host header, the token and the bound on live connections.

This module has the routes that read and the application around them; the routes that change
things are in ``actions``, the sign-in routes in ``signin``, and what they all share (the checked
reading of a request) in ``routes``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from .._core.checks import MAX_ID_BYTES, MAX_KEY_BYTES, POSITION_LIMIT, check_text
from .._serving import serve_until_stopped
from ..app import App
from .access import MAX_LIVE, SESSION_HOURS, WILDCARDS, Access, Guard, Hosts, is_loopback
from .actions import Actions
from .data import OVERVIEW_EVERY, TAIL, WATCH_EVERY, Value
from .markup import path
from .overview import overview_page, overview_parts
from .pages import ENDED, STATUSES, list_page, message_page, parse_time, stream_text, workflow_page, workflow_state
from .signin import SignIn

STATIC = Path(__file__).with_name("static")
PAGE_SIZE, MAX_PAGE = 50, 500
SCAN = 5_000  # index entries one page of the list reads at most
TAILS = 10  # streams whose last chunks a workflow's page reads for itself
SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
FAR_FUTURE = datetime(9999, 1, 1, tzinfo=UTC)


class Dashboard(Actions, SignIn):
    """The routes of one dashboard, over one App: the pages that read here, the actions and the
    sign-in routes from their own modules."""

    # -- pages -------------------------------------------------------------------------------------------

    async def overview(self, request: Request) -> Response:
        return HTMLResponse(overview_page(await self.reader.overview(), self._action_csrf(request)))

    def _action_csrf(self, request: Request) -> str | None:
        """This browser's CSRF token for the overview's queue buttons; None when actions are off."""
        return self.csrf(request) if self.allow_actions else None

    async def live_overview(self, request: Request) -> Response:
        csrf = self._action_csrf(request)

        async def events() -> AsyncIterator[str]:
            yield "retry: 3000\n\n"
            while True:
                await anyio.sleep(OVERVIEW_EVERY)
                view = await self.reader.overview()
                yield f"event: overview\ndata: {json.dumps(str(overview_parts(view, csrf)))}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

    async def workflows(self, request: Request) -> Response:
        allowed = {"status", "name", "queue", "since", "before", "cursor", "limit"}
        unknown = set(request.query_params) - allowed
        if unknown:
            raise HTTPException(400, f"unknown parameter {sorted(unknown)[0][:40]!r}: use {', '.join(sorted(allowed))}")
        query = {k: v for k in allowed if (v := self._text(request, k, MAX_ID_BYTES)) is not None}
        filters: dict[str, str] = {k: query[k] for k in ("status", "name", "queue") if k in query}
        if "status" in filters and filters["status"] not in STATUSES:
            raise HTTPException(400, f"status is one of {', '.join(STATUSES)}")
        now = datetime.now(UTC)
        try:
            since = parse_time(query["since"], now) if "since" in query else None
            before = parse_time(query["before"], now) if "before" in query else FAR_FUTURE
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        limit = PAGE_SIZE
        if "limit" in query:
            text = query["limit"]
            if not (text.isascii() and text.isdigit() and len(text) <= 4 and 1 <= int(text) <= MAX_PAGE):
                raise HTTPException(400, f"limit is a number from 1 to {MAX_PAGE}")
            limit = int(text)
        cursor = (before, "")
        if "cursor" in query:
            cursor = _cursor(query["cursor"])
        result = await self.reader.list_page(filters, since, cursor, limit, SCAN)
        kept = {k: v for k, v in query.items() if k != "cursor"}
        next_href = path("workflows", **kept, cursor=_cursor_text(result.next_cursor)) if result.next_cursor else None
        first_href = path("workflows", **kept) if "cursor" in query else None
        return HTMLResponse(list_page(result, query, next_href, first_href))

    async def find(self, request: Request) -> Response:
        workflow_id = self._id(request).strip()
        if await self.reader.fingerprint(workflow_id) is None:
            raise HTTPException(404, f"no workflow with id {workflow_id!r}")
        return RedirectResponse(path("workflow", id=workflow_id), status_code=303)

    async def workflow(self, request: Request) -> Response:
        workflow_id = self._id(request)
        detail = await self.reader.workflow(workflow_id)
        if detail is None:
            raise HTTPException(404, f"no workflow with id {workflow_id!r}")
        tails = {s.key: await self.reader.tail(s.stream_id, max(0, s.length - TAIL)) for s in detail.streams[:TAILS]}
        return HTMLResponse(workflow_page(detail, tails, actions=self.allow_actions))

    async def live_workflow(self, request: Request) -> Response:
        """The parts of a workflow's page that change, sent again whenever they do (looked at every
        WATCH_EVERY seconds, shared by every page on that workflow)."""
        workflow_id = self._id(request)
        seen = await self.reader.fingerprint(workflow_id)
        if seen is None:
            raise HTTPException(404, f"no workflow with id {workflow_id!r}")

        async def events() -> AsyncIterator[str]:
            nonlocal seen
            yield "retry: 3000\n\n"
            # The page was rendered before this connection opened: a workflow still under way may
            # have moved on since, so its state goes out at once; an ended one changes only by a resume.
            send = seen[0] not in ENDED
            while True:
                if send:
                    detail = await self.reader.workflow(workflow_id)
                    if detail is None:
                        yield "event: gone\ndata: {}\n\n"
                        return
                    data = {"html": str(workflow_state(detail, self.allow_actions)), "status": detail.record["status"],
                            "streams": [s.key for s in detail.streams]}
                    yield f"event: state\ndata: {json.dumps(data)}\n\n"
                await anyio.sleep(WATCH_EVERY)
                now = await self.reader.fingerprint(workflow_id)
                if now is None:
                    yield "event: gone\ndata: {}\n\n"
                    return
                send, seen = now != seen, now

        return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

    async def live_stream(self, request: Request) -> Response:
        """A stream as SSE, each event's id its position: a reconnecting EventSource sends the last
        one it had as Last-Event-ID, and the stream resumes after it."""
        workflow_id = self._id(request)
        key = self._text(request, "key", MAX_KEY_BYTES, required=True)
        assert key is not None
        offset = _position(request.headers.get("last-event-id"), "Last-Event-ID", after=True)
        if offset is None:
            offset = _position(self._text(request, "from", 12), "from", after=False) or 0
        if await self.reader.fingerprint(workflow_id) is None:
            raise HTTPException(404, f"no workflow with id {workflow_id!r}")
        handle = self.app.handle(workflow_id)

        async def events() -> AsyncIterator[str]:
            yield "retry: 1000\n\n"
            async for position, value in handle.stream_items_async(key, offset):
                text = stream_text(Value(None, True, value))
                yield f"id: {position}\ndata: {json.dumps(text[:20_000])}\n\n"
            yield "event: end\ndata: {}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

    async def cost(self, request: Request) -> Response:
        """What this dashboard has asked of the database since it started: its own statements and
        the stream reads of its live pages (benchmarks/dashboard_load.py reads this)."""
        import time

        seconds = max(1e-9, time.monotonic() - self.reader.started)
        fetches = self.app.stats().fetch_queries
        return JSONResponse({"uptime_s": seconds, "statements": self.reader.statements, "stream_fetches": fetches,
                             "per_s": (self.reader.statements + fetches) / seconds})

def _cursor(text: str) -> tuple[datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(text.encode("ascii") + b"=" * (-len(text) % 4)).decode("utf-8")
        at, _, after = raw.partition("|")
        when = datetime.fromisoformat(at)
        if when.tzinfo is None or not after:
            raise ValueError(at)
        check_text(after, "cursor", MAX_ID_BYTES)
        return when, after
    except (ValueError, UnicodeError):
        raise HTTPException(400, "cursor is not one this dashboard made: follow the page's links") from None


def _cursor_text(cursor: tuple[datetime, str]) -> str:
    return base64.urlsafe_b64encode(f"{cursor[0].isoformat()}|{cursor[1]}".encode()).decode("ascii").rstrip("=")


def _position(text: str | None, what: str, after: bool) -> int | None:
    """A stream position from a header or parameter (ASCII digits only: "²" passes isdigit());
    ``after``: the position after it (Last-Event-ID is the last one the client has)."""
    if not text:
        return None
    if not (text.isascii() and text.isdigit() and len(text) <= 10 and int(text) < POSITION_LIMIT - 1):
        raise HTTPException(400, f"{what} is a stream position")
    return int(text) + 1 if after else int(text)


def create_app(app: App, *, token: str | None = None, allow_actions: bool = False,
               allowed_hosts: Iterable[str] = (), bind: str | None = None, session_hours: float = SESSION_HOURS,
               max_live: int = MAX_LIVE) -> Any:
    """The dashboard as an ASGI application over ``app``, which it does not close (its runtime on the
    server's loop closes with that loop; an App that also runs a worker there goes on with it).

    It answers to loopback names, to ``allowed_hosts`` and to ``bind`` (the address it is served on,
    when not loopback); ``allow_actions`` needs a ``token``, since an action changes what workers do;
    a session lasts ``session_hours``; at most ``max_live`` live answers are open at once.
    ValueError for any of these that cannot be."""
    if allow_actions and token is None:
        raise ValueError("actions need a token: give one with PGFLOW_DASHBOARD_TOKEN or --token-file PATH")
    if max_live < 1:
        raise ValueError(f"max_live is at least 1, got {max_live}")
    access = Access(token, session_hours)
    hosts = Hosts(allowed_hosts, bind)
    dashboard = Dashboard(app, access, allow_actions)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if "text/html" in request.headers.get("accept", ""):
            return HTMLResponse(message_page(f"{exc.status_code}", str(exc.detail), back="/"),
                                status_code=exc.status_code, headers=exc.headers)
        return PlainTextResponse(str(exc.detail), status_code=exc.status_code, headers=exc.headers)

    routes = [
        Route("/", dashboard.overview),
        Route("/live/overview", dashboard.live_overview),
        Route("/workflows", dashboard.workflows),
        Route("/find", dashboard.find),
        Route("/cost", dashboard.cost),
        Route("/workflow", dashboard.workflow),
        Route("/live/workflow", dashboard.live_workflow),
        Route("/live/stream", dashboard.live_stream),
        Route("/confirm", dashboard.confirm),
        Route("/action", dashboard.act, methods=["POST"]),
        Route("/queue-action", dashboard.queue_act, methods=["POST"]),
        Route("/login", dashboard.login, methods=["GET", "POST"]),
        Route("/logout", dashboard.logout, methods=["GET", "POST"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    server = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    server.state.dashboard = dashboard
    return Guard(server, access, hosts, dashboard.refuse, max_live)


def serve(app: App, host: str, port: int, token: str | None, allow_actions: bool,
          allowed_hosts: Iterable[str] = (), session_hours: float = SESSION_HOURS) -> bool:
    """Run the dashboard until SIGINT or SIGTERM; False when it did not start."""
    allowed_hosts = list(allowed_hosts)
    asgi = create_app(app, token=token, allow_actions=allow_actions, allowed_hosts=allowed_hosts, bind=host,
                      session_hours=session_hours)
    bound = [] if is_loopback(host) else ["any IP address"] if host in WILDCARDS else [host]
    answers = ["loopback names", *bound, *allowed_hosts]
    print(f"pgflow dashboard on http://{host}:{port} (schema {app.schema!r}; actions "
          f"{'on' if allow_actions else 'off'}; {'token required' if token else 'no token'}; answers to"
          f" {', '.join(answers)})", flush=True)
    return serve_until_stopped(asgi, host, port)
