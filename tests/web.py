"""Talking to the web servers under test (the web example, examples/web/app.py, and the dashboard) as
their users' browsers do: started as a process on a free port, Server-Sent Events read line by line,
forms and JSON posted; and the browser the browser tests drive."""

from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path

from .processes import Proc, Processes, wait_until

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# Debian's Chromium, driven by Playwright (no browser download works on these machines).
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def start_web(procs: Processes, worker_env: dict[str, str], *args: str, delay: float = 0.05,
              port: int | None = None, name: str = "web") -> tuple[str, Proc]:
    """``python examples/web/app.py`` on a free port (or ``port``), serving and working on the test's
    schema; (its base URL, its process)."""
    port = port or free_port()
    proc = procs.start(name, [str(EXAMPLES / "web" / "app.py"), "--port", str(port), *args],
                       {**worker_env, "WEB_TOKEN_DELAY": str(delay)})
    wait_until(lambda: listening(port), "the web example to listen", procs, proc)
    return f"http://127.0.0.1:{port}", proc


def read_events(url: str, last_event_id: str | None = None) -> tuple[list[tuple[int, str]], bool]:
    """One SSE connection read to its end: its (id, word) messages, and whether it ended the stream."""
    request = urllib.request.Request(url, headers={"Last-Event-ID": last_event_id} if last_event_id else {})
    messages: list[tuple[int, str]] = []
    fields: dict[str, str] = {}
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        for raw in response:
            line = raw.decode().rstrip("\n")
            if line:
                name, _, value = line.partition(": ")
                fields[name] = value
                continue
            if fields.get("event") == "end":
                return messages, True
            if "data" in fields:
                messages.append((int(fields["id"]), json.loads(fields["data"])))
            fields = {}
    return messages, False


def post(url: str, body: dict[str, object] | None = None, form: str | None = None) -> urllib.request.Request:
    if form is not None:
        return urllib.request.Request(url, data=form.encode(), method="POST",
                                      headers={"Content-Type": "application/x-www-form-urlencoded"})
    return urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                  headers={"Content-Type": "application/json"})
