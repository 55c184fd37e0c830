"""The dashboard over real HTTP: a uvicorn server on a thread of its own (with an in-process worker on
its loop) against the test's schema, and requests a browser, a script or an attacker's page can send.
Every hostile request gets a 4xx that changes nothing, never a 500; every value from the database
comes out escaped."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import re
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import psycopg
import pytest

import pgflow
from pgflow.dashboard.access import CSRF_COOKIE, SESSION_COOKIE

from .apps.dashboard import define
from .helpers import ONE_SERVER

pytestmark = pytest.mark.slow

TOKEN = "correct-horse-battery-staple-42"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HOSTILE = '<script>alert("x")</script><img src=x onerror=alert(1)>'
WAIT = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Served:
    """``create_app`` served by uvicorn on a thread with its own event loop, its own App on the test's
    schema, and (``worker``) an in-process worker on that loop running tests/apps/dashboard.py;
    ``options`` go to ``create_app`` as they are."""

    def __init__(self, dsn: str, schema: str, *, token: str | None = None, actions: bool = False,
                 worker: bool = True, **options: Any) -> None:
        self.dsn, self.schema, self.token, self.actions, self.worker = dsn, schema, token, actions, worker
        self.options = options
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.ready = threading.Event()
        self.failure: BaseException | None = None
        self.server: Any = None
        self.dashboard: Any = None
        self.guard: Any = None
        self.thread = threading.Thread(target=self._run, name="dashboard-under-test", daemon=True)
        self.thread.start()
        if not self.ready.wait(WAIT) or self.failure is not None:
            raise RuntimeError(f"the dashboard did not start: {self.failure!r}")

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - handed to the test, which fails with it
            self.failure = exc
            self.ready.set()

    async def _main(self) -> None:
        import uvicorn

        from pgflow.dashboard.server import create_app

        app = pgflow.App(self.dsn, schema=self.schema, poll_interval=0.5)
        define(app)
        asgi = create_app(app, token=self.token, allow_actions=self.actions, **self.options)
        self.guard = asgi
        self.dashboard = asgi.app.state.dashboard
        self.server = uvicorn.Server(uvicorn.Config(asgi, host="127.0.0.1", port=self.port, log_level="warning",
                                                    timeout_graceful_shutdown=1))
        try:
            async with app.worker(concurrency=8, lease=2.0) if self.worker else _nothing():
                serving = asyncio.create_task(self.server.serve())
                while not self.server.started:
                    if serving.done():
                        serving.result()
                        raise RuntimeError("uvicorn stopped before it started")
                    await asyncio.sleep(0.02)
                self.ready.set()
                await serving
        finally:
            await app.close_async()

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        self.thread.join(WAIT)
        assert not self.thread.is_alive(), "the dashboard's thread did not stop"


@contextlib.asynccontextmanager
async def _nothing() -> AsyncIterator[None]:
    yield


@pytest.fixture
def serve(dsn: str, schema: str, app: pgflow.App) -> Iterator[Any]:
    yield from serving(dsn, schema, app)


@pytest.fixture(scope="module")
def refusing(server: tuple[str, Any]) -> Iterator[Served]:
    """One dashboard without a worker, on a schema of its own, for every bad parameter of this module: each
    is refused and changes nothing, so each meets the state a dashboard of its own would have."""
    dsn, schema = server[0], f"t_{uuid.uuid4().hex[:12]}"
    try:
        with pgflow.App(dsn, schema=schema) as app:
            app.migrate()
        served = Served(dsn, schema, worker=False)
        try:
            yield served
        finally:
            served.stop()
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def serving(dsn: str, schema: str, app: pgflow.App) -> Iterator[Any]:
    """The ``serve`` fixture's body (tests/test_dashboard_trust.py has one of its own): ``start(**options)``
    starts a ``Served``; each is stopped at the end."""
    app.migrate()
    started: list[Served] = []

    def start(**options: Any) -> Served:
        served = Served(dsn, schema, **options)
        started.append(served)
        return served

    try:
        yield start
    finally:
        for served in started:
            served.stop()


class Answer:
    def __init__(self, status: int, headers: http.client.HTTPMessage, body: str) -> None:
        self.status, self.headers, self.body = status, headers, body

    def cookies(self) -> dict[str, str]:
        found = {}
        for header in self.headers.get_all("set-cookie") or []:
            name, _, rest = header.partition("=")
            found[name] = rest.split(";", 1)[0]
        return found


def call(base: str, method: str, target: str, headers: dict[str, str] | None = None,
         body: bytes | None = None) -> Answer:
    """One request, redirects not followed, the whole answer read."""
    url = urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=WAIT)
    try:
        conn.request(method, target, body=body, headers=headers or {})
        response = conn.getresponse()
        return Answer(response.status, response.headers, response.read().decode("utf-8", "replace"))
    finally:
        conn.close()


def page(base: str, target: str, **headers: str) -> Answer:
    return call(base, "GET", target, {"Accept": "text/html", **headers})


def form(base: str, target: str, fields: dict[str, str], cookies: dict[str, str] | None = None,
         **headers: str) -> Answer:
    body = "&".join(f"{quote(k)}={quote(v)}" for k, v in fields.items()).encode()
    sent = {"Content-Type": "application/x-www-form-urlencoded", **headers}
    if cookies:
        sent["Cookie"] = "; ".join(f"{k}={v}" for k, v in cookies.items())
    return call(base, "POST", target, sent, body)


def csrf_of(answer: Answer) -> str:
    match = re.search(r'name="csrf" value="([0-9a-f]+)"', answer.body)
    assert match, answer.body
    return match[1]


def wait_for(condition: Any, what: str, timeout: float = WAIT) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def events(base: str, target: str, headers: dict[str, str] | None = None, stop_after: int | None = None,
           until: str = "end") -> list[tuple[str, str, str]]:
    """An SSE response read as (event, id, data) until an event named ``until`` or ``stop_after`` events."""
    url = urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=WAIT)
    got: list[tuple[str, str, str]] = []
    try:
        conn.request("GET", target, headers=headers or {})
        response = conn.getresponse()
        assert response.status == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        fields: dict[str, str] = {}
        while True:
            line = response.readline().decode()
            if not line:
                return got
            line = line.rstrip("\n")
            if line:
                name, _, value = line.partition(": ")
                fields[name] = value
                continue
            if "data" in fields:
                got.append((fields.get("event", "message"), fields.get("id", ""), fields["data"]))
                if got[-1][0] == until or (stop_after is not None and len(got) >= stop_after):
                    return got
            fields = {}
    finally:
        conn.close()


def only_own_script(body: str) -> None:
    """No markup from the database: the one script tag is the dashboard's own file."""
    assert re.findall(r"<script[^>]*>", body) == ['<script src="/static/dashboard.js" defer>'], body
    assert "<img" not in body and "onerror=alert" not in body.replace("onerror=alert(1)&gt;", "")


# -- what the pages show, escaped --------------------------------------------------------------------------


def test_pages_show_records_errors_and_escape_every_stored_text(serve: Any, app: pgflow.App) -> None:
    served = serve(token=TOKEN, actions=True)
    failed = app.start_by_name("dash.fails", HOSTILE)
    with pytest.raises(pgflow.WorkflowFailed):
        failed.result(timeout=WAIT)
    hostile_id = app.start_by_name("dash.child", 3, id=f"id{HOSTILE}").id
    assert app.handle(hostile_id).result(timeout=WAIT) == 9
    parent = app.start_by_name("dash.parent", 3)
    assert parent.result(timeout=WAIT) == 5
    unserved = app.start_by_name(f"name{HOSTILE}", HOSTILE)  # no worker runs that name: it stays queued

    home = page(served.base, "/", **AUTH)
    assert home.status == 200
    assert "default-src 'none'" in home.headers["content-security-policy"]
    assert home.headers["x-frame-options"] == "DENY"
    only_own_script(home.body)
    assert "name&lt;script&gt;" in home.body and "no live worker runs that name" in home.body  # health
    assert 'id="workers"' in home.body and "dash.writer" not in home.body

    listed = page(served.base, "/workflows", **AUTH)
    assert listed.status == 200
    only_own_script(listed.body)
    for workflow_id in (failed.id, parent.id, unserved.id):
        assert quote(workflow_id, safe="") in listed.body

    shown = page(served.base, f"/workflow?id={quote(failed.id)}", **AUTH)
    assert shown.status == 200
    only_own_script(shown.body)
    # The error: type, message (escaped) and the traceback of the step that raised.
    assert "<strong>ValueError</strong>: &lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in shown.body
    assert "Traceback (most recent call last)" in shown.body and "raise ValueError(message)" in shown.body
    assert "dash.write" in shown.body and "dash.explode" in shown.body  # the steps
    assert "line 1" in shown.body  # the stream's chunks, read for the page

    family = page(served.base, f"/workflow?id={quote(parent.id)}", **AUTH)
    assert family.status == 200
    for i in range(3):
        assert f"{parent.id}.{i}" in family.body
    assert "pgflow.set_event:children" in family.body and "pgflow.sleep" in family.body
    child = page(served.base, f"/workflow?id={quote(parent.id + '.0')}", **AUTH)
    assert quote(parent.id, safe="") in child.body  # its parent, linked
    assert "&quot;from&quot;: &quot;parent&quot;" in child.body  # the message it received

    retried = app.start_by_name("dash.retries")
    assert retried.result(timeout=WAIT) == 3
    steps = page(served.base, f"/workflow?id={quote(retried.id)}", **AUTH)
    # Each failed attempt's error, escaped, and the step's time from its first attempt's start.
    assert steps.body.count("ConnectionError</strong>: attempt ") == 2
    assert "attempt 1 &lt;lost&gt;" in steps.body and "attempt 2 &lt;lost&gt;" in steps.body
    assert "(since the previous entry)" not in steps.body.split('id="steps"')[1].split("</table>")[0]

    odd = page(served.base, f"/workflow?id={quote(hostile_id)}", **AUTH)
    assert odd.status == 200
    only_own_script(odd.body)
    assert page(served.base, f"/workflow?id={quote(unserved.id)}", **AUTH).status == 200
    found = call(served.base, "GET", f"/find?id={quote(failed.id)}", AUTH)
    assert found.status == 303 and found.headers["location"] == f"/workflow?id={quote(failed.id, safe='')}"


def test_the_list_pages_by_keyset_and_filters(serve: Any, app: pgflow.App) -> None:
    served = serve(worker=False)
    workflows = define(app)
    handles = workflows.child.start_many([(i,) for i in range(120)])  # one statement: one created_at for all
    app.start_by_name("dash.writer", 1, 0.0)
    ids: list[str] = []
    target: str | None = "/workflows?name=dash.child&limit=50"
    while target is not None:
        answer = page(served.base, target)
        assert answer.status == 200, answer.body
        ids += [m for m in re.findall(r'<a href="/workflow\?id=[^"]*" class="id">([^<]*)</a>', answer.body)]
        more = re.search(r'<a href="([^"]*)" rel="next">', answer.body)
        target = more[1].replace("&amp;", "&") if more else None
    # Ties on created_at are broken by id, newest first: every workflow once, in order.
    assert ids == sorted((h.id for h in handles), reverse=True)

    both = page(served.base, "/workflows?status=queued&name=dash.child&limit=500")
    assert both.body.count('class="id"') == 120
    none = page(served.base, "/workflows?status=failed&queue=default")
    assert "no workflow matches" in none.body
    recent = page(served.base, "/workflows?since=1h&name=dash.writer")
    assert recent.body.count('class="id"') == 1
    future = page(served.base, "/workflows?before=2000-01-01T00:00Z")
    assert "no workflow matches" in future.body


# -- live parts ------------------------------------------------------------------------------------------


def test_streams_resume_after_last_event_id_and_live_parts_send_state(serve: Any, app: pgflow.App) -> None:
    served = serve()
    handle = app.start_by_name("dash.writer", 30, 0.05)
    target = f"/live/stream?id={quote(handle.id)}&key=out"
    first = events(served.base, target, stop_after=5)
    assert [(e, i) for e, i, _ in first] == [("message", str(n)) for n in range(5)]
    assert [json.loads(d) for _, _, d in first] == [f"line {n}" for n in range(5)]
    rest = events(served.base, target, headers={"Last-Event-ID": "9"})
    assert [i for e, i, _ in rest if e == "message"] == [str(n) for n in range(10, 30)]
    assert rest[-1][0] == "end"
    assert events(served.base, target + "&from=28")[0][1] == "28"

    running = app.start_by_name("dash.runs_long", 30.0)
    wait_for(lambda: running.status() == "running", "the long one to run")
    state = events(served.base, f"/live/workflow?id={quote(running.id)}", stop_after=1)
    assert state[0][0] == "state"
    data = json.loads(state[0][2])
    assert data["status"] == "running" and 'id="record"' in data["html"] and 'id="steps"' in data["html"]
    running.cancel()
    overview = events(served.base, "/live/overview", stop_after=1)
    assert overview[0][0] == "overview" and 'id="queues"' in json.loads(overview[0][2])


# -- access ----------------------------------------------------------------------------------------------


@ONE_SERVER  # the token, the login form and its cookies are HTTP, the same on any server
def test_the_token_is_asked_of_every_request_but_the_login_form(serve: Any) -> None:
    served = serve(token=TOKEN, worker=False)
    base = served.base
    refused = page(base, "/")
    assert refused.status == 401 and 'name="token"' in refused.body and "Queues" not in refused.body
    assert call(base, "GET", "/").status == 401
    assert call(base, "GET", "/live/overview").status == 401
    assert call(base, "GET", "/workflows", {"Authorization": "Bearer wrong-token-of-some-length"}).status == 401
    assert call(base, "GET", "/workflows", {"Authorization": f"Basic {TOKEN}"}).status == 401
    assert call(base, "GET", "/workflows", {"Cookie": f"{SESSION_COOKIE}=forged"}).status == 401
    assert call(base, "GET", "/static/dashboard.css").status == 200
    assert call(base, "GET", "/workflows", {"Authorization": f"Bearer {TOKEN}"}).status == 200

    login = page(base, "/login")
    assert login.status == 200
    cookies = login.cookies()
    csrf = csrf_of(login)
    assert form(base, "/login", {"token": "not-it-but-long-enough", "csrf": csrf}, cookies).status == 401
    assert form(base, "/login", {"token": TOKEN, "csrf": "0" * 64}, cookies).status == 403
    assert form(base, "/login", {"token": TOKEN, "csrf": csrf}, cookies, Origin="https://evil.example").status == 403
    signed = form(base, "/login", {"token": TOKEN, "csrf": csrf}, cookies)
    assert signed.status == 303
    session = signed.cookies()[SESSION_COOKIE]
    assert session != TOKEN and TOKEN not in signed.headers["set-cookie"]
    assert {"HttpOnly", "SameSite=Strict", "Max-Age=43200"} <= set(signed.headers["set-cookie"].split("; "))
    assert page(base, "/", Cookie=f"{SESSION_COOKIE}={session}").status == 200


@ONE_SERVER  # a refusal over HTTP: the same on any server
def test_actions_are_off_unless_asked_for(serve: Any, app: pgflow.App) -> None:
    served = serve(actions=False, worker=False)
    handle = app.start_by_name("dash.child", 2)
    shown = page(served.base, f"/workflow?id={quote(handle.id)}")
    assert "Actions are off" in shown.body and "/confirm" not in shown.body
    assert page(served.base, f"/confirm?id={quote(handle.id)}&action=cancel").status == 403
    cookies = shown.cookies()
    answer = form(served.base, "/action", {"id": handle.id, "action": "cancel", "csrf": "x"}, cookies)
    assert answer.status == 403 and "--allow-actions" in answer.body
    assert handle.status() == "queued"


@ONE_SERVER  # the forms' checks are HTTP; cancel, resume and fork are the API's, tested on both servers
def test_actions_refuse_forgeries_then_cancel_resume_and_fork(serve: Any, app: pgflow.App, tmp_path: Path) -> None:
    served = serve(token=TOKEN, actions=True)
    base = served.base
    running = app.start_by_name("dash.runs_long", 120.0)
    wait_for(lambda: running.status() == "running", "the long one to run")
    confirm = page(base, f"/confirm?id={quote(running.id)}&action=cancel", **AUTH)
    assert confirm.status == 200 and "Yes, cancel" in confirm.body
    cookies, csrf = confirm.cookies(), csrf_of(confirm)
    good = {"id": running.id, "action": "cancel", "csrf": csrf}

    assert form(base, "/action", {**good, "csrf": ""}, cookies, **AUTH).status == 403
    assert form(base, "/action", {**good, "csrf": "f" * 64}, cookies, **AUTH).status == 403
    assert form(base, "/action", good, {CSRF_COOKIE: "another-browser"}, **AUTH).status == 403
    assert form(base, "/action", good, **AUTH).status == 403  # no cookie at all
    assert form(base, "/action", good, cookies, Origin="https://evil.example", **AUTH).status == 403
    assert form(base, "/action", good, cookies, Origin="null", **AUTH).status == 403
    assert form(base, "/action", good, cookies, **{"Sec-Fetch-Site": "cross-site"}, **AUTH).status == 403
    plain = {"Content-Type": "text/plain", "Cookie": f"{CSRF_COOKIE}={cookies[CSRF_COOKIE]}", **AUTH}
    text = call(base, "POST", "/action", plain, b"id=x&action=cancel")
    assert text.status == 415
    huge = form(base, "/action", {**good, "pad": "x" * 20_000}, cookies, **AUTH)
    assert huge.status == 413
    assert form(base, "/action", {**good, "id": "a\x00b"}, cookies, **AUTH).status == 400
    assert form(base, "/action", {**good, "id": "no-such-workflow"}, cookies, **AUTH).status == 404
    assert form(base, "/action", {**good, "action": "drop"}, cookies, **AUTH).status == 400
    assert form(base, "/action", {**good, "action": "fork", "from_step": "-1"}, cookies, **AUTH).status == 400
    assert running.status() == "running"  # nothing above changed anything

    cancelled = form(base, "/action", good, cookies, **AUTH)
    assert cancelled.status == 303 and cancelled.headers["location"] == f"/workflow?id={quote(running.id, safe='')}"
    with pytest.raises(pgflow.WorkflowCancelled):
        running.result(timeout=WAIT)

    marker = tmp_path / "ready"
    failing = app.start_by_name("dash.until_file", str(marker))
    with pytest.raises(pgflow.WorkflowFailed):
        failing.result(timeout=WAIT)
    shown = page(base, f"/workflow?id={quote(failing.id)}", Cookie=f"{CSRF_COOKIE}={cookies[CSRF_COOKIE]}",
                 **AUTH)
    assert "FileNotFoundError" in shown.body and 'id="action-resume"' in shown.body
    marker.write_text("ok")
    resumed = form(base, "/action", {"id": failing.id, "action": "resume", "csrf": csrf}, cookies, **AUTH)
    assert resumed.status == 303
    assert failing.result(timeout=WAIT) == "found"
    again = form(base, "/action", {"id": failing.id, "action": "resume", "csrf": csrf}, cookies, **AUTH)
    assert again.status == 409 and "succeeded" in again.body

    forked = form(base, "/action", {"id": failing.id, "action": "fork", "from_step": "1", "csrf": csrf}, cookies,
                  **AUTH)
    assert forked.status == 303
    fork_id = forked.headers["location"].split("id=", 1)[1]
    assert fork_id != quote(failing.id, safe="")
    assert app.handle(fork_id).result(timeout=WAIT) == "found"


# -- parameters ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("target", "status"), [
    ("/workflow", 400),
    ("/workflow?id=", 400),
    ("/workflow?id=a%00b", 400),
    ("/workflow?id=" + "x" * 1001, 400),
    ("/workflow?id=%ED%A0%80", 404),  # invalid UTF-8: decoded with replacement characters, no such id
    ("/workflow?id=a&id=b", 400),
    ("/workflow?id=no-such-workflow", 404),
    ("/find?id=no-such-workflow", 404),
    ("/workflows?status=bogus", 400),
    ("/workflows?limit=abc", 400),
    ("/workflows?limit=0", 400),
    ("/workflows?limit=100000", 400),
    ("/workflows?limit=%C2%B2", 400),  # "²": isdigit() but no int
    ("/workflows?cursor=garbage", 400),
    ("/workflows?cursor=" + "A" * 5000, 400),
    ("/workflows?since=yesterday", 400),
    ("/workflows?since=99999999999d", 400),  # further back than a timedelta goes
    ("/workflows?since=99999999d", 400),  # a timedelta, but before the year 1
    ("/workflows?since=2026-12-01T10:00", 400),  # no zone
    ("/workflows?before=99999-01-01T00:00Z", 400),
    ("/workflows?nosuch=1", 400),
    ("/workflows?name=" + "n" * 2000, 400),
    ("/live/stream?id=x", 400),
    ("/live/stream?id=x&key=" + "k" * 300, 400),
    ("/live/stream?id=no-such&key=out", 404),
    ("/live/stream?id=x&key=out&from=-1", 400),
    ("/live/workflow?id=no-such", 404),
    ("/confirm?id=x&action=cancel", 403),  # actions off
    ("/static/../access.py", 404),
    ("/nothing-here", 404),
])
@ONE_SERVER  # parameters checked over HTTP (the lookups of ids none has are the pages' own, on both servers)
def test_bad_parameters_are_refused_with_a_4xx(refusing: Served, target: str, status: int) -> None:
    answer = page(refusing.base, target)
    assert answer.status == status, answer.body
    if "<html" in answer.body:
        only_own_script(answer.body)


@ONE_SERVER  # the header is checked over HTTP, before any read: the same on any server
def test_bad_last_event_ids_are_refused(serve: Any, app: pgflow.App) -> None:
    served = serve(worker=False)
    handle = app.start_by_name("dash.writer", 1, 0.0)
    target = f"/live/stream?id={quote(handle.id)}&key=out"
    for last in ("²", "1_0", "-1", "9" * 11, "2147483647", "x"):
        answer = call(served.base, "GET", target, {"Last-Event-ID": last.encode().decode("latin-1")})
        assert answer.status == 400, (last, answer.body)


# -- the command line ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "says"), [
    (["--host", "0.0.0.0"], "give a token (set $PGFLOW_DASHBOARD_TOKEN or give --token-file PATH)"),
    (["--token", "short"], "at least 16 characters"),
    (["--allow-actions"], "--allow-actions needs a token: set $PGFLOW_DASHBOARD_TOKEN or give --token-file PATH"),
    (["--port", "0"], "--port is from 1 to 65535"),
])
def test_the_command_refuses_what_would_expose_it_before_starting(
        args: list[str], says: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from pgflow.cli import main

    monkeypatch.delenv("PGFLOW_DASHBOARD_TOKEN", raising=False)
    monkeypatch.setenv("PGFLOW_DSN", "postgresql://nobody@127.0.0.1:1/none")  # never reached
    assert main(["dashboard", *args]) == 2
    assert says in capsys.readouterr().err
