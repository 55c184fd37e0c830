"""The dashboard's HTTP server: Starlette routes over ``data.Reader``, served by uvicorn.

Every request is hostile until shown otherwise: parameters are checked before any statement is
sent (a bad one is a 400 saying what is expected), ids are what ``app.handle`` accepts, a POST is
bounded and must come from this server's own page (``access``), and the actions are off unless the
dashboard was started with them on, and never on without a token. Before any route, ``access.Guard``
checks the Host header, the token and the bound on live connections.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

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
from ..app import App
from ..errors import CannotResume, UnknownWorkflow
from .access import (
    CSRF_COOKIE,
    MAX_LIVE,
    SESSION_COOKIE,
    SESSION_HOURS,
    WILDCARDS,
    Access,
    Guard,
    Hosts,
    Receive,
    Scope,
    Send,
    client_of,
    cookie_header,
    is_loopback,
    same_origin,
)
from .data import OVERVIEW_EVERY, TAIL, WATCH_EVERY, Reader, Value
from .markup import path
from .pages import (
    ENDED,
    STATUSES,
    confirm_page,
    list_page,
    login_page,
    logout_page,
    message_page,
    overview_page,
    overview_parts,
    parse_time,
    stream_text,
    workflow_page,
    workflow_state,
)

STATIC = Path(__file__).with_name("static")
MAX_BODY = 16 * 1024  # bytes of a POST: a form of a few fields
PAGE_SIZE, MAX_PAGE = 50, 500
SCAN = 5_000  # index entries one page of the list reads at most
TAILS = 10  # streams whose last chunks a workflow's page reads for itself
SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
FAR_FUTURE = datetime(9999, 1, 1, tzinfo=UTC)


class Dashboard:
    """The routes of one dashboard, over one App."""

    def __init__(self, app: App, access: Access, allow_actions: bool) -> None:
        self.app = app
        self.access = access
        self.allow_actions = allow_actions
        self.reader = Reader(app)

    # -- parameters --------------------------------------------------------------------------------------

    @staticmethod
    def _text(request: Request, name: str, limit: int, required: bool = False) -> str | None:
        values = request.query_params.getlist(name)
        if len(values) > 1:
            raise HTTPException(400, f"{name} is given once")
        value = values[0] if values else ""
        if not value:
            if required:
                raise HTTPException(400, f"{name} is required")
            return None
        try:
            return check_text(value, name, limit)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None

    def _id(self, request: Request) -> str:
        value = self._text(request, "id", MAX_ID_BYTES, required=True)
        assert value is not None
        return value

    def csrf(self, request: Request) -> str:
        return self.access.csrf_token(request.scope.get("pgflow.csrf_cookie") or "")

    async def _form(self, request: Request) -> dict[str, str]:
        """A POSTed form from this server's own page: bounded, urlencoded, each field once."""
        if not same_origin({k.lower(): v for k, v in request.headers.items()}):
            raise HTTPException(403, "a request from another site's page")
        if request.headers.get("content-type", "").partition(";")[0].strip().lower() != \
                "application/x-www-form-urlencoded":
            raise HTTPException(415, "send a form (application/x-www-form-urlencoded)")
        declared = request.headers.get("content-length")
        if declared is not None and (len(declared) > 9 or not declared.isdigit() or int(declared) > MAX_BODY):
            raise HTTPException(413, f"a form is at most {MAX_BODY} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY:
                raise HTTPException(413, f"a form is at most {MAX_BODY} bytes")
        try:
            fields = parse_qs(body.decode("utf-8"), keep_blank_values=True, strict_parsing=False, max_num_fields=10)
        except (UnicodeDecodeError, ValueError):
            raise HTTPException(400, "not a form") from None
        if any(len(v) > 1 for v in fields.values()):
            raise HTTPException(400, "each field is given once")
        return {k: v[0] for k, v in fields.items()}

    def _checked_post(self, request: Request, form: dict[str, str]) -> None:
        if not self.access.csrf_ok(request.scope.get("pgflow.cookies", {}).get(CSRF_COOKIE), form.get("csrf", "")):
            raise HTTPException(403, "the form's CSRF token does not match this browser's: reload the page and try"
                                     " again")

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

    # -- actions -----------------------------------------------------------------------------------------

    def _actions_on(self) -> None:
        if not self.allow_actions:
            raise HTTPException(403, "actions are off: start the dashboard with --allow-actions")

    async def confirm(self, request: Request) -> Response:
        self._actions_on()
        workflow_id = self._id(request)
        action = self._text(request, "action", 10, required=True)
        if action not in ("cancel", "resume", "fork"):
            raise HTTPException(400, "action is cancel, resume or fork")
        detail = await self.reader.workflow(workflow_id)
        if detail is None:
            raise HTTPException(404, f"no workflow with id {workflow_id!r}")
        steps = detail.steps[-1].position + 1 if detail.steps else 0
        return HTMLResponse(confirm_page(workflow_id, action, self.csrf(request), steps, None))

    async def act(self, request: Request) -> Response:
        self._actions_on()
        form = await self._form(request)
        self._checked_post(request, form)
        action = form.get("action")
        try:
            handle = self.app.handle(form.get("id", ""))
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        try:
            if action == "cancel":
                await handle.cancel_async()
            elif action == "resume":
                await handle.resume_async()
            elif action == "fork":
                step = form.get("from_step", "")
                if not (step.isascii() and step.isdigit() and len(step) <= 10 and int(step) < POSITION_LIMIT):
                    raise HTTPException(400, "from_step is a journal position, a number from 0")
                handle = await handle.fork_async(int(step))
            else:
                raise HTTPException(400, "action is cancel, resume or fork")
        except UnknownWorkflow:
            raise HTTPException(404, f"no workflow with id {handle.id!r}") from None
        except CannotResume as exc:
            raise HTTPException(409, str(exc)) from None
        return RedirectResponse(path("workflow", id=handle.id), status_code=303)

    async def queue_act(self, request: Request) -> Response:
        """Pause or resume a queue (the overview's buttons)."""
        self._actions_on()
        form = await self._form(request)
        self._checked_post(request, form)
        action, queue = form.get("action"), form.get("queue", "")
        if action not in ("pause", "resume"):
            raise HTTPException(400, "action is pause or resume")
        try:
            if action == "pause":
                await self.app.pause_queue_async(queue)
            else:
                await self.app.resume_queue_async(queue)
        except (ValueError, TypeError) as exc:
            raise HTTPException(400, str(exc)) from None
        self.reader.changed()
        return RedirectResponse("/", status_code=303)

    # -- access ------------------------------------------------------------------------------------------

    async def login(self, request: Request) -> Response:
        """The sign-in form; a right token starts a session of its own (a random id this process
        keeps, with its expiry), a wrong one counts against the client's address."""
        if self.access.token is None:
            return RedirectResponse("/", status_code=303)
        if request.method == "GET":
            return HTMLResponse(login_page(None, self.csrf(request)))
        form = await self._form(request)
        self._checked_post(request, form)
        client = client_of(request.scope)
        wait = self.access.attempts.blocked(client)
        if wait > 0:
            raise HTTPException(429, "too many wrong tokens from this address: try again in a minute",
                                headers={"Retry-After": str(int(wait) + 1)})
        if not self.access.login(form.get("token", "")):
            self.access.attempts.failed(client)
            return HTMLResponse(login_page("That is not the token.", self.csrf(request)), status_code=401)
        self.access.end_session(request.scope.get("pgflow.cookies", {}).get(SESSION_COOKIE))
        response = RedirectResponse("/", status_code=303)
        response.headers.append("set-cookie", cookie_header(
            SESSION_COOKIE, self.access.start_session(), request.url.scheme == "https",
            int(self.access.session_seconds)).decode())
        return response

    async def logout(self, request: Request) -> Response:
        """Ends this browser's session here, on the server: the cookie, wherever it was copied, no
        longer signs anyone in. (GET shows the button: a sign-out is a POST with this page's CSRF.)"""
        if request.method == "GET":
            return HTMLResponse(logout_page(self.csrf(request)))
        form = await self._form(request)
        self._checked_post(request, form)
        self.access.end_session(request.scope.get("pgflow.cookies", {}).get(SESSION_COOKIE))
        response = RedirectResponse("/login", status_code=303)
        response.headers.append("set-cookie", cookie_header(SESSION_COOKIE, "", request.url.scheme == "https", 0)
                                .decode())
        return response

    async def refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The answer to a request without the token: the login form for a page, a bare 401 else."""
        request = Request(scope, receive)
        headers = {"WWW-Authenticate": 'Bearer realm="pgflow dashboard"'}
        response: Response
        if request.method == "GET" and "text/html" in request.headers.get("accept", ""):
            csrf = self.access.csrf_token(scope.get("pgflow.csrf_cookie") or "")
            response = HTMLResponse(login_page(None, csrf), status_code=401, headers=headers)
        else:
            response = PlainTextResponse("this dashboard needs its token: Authorization: Bearer <token>, or sign in"
                                         " at /login", status_code=401, headers=headers)
        await response(scope, receive, send)


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
          allowed_hosts: Iterable[str] = (), session_hours: float = SESSION_HOURS) -> None:
    """Run the dashboard until SIGINT or SIGTERM."""
    import uvicorn

    allowed_hosts = list(allowed_hosts)
    asgi = create_app(app, token=token, allow_actions=allow_actions, allowed_hosts=allowed_hosts, bind=host,
                      session_hours=session_hours)
    bound = [] if is_loopback(host) else ["any IP address"] if host in WILDCARDS else [host]
    answers = ["loopback names", *bound, *allowed_hosts]
    print(f"pgflow dashboard on http://{host}:{port} (schema {app.schema!r}; actions "
          f"{'on' if allow_actions else 'off'}; {'token required' if token else 'no token'}; answers to"
          f" {', '.join(answers)})", flush=True)
    uvicorn.run(asgi, host=host, port=port, log_level="warning", timeout_graceful_shutdown=2, proxy_headers=True)
