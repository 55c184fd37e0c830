"""A worker's own liveness probe: a tiny HTTP server answering ``GET /healthz`` with 200 while the
worker's event loop turns, its heartbeat is renewed and its listener is connected, 503 (with the
reasons) once any of them has been wrong for longer than the worker's lease.

It is per worker on purpose. ``pgflow status`` is the fleet's health: it fails for work that waits on
a queue or under a name no live worker serves, for a queue whose oldest due workflow waited too long,
for a dead worker while its queues have work. Used as every pod's liveness probe, any of those would
restart every pod of the fleet at once, and a restart cures none of them (a busy queue gets worse,
its workers gone while they start again). This probe says only whether this process does its job.

For a readiness check or an alert that wants the fleet's verdict from a worker's port, ``GET /fleetz``
answers what ``pgflow status`` would: 200, or 503 with how many problems there are (``pgflow status``
names them: the names are anybody's to choose, and the probe's reply names nothing). It asks the
database at most every ``FLEET_EVERY`` seconds, however often it is asked.

The server runs on a thread of its own, not on the worker's loop: a loop that is blocked (a step that
calls ``time.sleep`` in an ``async def``) must be reported as such, not only time the probe out. What
crosses the thread is a few floats and a bool that the loop writes and the server reads. Requests are
anyone's who can reach the port: only ``GET``/``HEAD /healthz`` is answered, a request must arrive
within a few seconds, at most a few are served at once, and the reply names no host, DSN or error text.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from socket import socket
from typing import Any

log = logging.getLogger("pgflow.worker")

REQUEST_WITHIN = 3.0  # seconds a client has to send its request line and headers
MAX_CLIENTS = 32  # requests served at once; more are closed unanswered (a probe retries)
FLEET_EVERY = 5.0  # seconds the fleet's verdict is kept before /fleetz asks the database again


class Liveness:
    """What the worker's loop writes (monotonic times) and the probe reads. ``lease_seconds`` is how
    long a fault is tolerated: as long as the worker's claims survive it unrenewed."""

    def __init__(self, lease_seconds: float, listening: Callable[[], bool]) -> None:
        now = time.monotonic()
        self.lease_seconds = lease_seconds
        self.loop_at = now
        self.heartbeat_at = now
        self.listener_down_since: float | None = None
        self._listening = listening

    def pulse(self) -> None:
        """Called on the worker's loop, about once a second."""
        now = time.monotonic()
        self.loop_at = now
        if self._listening():
            self.listener_down_since = None
        elif self.listener_down_since is None:
            self.listener_down_since = now

    def renewed(self) -> None:
        """Called on the loop after every heartbeat the database answered."""
        self.heartbeat_at = time.monotonic()

    def problems(self) -> list[str]:
        """What is wrong for longer than the lease; empty when the worker is alive. The heartbeat and
        the listener are judged by the loop's clock (its last pulse): a blocked loop renews nothing,
        and is reported as what it is, not as a database that does not answer."""
        now, lease, loop_at = time.monotonic(), self.lease_seconds, self.loop_at
        found = []
        if now - loop_at > lease:
            found.append(f"the worker's event loop has not run for {now - loop_at:.1f} s (something blocks"
                         " it: a blocking call in async code?)")
        if loop_at - self.heartbeat_at > lease:
            found.append(f"the heartbeat has not been renewed for {now - self.heartbeat_at:.1f} s (lease"
                         f" {lease:g} s): the database cannot be reached or does not answer")
        down = self.listener_down_since
        if down is not None and loop_at - down > lease:
            found.append(f"the LISTEN connection has been down for {now - down:.1f} s")
        return found


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], liveness: Liveness, fleet: FleetVerdict | None) -> None:
        self.liveness = liveness
        self.fleet = fleet
        self._clients = threading.BoundedSemaphore(MAX_CLIENTS)
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._clients.acquire(blocking=False):
            self.shutdown_request(request)  # too many at once: closed, the probe tries again
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._clients.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._clients.release()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = REQUEST_WITHIN  # on the socket: a client that sends nothing is dropped
    protocol_version = "HTTP/1.0"  # one request per connection
    default_request_version = "HTTP/1.0"  # a request line that does not parse still gets a status line
    error_message_format = "%(code)d %(message)s\n"  # plain text, no HTML page echoing the request
    error_content_type = "text/plain; charset=utf-8"
    server_version = "pgflow-worker"
    sys_version = ""

    def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
        self._answer(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        where = self.path.split("?", 1)[0]
        if where == "/fleetz" and self.server.fleet is not None:
            found = self.server.fleet.problems()
            if found:
                self._reply(503, f"unhealthy: {found} fleet problems (pgflow status names them)\n", body)
            else:
                self._reply(200, "ok\n", body)
            return
        if where != "/healthz":
            self._reply(404, "not found: the probe is GET /healthz (the fleet's: GET /fleetz)\n", body)
            return
        problems = self.server.liveness.problems()
        if problems:
            self._reply(503, "unhealthy: " + "; ".join(problems) + "\n", body)
        else:
            self._reply(200, "ok\n", body)

    def _reply(self, code: int, text: str, body: bool) -> None:
        data = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
        log.debug("health probe: " + format, *args)


class FleetVerdict:
    """How many problems ``pgflow status`` would report (``count``: its check, blocking), asked at
    most every ``FLEET_EVERY`` seconds; a check that fails counts as one problem."""

    def __init__(self, count: Callable[[], int]) -> None:
        self._count = count
        self._lock = threading.Lock()
        self._at = -float("inf")
        self._found = 0

    def problems(self) -> int:
        with self._lock:  # (one check at a time: the others wait and take its answer)
            if time.monotonic() - self._at >= FLEET_EVERY:
                try:
                    self._found = self._count()
                except Exception:  # noqa: BLE001 - the database is away: that is a problem of the fleet's
                    log.warning("the fleet's health could not be read", exc_info=True)
                    self._found = 1
                self._at = time.monotonic()
            return self._found


class HealthServer:
    """The probe's HTTP server and its thread; ``start`` binds (port 0: any free port, see ``port``),
    ``stop`` closes it and joins the thread."""

    def __init__(self, liveness: Liveness, host: str, port: int, fleet: FleetVerdict | None = None) -> None:
        self._server = _Server((host, port), liveness, fleet)
        sock: socket = self._server.socket
        self.host, self.port = sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"pgflow health probe :{self.port}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()  # (waits for serve_forever to return: only once it runs)
            self._thread.join(timeout=5)
        self._server.server_close()
