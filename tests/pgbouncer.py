"""A pgbouncer of a test's own, in front of one of the test servers, run as a real process.

Transaction pooling, on a port of its own on 127.0.0.1, with its ini and log in a temporary
directory: what a fleet behind pgbouncer meets, and something a test can kill and start again on
the same port (as a pooler restart or a failover to another pooler host does). Debian's package
(``apt-get install pgbouncer``) puts the binary in /usr/sbin; ``binary()`` is None where it is
missing, and the tests that need it skip, saying so.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg.conninfo

SKIP_REASON = ("pgbouncer is not installed (Debian/Ubuntu: apt-get install pgbouncer; .ci/run installs it):"
               " the tests of pgflow behind a transaction-mode pooler need a real one")
READY_WITHIN = 30.0  # seconds a starting pgbouncer may take to accept connections

# The settings pgflow makes itself on a direct connection, made here by pgbouncer on each server
# session it opens: the tested configuration of workers/README.md (query_timeout 10 s).
CONNECT_QUERY = ("SET search_path = pg_catalog, pg_temp; SET jit = off;"
                 " SET idle_in_transaction_session_timeout = 10000")


def binary() -> str | None:
    found = shutil.which("pgbouncer")
    if found is None and os.access("/usr/sbin/pgbouncer", os.X_OK):
        found = "/usr/sbin/pgbouncer"
    return found


def _quoted(value: str) -> str:
    """A value of a pgbouncer database entry, quoted as libpq's key=value form is."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Pgbouncer:
    """One pgbouncer process in transaction mode in front of the server of ``server_dsn``."""

    def __init__(self, server_dsn: str, *, connect_query: str | None = CONNECT_QUERY, pool_size: int = 20,
                 max_clients: int = 500) -> None:
        program = binary()
        if program is None:
            raise RuntimeError(SKIP_REASON)
        self._program = program
        self._server = psycopg.conninfo.conninfo_to_dict(server_dsn)
        self._connect_query = connect_query
        self._pool_size = pool_size
        self._max_clients = max_clients
        self.port = _free_port()
        self._dir = Path(tempfile.mkdtemp(prefix="pgflow-pgbouncer-"))
        self._dir.chmod(0o755)  # pgbouncer drops to nobody when started as root, and reads its ini then
        self._ini = self._dir / "pgbouncer.ini"
        self._log = self._dir / "pgbouncer.log"
        self._process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("this pgbouncer was not started")
        return self._process.pid

    def dsn(self, dsn: str) -> str:
        """``dsn`` pointed at this pgbouncer (same database and user)."""
        params = psycopg.conninfo.conninfo_to_dict(dsn)
        params.pop("hostaddr", None)
        return psycopg.conninfo.make_conninfo("", **{**params, "host": "127.0.0.1", "port": str(self.port)})

    def _write_ini(self) -> None:
        target = {name: str(self._server[name]) for name in ("host", "port", "user", "password")
                  if self._server.get(name)}
        if self._connect_query:
            target["connect_query"] = self._connect_query
        entry = " ".join(f"{name}={_quoted(value)}" for name, value in target.items())
        self._ini.write_text(
            "[databases]\n"
            f"* = {entry}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = any\n"  # every client logs in as the entry's user
            "pool_mode = transaction\n"
            f"default_pool_size = {self._pool_size}\n"
            f"max_client_conn = {self._max_clients}\n"
            "server_login_retry = 1\n"
            "idle_transaction_timeout = 10\n"
            "log_connections = 0\n"
            "log_disconnections = 0\n")
        self._ini.chmod(0o644)

    def start(self) -> None:
        """Start it and wait until it accepts connections (and passes one to the server)."""
        if self._process is not None and self._process.poll() is None:
            raise RuntimeError("this pgbouncer is already running")
        self._write_ini()
        args = [self._program]
        if os.geteuid() == 0:
            args += ["-u", "nobody"]  # pgbouncer refuses to run as root
        log = self._log.open("ab")
        try:
            self._process = subprocess.Popen([*args, str(self._ini)], stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        self.starts += 1
        deadline = time.monotonic() + READY_WITHIN
        dsn = self.dsn(psycopg.conninfo.make_conninfo("", **self._server))
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"pgbouncer exited with {self._process.returncode}:\n{self.output()}")
            try:
                with psycopg.connect(dsn, connect_timeout=2, autocommit=True, prepare_threshold=None) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"pgbouncer did not accept connections within {READY_WITHIN} s:\n"
                                       f"{self.output()}") from None
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: every client and server connection it held is cut at once."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL)
            self._process.wait(timeout=30)

    def restart(self) -> None:
        """Killed, then started again on the same port."""
        self.kill()
        self.start()

    def stop(self) -> None:
        """Stopped (SIGTERM, then SIGKILL) and its directory removed. Idempotent."""
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    def output(self) -> str:
        try:
            return self._log.read_text(errors="replace")
        except OSError:
            return ""

    def __enter__(self) -> Pgbouncer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
