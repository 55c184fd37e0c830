"""The ``pgflow dashboard`` subcommand: its options, and starting the server (imported only then, so
the command line works without the ``web`` extra for every other command).

The token is read from the environment or a file, since a command line is visible to every user of
the machine (``ps``, /proc); ``--token`` still works, with a warning that says so."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError

TOKEN_ENV = "PGFLOW_DASHBOARD_TOKEN"
HOSTS_ENV = "PGFLOW_DASHBOARD_ALLOWED_HOSTS"
HOW_TO_GIVE = f"set ${TOKEN_ENV} or give --token-file PATH"
MAX_TOKEN_FILE = 4096  # bytes: a token file holds one token


@dataclass(frozen=True)
class Options:
    """What the dashboard is started with, checked before anything starts."""

    host: str
    port: int
    token: str | None
    actions: bool
    allowed_hosts: tuple[str, ...]
    session_hours: float


def add_parser(commands: Any) -> argparse.ArgumentParser:
    sub: argparse.ArgumentParser = commands.add_parser(
        "dashboard", help="serve a web dashboard: queues, workers, workflows, their steps and live streams")
    sub.add_argument("--app", dest="app_target", metavar="MODULE:APP",
                     help="the App (default: PGFLOW_DSN / PGFLOW_SCHEMA, else the embedded server)")
    sub.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    sub.add_argument("--port", type=int, default=8080, help="port to listen on (default: %(default)s)")
    sub.add_argument("--token-file", metavar="PATH", default=None,
                     help=f"ask every request for the token in this file (bearer header or login form); default:"
                          f" ${TOKEN_ENV}")
    sub.add_argument("--token", default=None,
                     help=f"the token itself (visible to every local user in ps: prefer ${TOKEN_ENV} or --token-file)")
    sub.add_argument("--allowed-host", dest="allowed_hosts", action="append", metavar="HOST", default=None,
                     help="a name (or name:port) this dashboard answers to besides loopback and the --host address,"
                          f" e.g. the one a reverse proxy passes; repeatable (default: ${HOSTS_ENV}, comma-separated)")
    sub.add_argument("--session-hours", type=float, default=12.0,
                     help="how long a sign-in lasts (default: %(default)s)")
    sub.add_argument("--allow-actions", action="store_true",
                     help="offer cancel, resume and fork (off unless given; needs a token)")
    return sub


def options(args: argparse.Namespace) -> Options:
    """The options, checked before anything starts: ConfigurationError says what to change."""
    from .access import Access, Hosts, is_loopback

    token = _token(args)
    if not 0 < args.port < 65536:
        raise ConfigurationError(f"--port is from 1 to 65535, got {args.port}")
    try:
        Access(token, args.session_hours)
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from None
    if token is None and args.allow_actions:
        raise ConfigurationError(f"--allow-actions needs a token: {HOW_TO_GIVE}")
    if token is None and not is_loopback(args.host):
        raise ConfigurationError(
            f"--host {args.host} lets other machines in: give a token ({HOW_TO_GIVE}), or serve on 127.0.0.1"
            " behind a reverse proxy that checks who comes in")
    hosts = args.allowed_hosts
    if hosts is None:
        hosts = [h for h in os.environ.get(HOSTS_ENV, "").split(",") if h.strip()]
    try:
        Hosts(hosts, args.host)
    except ValueError as exc:
        raise ConfigurationError(f"--allowed-host: {exc}") from None
    return Options(args.host, args.port, token, bool(args.allow_actions), tuple(h.strip() for h in hosts),
                   args.session_hours)


def _token(args: argparse.Namespace) -> str | None:
    """The token from --token-file, --token or the environment, in that order; a token on the command
    line works but is said to be visible."""
    if args.token is not None and args.token_file is not None:
        raise ConfigurationError("give the token once: --token-file PATH or --token, not both")
    if args.token_file is not None:
        return _read_token(Path(args.token_file))
    if args.token is not None:
        print(f"pgflow: warning: --token is visible to every user of this machine (ps, /proc/<pid>/cmdline):"
              f" {HOW_TO_GIVE} instead", file=sys.stderr, flush=True)
        return str(args.token)
    return os.environ.get(TOKEN_ENV) or None


def _read_token(path: Path) -> str:
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_TOKEN_FILE + 1)
    except OSError as exc:
        raise ConfigurationError(f"--token-file {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_TOKEN_FILE:
        raise ConfigurationError(f"--token-file {path}: more than {MAX_TOKEN_FILE} bytes, not one token")
    try:
        token = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigurationError(f"--token-file {path}: not UTF-8 text") from None
    if not token or "\n" in token:
        raise ConfigurationError(f"--token-file {path}: holds {'no' if not token else 'more than one'} line;"
                                 " put the token alone in it")
    return token


def check_port(host: str, port: int) -> None:
    """Bind the address as the server will (uvicorn's family, SO_REUSEADDR) and let it go, before the
    URL is printed: a port another process holds is one line, not a URL that leads nowhere."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigurationError(f"cannot listen on {host}:{port}: {exc.strerror or exc}"
                                     " (another process holds the port? give another --port)") from None


def run(app: Any, args: argparse.Namespace) -> int:
    chosen = options(args)
    check_port(chosen.host, chosen.port)
    try:
        from .server import serve
    except ImportError as exc:
        raise ConfigurationError(
            f"the dashboard needs Starlette and uvicorn: pip install 'pgflow-durable[web]' ({exc})") from exc
    started = serve(app, chosen.host, chosen.port, chosen.token, chosen.actions, chosen.allowed_hosts,
                    chosen.session_hours)
    return 0 if started else 1  # (uvicorn said why it did not start)
