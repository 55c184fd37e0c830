"""SIGTERM (or Ctrl-C) stops the HTTP servers (``pgflow dashboard``, ``pgflow streams serve``) as it
stops a worker: uvicorn's graceful shutdown, then a normal exit (0) whose exit hooks run, so the embedded
PostgreSQL the server started is stopped with it. (uvicorn raises SIGTERM again once it has shut down;
under the default action the process died there, before its hooks, and left the embedded server running
with nobody to stop it: ``pgflow/_serving.py``.) Each a real process on an embedded server of its own."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pgflow._serving import serve_until_stopped
from pgflow.embedded import stop_embedded

from .processes import WAIT, Processes, wait_until
from .web import free_port, listening


@pytest.fixture
def home() -> Iterator[Path]:
    """A ``PGFLOW_HOME`` of its own. Not under pytest's temporary directory, which another session may
    reset to 0700 (see conftest.py): under root the embedded server runs as another user."""
    base = Path(tempfile.mkdtemp(prefix="pgflow-serving-")).resolve()
    base.chmod(0o755)
    try:
        yield base
    finally:
        stop_embedded(base)  # (what a failed test left running)
        shutil.rmtree(base, ignore_errors=True)


def status_of(url: str, method: str) -> int:
    """The status of one request (the first may wait for the embedded server's initdb: not sent twice,
    since a PUT sent again would be answered 200, not 201)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=WAIT) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as refused:
        return refused.code


# Each command, and a request of it that reads the database (so the embedded server is up once it is
# answered): the dashboard's overview, a new stream.
SERVERS = {"dashboard": (["dashboard"], "/", "GET", 200),
           "streams": (["streams", "serve"], "/stopping/s1", "PUT", 201)}


@pytest.mark.parametrize(("name", "signum"), [("dashboard", signal.SIGTERM), ("streams", signal.SIGTERM),
                                              ("streams", signal.SIGINT)])
def test_a_stop_signal_ends_the_server_with_exit_0_and_stops_the_embedded_postgresql_it_started(
        name: str, signum: signal.Signals, procs: Processes, home: Path) -> None:
    command, path, method, expected = SERVERS[name]
    env = {k: v for k, v in os.environ.items() if k not in ("PGFLOW_DSN", "PGFLOW_SCHEMA")}
    port = free_port()
    server = procs.start(name, ["-m", "pgflow", *command, "--port", str(port)], {**env, "PGFLOW_HOME": str(home)})
    wait_until(lambda: listening(port), f"the {name} to listen", procs, server)
    assert status_of(f"http://127.0.0.1:{port}{path}", method) == expected, server.describe()
    running = home / "pg18" / "postmaster.pid"  # (PostgreSQL removes it as it stops)
    assert running.exists(), server.describe()

    server.signal(signum)
    assert server.wait_exit() == 0, server.describe()
    assert not running.exists(), f"the embedded PostgreSQL outlived the {name}\n{server.describe()}"


def test_a_server_that_cannot_listen_is_false_and_leaves_sigterm_as_it_was(
        capfd: pytest.CaptureFixture[str]) -> None:
    """uvicorn exits the process when it cannot start (the command then exits 1, not uvicorn's code)."""
    before = signal.getsignal(signal.SIGTERM)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        assert serve_until_stopped(object(), "127.0.0.1", holder.getsockname()[1]) is False
    assert "error while attempting to bind" in capfd.readouterr().err  # (uvicorn's log: it did try)
    assert signal.getsignal(signal.SIGTERM) is before
