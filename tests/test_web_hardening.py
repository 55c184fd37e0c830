"""The web example's HTTP surface against hostile or careless clients: cross-site POSTs, bodies
without end, ids and Last-Event-IDs that are not what the page sends, and a stop by signal. Each
request here is one a browser, a script or a proxy can send; each answer is a 4xx that changes
nothing, never a 500 and never a decision the user did not make."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, urlsplit

import pytest

import pgflow
from pgflow._core.checks import check_reader
from pgflow._core.datadir import pid_alive
from pgflow.embedded import PGDATA_NAME, stop_embedded

from .helpers import ONE_SERVER
from .processes import Processes, wait_until
from .web import post, read_events, start_web

pytestmark = pytest.mark.slow

LIMIT = 16 * 1024  # the example's bound on a request body


def status_of(request: urllib.request.Request | str) -> int:
    """The HTTP status the example answers ``request`` with (an error status is an answer too)."""
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def raw_status(base: str, head: str, body: bytes = b"") -> int:
    """Send a request's head and ``body`` and never anything more, and return the status the server
    answers with. A server that reads a whole body before it answers never answers one that has not
    ended: the read then times out, and the test fails."""
    url = urlsplit(base)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + body)
        try:
            line = sock.makefile("rb").readline()
        except TimeoutError:
            pytest.fail(f"no answer to {head.splitlines()[0]!r} with a body that has not ended")
    return int(line.split()[1])


def approval(base: str, run: str, body: bytes, content_type: str | None = "application/json",
             origin: str | None = None) -> urllib.request.Request:
    headers = {"Content-Type": content_type} if content_type else {}
    if origin is not None:
        headers["Origin"] = origin
    return urllib.request.Request(f"{base}/runs/{run}/approval", data=body, method="POST", headers=headers)


def waiting_run(base: str, app: pgflow.App, procs: Processes) -> str:
    """A run started through the page's form, once it has written its answer and waits for a decision."""
    with urllib.request.urlopen(post(f"{base}/start", form="prompt=hardening"), timeout=30) as page:
        run = page.url.rsplit("/", 1)[1]
    handle = app.handle(run)
    assert handle.get_event("stage", timeout=90) == "awaiting approval", procs.logs()
    wait_until(lambda: handle.status() == "queued", "the run to give its slot back", procs)
    return run


# -- 1. only the page itself decides ------------------------------------------------------------------


@ONE_SERVER  # the web example's HTTP answers to hostile clients: the same on any server
def test_a_decision_needs_json_from_the_pages_own_origin(procs: Processes, worker_env: dict[str, str],
                                                         app: pgflow.App) -> None:
    base, web = start_web(procs, worker_env, delay=0)
    run = waiting_run(base, app, procs)
    reject = json.dumps({"approved": False}).encode()
    # What another site's page can send with fetch(..., {mode: "no-cors"}) or a plain <form>: a
    # CORS-safelisted content type, with its own Origin. Each is refused before anything is sent.
    assert status_of(approval(base, run, reject, "text/plain;charset=UTF-8")) == 415
    assert status_of(approval(base, run, reject, "application/x-www-form-urlencoded")) == 415
    assert status_of(approval(base, run, reject, "multipart/form-data; boundary=x")) == 415
    assert status_of(approval(base, run, reject, origin="http://evil.example")) == 403
    assert status_of(approval(base, run, reject, origin="null")) == 403  # a sandboxed frame, a file: page
    assert status_of(approval(base, run, reject, origin=base.replace("127.0.0.1", "localhost"))) == 403
    handle = app.handle(run)
    assert handle.status() == "queued" and handle.get_event("stage", timeout=0) == "awaiting approval"

    # The page's own request: JSON, its own Origin (a browser sends it on every POST).
    accept = json.dumps({"approved": True}).encode()
    assert status_of(approval(base, run, accept, "application/json; charset=utf-8", origin=base)) == 200
    # Approved: had any refused request reached the workflow, its "rejected" would have been final
    # (the idempotency key drops every decision after the first).
    assert handle.result(timeout=60) == {"decision": "approved", "words": len(list(handle.stream("tokens")))}
    assert web.alive()


# -- 2. bounded bodies, read as they come -------------------------------------------------------------


@ONE_SERVER  # the web example's HTTP answers to hostile clients: the same on any server
def test_bodies_are_bounded_and_refused_before_they_end(procs: Processes, worker_env: dict[str, str],
                                                        app: pgflow.App) -> None:
    base, _ = start_web(procs, worker_env, delay=0)
    run = waiting_run(base, app, procs)
    port = urlsplit(base).port
    host = f"Host: 127.0.0.1:{port}\nContent-Type: application/json\n"

    # A Content-Length over the limit is refused at once, before a byte of the body arrives.
    assert raw_status(base, f"POST /runs/{run}/approval HTTP/1.1\n{host}Content-Length: 1000000000\n\n") == 413
    # Without a Content-Length (chunked), the body is refused as soon as it passes the limit, though
    # it has not ended: the server never holds more than the limit of it.
    chunk = b" " * (LIMIT + 1)
    assert raw_status(base, f"POST /runs/{run}/approval HTTP/1.1\n{host}Transfer-Encoding: chunked\n\n",
                      f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n") == 413
    # The same, sent whole: with a Content-Length, and chunked (urllib chunks an iterable body).
    padded = json.dumps({"approved": False}).encode().ljust(LIMIT + 1)
    assert status_of(approval(base, run, padded)) == 413
    big = urllib.request.Request(f"{base}/runs/{run}/approval", data=iter([padded[:LIMIT], padded[LIMIT:]]),
                                 method="POST", headers={"Content-Type": "application/json"})
    assert status_of(big) == 413
    # The form that starts a run is bounded too, and starts nothing.
    assert status_of(post(f"{base}/start", form="prompt=" + "x" * LIMIT)) == 413
    assert [r.id for r in app.list_workflows()] == [run]

    # A body of exactly the limit is the page's, padded: it decides.
    exact = json.dumps({"approved": True}).encode().ljust(LIMIT)
    assert status_of(approval(base, run, exact)) == 200
    assert app.handle(run).result(timeout=60)["decision"] == "approved"


# -- 3. ids: escaped in the page, checked in the routes -----------------------------------------------


@ONE_SERVER  # the web example's HTTP answers to hostile clients: the same on any server
def test_ids_are_escaped_in_the_page_and_bad_ones_refused(procs: Processes, worker_env: dict[str, str],
                                                          app: pgflow.App) -> None:
    base, web = start_web(procs, worker_env, delay=0)
    # A workflow id is any text: one made by another program can be markup. (On a queue no worker
    # serves: it only has to exist.)
    hostile = 'x"><img src=x onerror=alert(1)>'
    app.start_by_name("web.answer", "hi", id=hostile, queue="nobody")
    with urllib.request.urlopen(f"{base}/runs/{quote(hostile, safe='')}", timeout=30) as response:
        page = response.read().decode()
    assert 'data-run="x&quot;&gt;&lt;img src=x onerror=alert(1)&gt;"' in page
    assert hostile not in page

    routes = ("", "/tokens", "/state", "/approval")

    def statuses(id: str) -> list[int]:
        return [status_of(post(f"{base}/runs/{id}{route}", {"approved": True}) if route == "/approval"
                          else f"{base}/runs/{id}{route}") for route in routes]

    assert statuses("no-such-run") == [404] * 4
    assert statuses("%00") == [400] * 4  # NUL: never a valid id
    assert statuses("a" * 1001) == [400] * 4  # longer than an id may be
    assert statuses("%ED%A0%80") == [404] * 4  # not UTF-8: decoded with a replacement, so merely unknown
    assert "Traceback" not in web.output()


# -- 4. Last-Event-ID ---------------------------------------------------------------------------------


@ONE_SERVER  # the web example's HTTP answers to hostile clients: the same on any server
def test_last_event_id_is_ascii_digits_within_int4(procs: Processes, worker_env: dict[str, str],
                                                   app: pgflow.App) -> None:
    base, web = start_web(procs, worker_env, delay=0)
    run = waiting_run(base, app, procs)
    url = f"{base}/runs/{run}/tokens"
    words = list(app.handle(run).stream("tokens"))
    # "²" and "1_0" are what str.isdigit() and int() each take alone; 2**31 - 1 has no next
    # position that fits the table's int4; eleven digits are too many whatever their value.
    for bad in ("²", "³", "1_0", "-1", "0x10", "1e3", "2147483647", "4294967296", "00000000004", "9" * 400):
        request = urllib.request.Request(url, headers={"Last-Event-ID": bad})
        assert status_of(request) == 400, bad
    assert read_events(url, "4") == ([(p, words[p]) for p in range(5, len(words))], True)
    assert read_events(url, "0000000004")[0][:1] == [(5, words[5])]  # ten digits: leading zeros are fine
    assert read_events(url, "2147483646") == ([], True)  # the last position an int4 holds: nothing there
    assert "Traceback" not in web.output()


def test_readers_refuse_offsets_past_the_int4_positions() -> None:
    check_reader("tokens", 2**31 - 1)
    with pytest.raises(ValueError, match="2147483648"):
        check_reader("tokens", 2**31)
    app = pgflow.App("postgresql://127.0.0.1:1/unreachable")  # refused before anything connects
    try:
        with pytest.raises(ValueError, match="int4"):
            next(app.handle("some-run").stream_items("tokens", offset=2**40))
    finally:
        app.close()


# -- 5. a stop by signal stops the embedded server ----------------------------------------------------


@pytest.fixture
def pgflow_home() -> Iterator[Path]:
    # Not under pytest's temporary directory (see conftest.py: the server may run as another user).
    home = Path(tempfile.mkdtemp(prefix="pgflow-web-home-"))
    os.chmod(home, 0o755)
    try:
        yield home
    finally:
        stop_embedded(home)
        shutil.rmtree(home, ignore_errors=True)


def postmaster(home: Path) -> int | None:
    """The pid in the embedded server's postmaster.pid, if there is that file."""
    try:
        return int((home / PGDATA_NAME / "postmaster.pid").read_text().split()[0])
    except FileNotFoundError:
        return None


def test_sigterm_and_ctrl_c_stop_the_embedded_server(procs: Processes, pgflow_home: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key not in ("PGFLOW_DSN", "PGFLOW_SCHEMA")}
    root = Path(__file__).resolve().parent.parent  # this checkout's pgflow, as worker_env gives it
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    env["PGFLOW_HOME"] = str(pgflow_home)
    for signum in (signal.SIGTERM, signal.SIGINT):
        _, web = start_web(procs, env, name=signal.Signals(signum).name)
        pid = postmaster(pgflow_home)
        assert pid is not None and pid_alive(pid), web.describe()
        web.signal(signum)
        assert web.wait_exit() == 128 + signum, web.describe()  # it exited, rather than being killed
        # The example was the server's only user, so its exit stopped the server (pg_ctl -w: by the
        # time the example has exited, the postmaster has).
        assert not pid_alive(pid), web.describe()
        assert postmaster(pgflow_home) is None, web.describe()
        assert "Traceback" not in web.output(), web.describe()
