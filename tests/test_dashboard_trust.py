"""What the dashboard trusts, over real HTTP: not the network it listens on. A page that turns its DNS
name to 127.0.0.1 (rebinding), a local user, a copied cookie, a client guessing tokens or opening live
pages in a loop, and any malformed request get a 4xx (or a 503 past a bound), never the data, an
action or a 500. The server is the one tests/test_dashboard_http.py starts (create_app under uvicorn on
a thread), or ``pgflow dashboard`` as a process where the command line is what is tested."""

from __future__ import annotations

import argparse
import http.client
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import pytest

import pgflow
from pgflow.dashboard.access import CSRF_COOKIE, SESSION_COOKIE, Hosts
from pgflow.errors import ConfigurationError

from .helpers import ONE_SERVER
from .processes import Processes, wait_until
from .test_dashboard_http import (
    AUTH,
    TOKEN,
    WAIT,
    Answer,
    call,
    csrf_of,
    form,
    page,
    serving,
    wait_for,
)
from .web import free_port, listening

pytestmark = pytest.mark.slow

ALLOWED = ["dash.example.com", "other.example:8443"]


@pytest.fixture
def serve(dsn: str, schema: str, app: pgflow.App) -> Iterator[Any]:
    yield from serving(dsn, schema, app)


def with_host(base: str, target: str, host: str, **headers: str) -> Answer:
    return call(base, "GET", target, {"Host": host, **headers})


def raw(base: str, request: bytes) -> int:
    """The status of the answer to ``request`` sent as it is (bytes http.client would refuse to send);
    a server that closes without a status line, or resets the connection while the request is still
    being sent (a request line too long), counts as 400: it refused the request, and no 500 came."""
    url = urlsplit(base)
    with socket.create_connection((url.hostname, url.port), timeout=WAIT) as sock:
        try:
            sock.sendall(request)
            line = sock.makefile("rb").readline()
        except (ConnectionResetError, BrokenPipeError):
            return 400
    return int(line.split()[1]) if line else 400


def sign_in(base: str, **headers: str) -> tuple[Answer, dict[str, str]]:
    """The login form filled with the token: (the answer, every cookie this browser now has)."""
    login = page(base, "/login", **headers)
    cookies = login.cookies()
    signed = form(base, "/login", {"token": TOKEN, "csrf": csrf_of(login)}, cookies, **headers)
    return signed, {**cookies, **signed.cookies()}


def cookie(jar: dict[str, str]) -> str:
    return "; ".join(f"{k}={v}" for k, v in jar.items())


# -- 1. the Host header ----------------------------------------------------------------------------------


@ONE_SERVER  # what the dashboard trusts is decided over HTTP, the same on any server
def test_only_loopback_names_and_allowed_hosts_are_answered_before_anything_is_read(serve: Any) -> None:
    served = serve(worker=False, allowed_hosts=ALLOWED)
    base, port = served.base, served.port
    for host in (f"127.0.0.1:{port}", "127.0.0.1", "localhost", f"localhost:{port}", "LOCALHOST.", "[::1]",
                 f"[::1]:{port}", "dash.example.com", "Dash.Example.Com:443", "other.example:8443"):
        assert with_host(base, "/workflows", host).status == 200, host

    read = served.dashboard.reader.statements
    for host in ("evil.example", f"evil.example:{port}", "other.example", "other.example:80",
                 "dash.example.com.evil.example", "127.0.0.1.nip.io", "localhost.evil.example"):
        for target in ("/", "/workflows", "/live/overview", "/static/dashboard.css", "/login"):
            answer = with_host(base, target, host, Accept="text/html")
            assert answer.status == 421, (host, target, answer.status)
            assert answer.body.count("\n") == 1 and "--allowed-host" in answer.body, answer.body
    for host in ("", "localhost@evil.example", "a b", "[::1", "127.0.0.1:80:80", "localhost:http"):
        assert with_host(base, "/", host).status == 400, host
    assert raw(base, b"GET / HTTP/1.0\r\n\r\n") == 400  # HTTP/1.0 may leave the Host out
    assert served.dashboard.reader.statements == read  # nothing was read for any of them


@ONE_SERVER  # what the dashboard trusts is decided over HTTP, the same on any server
def test_a_rebinding_page_is_refused_even_with_the_token_and_the_bound_address_is_answered(serve: Any) -> None:
    served = serve(token=TOKEN, worker=False, bind="10.11.12.13")
    assert with_host(served.base, "/workflows", "evil.example", **AUTH).status == 421
    assert with_host(served.base, "/workflows", f"10.11.12.13:{served.port}", **AUTH).status == 200
    assert with_host(served.base, "/workflows", "10.11.12.14", **AUTH).status == 421
    assert with_host(served.base, "/workflows", "localhost", **AUTH).status == 200


def test_the_hosts_rule() -> None:
    wildcard = Hosts((), "0.0.0.0")  # noqa: S104 - a name of every address, not a bind
    assert wildcard.refusal("192.168.7.7:8080") is None and wildcard.refusal("[fe80::1]") is None
    refused = wildcard.refusal("evil.example:1")
    assert refused is not None and refused[0] == 421 and "'evil.example'" in refused[1]
    assert Hosts((), "127.0.0.1").refusal("192.168.7.7") is not None
    named = Hosts(["dash.example.com:8443"], "dash.internal")
    assert named.refusal("dash.example.com:8443") is None and named.refusal("dash.example.com") is not None
    assert named.refusal("dash.internal:8080") is None
    for bad in ("", "*.example.com", "http://x", "a b"):
        with pytest.raises(ValueError, match="not a host name"):
            Hosts([bad])


# -- 2 and 3. the token: always for actions; from the environment or a file -----------------------------


def dashboard_args(*argv: str) -> argparse.Namespace:
    from pgflow.dashboard.command import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["dashboard", *argv])


@ONE_SERVER  # an option refused before anything connects: the same on any server
def test_actions_need_a_token(app: pgflow.App, monkeypatch: pytest.MonkeyPatch) -> None:
    from pgflow.dashboard.command import options
    from pgflow.dashboard.server import create_app

    monkeypatch.delenv("PGFLOW_DASHBOARD_TOKEN", raising=False)
    with pytest.raises(ValueError, match="actions need a token"):
        create_app(app, allow_actions=True)
    with pytest.raises(ConfigurationError) as refused:
        options(dashboard_args("--allow-actions"))
    assert str(refused.value) == ("--allow-actions needs a token: set $PGFLOW_DASHBOARD_TOKEN or give"
                                  " --token-file PATH")
    monkeypatch.setenv("PGFLOW_DASHBOARD_TOKEN", TOKEN)
    assert options(dashboard_args("--allow-actions")).actions


def test_the_token_comes_from_the_environment_or_a_file_and_on_the_command_line_with_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from pgflow.dashboard.command import options

    monkeypatch.setenv("PGFLOW_DASHBOARD_TOKEN", "from-the-environment-0123")
    assert options(dashboard_args()).token == "from-the-environment-0123"
    token_file = tmp_path / "token"
    token_file.write_text(f"  {TOKEN}\n")
    assert options(dashboard_args("--token-file", str(token_file))).token == TOKEN
    assert capsys.readouterr().err == ""

    assert options(dashboard_args("--token", "on-the-command-line-0123")).token == "on-the-command-line-0123"
    warning = capsys.readouterr().err
    assert "ps" in warning and "$PGFLOW_DASHBOARD_TOKEN" in warning and "--token-file" in warning
    assert warning.count("\n") == 1

    for argv, says in [((f"--token-file={tmp_path / 'none'}",), "No such file"),
                       (("--token-file", str(tmp_path)), "--token-file"),
                       (("--token-file", str(token_file), "--token", TOKEN), "not both")]:
        with pytest.raises(ConfigurationError, match=says):
            options(dashboard_args(*argv))
    for content in ("", "\n", f"{TOKEN}\n{TOKEN}\n"):
        token_file.write_text(content)
        with pytest.raises(ConfigurationError, match="put the token alone in it"):
            options(dashboard_args("--token-file", str(token_file)))
    monkeypatch.setenv("PGFLOW_DASHBOARD_ALLOWED_HOSTS", "a.example, b.example:8443")
    assert options(dashboard_args()).allowed_hosts == ("a.example", "b.example:8443")
    assert options(dashboard_args("--allowed-host", "c.example")).allowed_hosts == ("c.example",)
    with pytest.raises(ConfigurationError, match="not a host name"):
        options(dashboard_args("--allowed-host", "*.example"))


@ONE_SERVER  # the command's options and HTTP checks, the same on any server
def test_the_command_serves_with_a_token_file_and_the_allowed_hosts_of_its_environment(
        procs: Processes, worker_env: dict[str, str], app: pgflow.App, tmp_path: Path) -> None:
    app.migrate()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    port = free_port()
    env = {k: v for k, v in worker_env.items() if k != "PGFLOW_DASHBOARD_TOKEN"}
    proc = procs.start("dashboard", ["-m", "pgflow", "dashboard", "--port", str(port), "--token-file",
                                     str(token_file), "--allow-actions"],
                       {**env, "PGFLOW_DASHBOARD_ALLOWED_HOSTS": "dash.example.com"})
    wait_until(lambda: listening(port), "the dashboard to listen", procs, proc)
    base = f"http://127.0.0.1:{port}"
    assert call(base, "GET", "/workflows").status == 401
    assert call(base, "GET", "/workflows", AUTH).status == 200
    assert with_host(base, "/workflows", "dash.example.com", **AUTH).status == 200
    assert with_host(base, "/workflows", "evil.example", **AUTH).status == 421
    assert "warning" not in proc.output() and TOKEN not in proc.output()

    port = free_port()
    loud = procs.start("loud", ["-m", "pgflow", "dashboard", "--port", str(port), "--token", TOKEN], env)
    wait_until(lambda: listening(port), "the dashboard to listen", procs, loud)
    assert call(f"http://127.0.0.1:{port}", "GET", "/workflows", AUTH).status == 200
    assert "--token is visible to every user of this machine" in loud.output()


# -- 4. sessions -----------------------------------------------------------------------------------------


@ONE_SERVER  # what the dashboard trusts is decided over HTTP, the same on any server
def test_a_session_is_a_random_id_the_server_keeps_and_logout_ends_it_everywhere(serve: Any) -> None:
    served = serve(token=TOKEN, worker=False)
    base = served.base
    signed, jar = sign_in(base)
    assert signed.status == 303
    attributes = signed.headers["set-cookie"].split("; ")
    assert {"HttpOnly", "SameSite=Strict", "Max-Age=43200", "Path=/"} <= set(attributes)
    assert "Secure" not in attributes  # plain http: a Secure cookie would never come back
    session = jar[SESSION_COOKIE]
    assert len(session) >= 40 and TOKEN not in session
    again, other = sign_in(base)
    assert other[SESSION_COOKIE] != session  # each sign-in its own id, not a function of the token

    copied = f"{SESSION_COOKIE}={session}"
    assert page(base, "/", Cookie=copied).status == 200
    logout = page(base, "/logout", Cookie=cookie(jar))
    assert logout.status == 200 and 'action="/logout"' in logout.body
    out = form(base, "/logout", {"csrf": csrf_of(logout)}, jar)
    assert out.status == 303 and out.headers["location"] == "/login"
    assert out.cookies()[SESSION_COOKIE] == "" and "Max-Age=0" in out.headers["set-cookie"]
    assert page(base, "/", Cookie=copied).status == 401  # the copy is dead too: the server forgot it
    assert call(base, "GET", "/workflows", {"Cookie": copied}).status == 401
    assert page(base, "/", Cookie=f"{SESSION_COOKIE}={other[SESSION_COOKIE]}").status == 200  # another browser

    # A session is good only with the token it was made under: a new token ends every session.
    served.dashboard.access.token = "a-new-token-for-the-dashboard"
    assert page(base, "/", Cookie=f"{SESSION_COOKIE}={other[SESSION_COOKIE]}").status == 401


@ONE_SERVER  # what the dashboard trusts is decided over HTTP, the same on any server
def test_sessions_expire_and_the_cookie_is_secure_behind_https(serve: Any) -> None:
    served = serve(token=TOKEN, worker=False, session_hours=2.0 / 3600)
    signed, jar = sign_in(served.base, **{"X-Forwarded-Proto": "https"})  # from 127.0.0.1: uvicorn trusts it
    attributes = signed.headers["set-cookie"].split("; ")
    assert "Secure" in attributes and "Max-Age=2" in attributes
    assert page(served.base, "/", Cookie=cookie(jar)).status == 200
    time.sleep(2.2)
    assert page(served.base, "/", Cookie=cookie(jar)).status == 401


# -- 5. bounds -------------------------------------------------------------------------------------------


def open_live(base: str, target: str, headers: dict[str, str] | None = None) -> http.client.HTTPConnection:
    """A live answer, opened and left open (its first line read)."""
    url = urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=WAIT)
    conn.request("GET", target, headers=headers or {})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    assert response.readline().startswith(b"retry:")
    return conn


@ONE_SERVER  # what the dashboard trusts is decided over HTTP, the same on any server
def test_live_connections_are_bounded_per_process(serve: Any) -> None:
    served = serve(worker=False, max_live=2)
    first, second = open_live(served.base, "/live/overview"), open_live(served.base, "/live/overview")
    try:
        full = call(served.base, "GET", "/live/overview")
        assert full.status == 503 and full.headers["retry-after"] == "5" and "2 live connections" in full.body
        assert call(served.base, "GET", "/workflows").status == 200  # pages still answer
        first.close()
        wait_for(lambda: served.guard.live < 2, "the closed connection to be let go")
        third = open_live(served.base, "/live/overview")
        third.close()
    finally:
        first.close()
        second.close()
    wait_for(lambda: served.guard.live == 0, "every live connection to be let go")


@ONE_SERVER  # what the dashboard trusts is decided over HTTP, the same on any server
def test_wrong_tokens_are_bounded_per_client_address(serve: Any) -> None:
    served = serve(token=TOKEN, worker=False)
    base = served.base
    login = page(base, "/login")
    jar, csrf = login.cookies(), csrf_of(login)
    for _ in range(10):
        assert form(base, "/login", {"token": "not-the-token-but-long", "csrf": csrf}, jar).status == 401
    blocked = form(base, "/login", {"token": TOKEN, "csrf": csrf}, jar)
    assert blocked.status == 429 and int(blocked.headers["retry-after"]) >= 1
    assert call(base, "GET", "/workflows", AUTH).status == 429  # a bearer header is a guess as well
    # Another client (behind the proxy uvicorn trusts from 127.0.0.1) is not held back by this one.
    elsewhere = {"X-Forwarded-For": "192.0.2.7"}
    assert call(base, "GET", "/workflows", {**AUTH, **elsewhere}).status == 200
    for _ in range(10):
        wrong = {"Authorization": "Bearer not-the-token-but-long", **elsewhere}
        assert call(base, "GET", "/workflows", wrong).status == 401
    assert call(base, "GET", "/workflows", {**AUTH, **elsewhere}).status == 429


# -- 6. no input makes a 500 -----------------------------------------------------------------------------

HOSTILE_TARGETS = [
    "/workflows?since=99999999999d", "/workflows?since=99999999d", "/workflows?since=9999999999999999999999s",
    "/workflows?since=-1h", "/workflows?since=0001-01-01T00:00%2B14:00", "/workflows?before=9999-12-31T23:59-14:00",
    "/workflows?before=0001-01-01T00:00%2B14:00", "/workflows?since=1h&before=1h", "/workflows?since=%00",
    "/workflows?limit=-1", "/workflows?limit=99999999999999999999", "/workflows?limit=1e3", "/workflows?limit=",
    "/workflows?limit=%EF%BC%91", "/workflows?cursor=OTk5OS0xMi0zMVQyMzo1OTo1OS0xNDowMHx4",  # 9999-12-31...-14:00|x
    "/workflows?cursor=MDAwMS0wMS0wMVQwMDowMCsxNDowMHx4", "/workflows?cursor=%FF%FE", "/workflows?cursor=====",
    "/workflows?cursor=fA", "/workflows?status=%00", "/workflows?name=%ED%A0%80", "/workflows?queue=" + "q" * 10_000,
    "/workflows?" + "&".join(f"name={i}" for i in range(500)), "/workflows?%00=1", "/workflows?&&&==&",
    "/workflow?id=%00", "/workflow?id=%FF", "/workflow?id=" + "%C0%80" * 50, "/workflow?id=" + "i" * 100_000,
    "/workflow?id=.", "/workflow?id=..%2F..%2Fetc", "/find?id=%20", "/find?id=", "/find",
    "/live/stream?id=x&key=out&from=99999999999", "/live/stream?id=x&key=out&from=-5", "/live/stream?id=x&key=",
    "/live/stream?id=x&key=%00", "/live/stream?id=x&key=out&from=2147483647", "/live/workflow?id=%00",
    "/live/workflow", "/live/nothing", "/confirm?id=x&action=%00", "/confirm?id=x&action=fork",
    "/confirm?id=x", "/confirm?action=cancel", "/static/", "/static/%2e%2e/server.py", "/static/..%2Faccess.py",
    "//workflows", "/workflows/", "/%00", "/login?next=//evil.example", "/logout", "/cost?x=1",
]


@ONE_SERVER  # what the dashboard trusts is decided over HTTP, the same on any server
def test_no_hostile_request_is_answered_with_a_500(serve: Any, app: pgflow.App) -> None:
    served = serve(token=TOKEN, actions=True, worker=False)
    base = served.base
    handle = app.start_by_name("dash.child", 2)
    statuses: dict[str, int] = {}
    for target in HOSTILE_TARGETS:
        statuses[target[:80]] = page(base, target, **AUTH).status
    stream = f"/live/stream?id={quote(handle.id)}&key=out"
    for last in ("99999999999", "-1", "1e9", "\u00b2".encode().decode("latin-1"), "0x10", "1 2"):
        statuses[f"Last-Event-ID {last!r}"] = call(base, "GET", stream, {**AUTH, "Last-Event-ID": last}).status
    for name, value in [("Cookie", f"{SESSION_COOKIE}=\"\\x\"; ;;=; {CSRF_COOKIE}"), ("Cookie", "a" * 8000),
                        ("Authorization", "Bearer"), ("Authorization", "Bearer " + "x" * 10_000),
                        ("Authorization", "\x7f\x01"), ("Accept", "text/html" * 500), ("Origin", "null"),
                        ("X-Forwarded-Proto", "gopher"), ("X-Forwarded-For", "not an address")]:
        statuses[f"{name}: {value[:40]!r}"] = call(base, "GET", "/workflows", {**AUTH, name: value}).status
    signed = {**AUTH, "Content-Type": "application/x-www-form-urlencoded"}
    for body in (b"%", b"id=%FF&action=cancel", b"a=1&" * 50, b"id=" + b"x" * 20_000, b"\xff\xfe",
                 b"id=x&action=fork&from_step=99999999999999", b"id=x&action=fork&from_step=%C2%B2"):
        statuses[f"POST /action {body[:40]!r}"] = call(base, "POST", "/action", signed, body).status
    for method in ("PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "BREW"):
        statuses[f"{method} /"] = call(base, method, "/", AUTH).status
    auth = f"Authorization: Bearer {TOKEN}\r\n".encode()
    host = f"Host: 127.0.0.1:{served.port}\r\n".encode()
    for line in (b"GET /workflow?id=\xff\xfe HTTP/1.1", b"GET /workflows?since=\x01 HTTP/1.1",
                 b"GET /\x00 HTTP/1.1", b"GET /workflow?id=%%% HTTP/1.1", b"GET * HTTP/1.1",
                 b"GET http://evil.example/ HTTP/1.1", b"GET /" + b"a" * 20_000 + b" HTTP/1.1"):
        statuses[f"raw {line[:40]!r}"] = raw(base, line + b"\r\n" + host + auth + b"Connection: close\r\n\r\n")
    failed = {what: status for what, status in statuses.items() if status >= 500}
    assert not failed, failed
    odd = {what: status for what, status in statuses.items() if not (400 <= status < 500 or status in (200, 303, 307))}
    assert not odd, odd  # 307: Starlette's redirect of "/workflows/" to "/workflows"
