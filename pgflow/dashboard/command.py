"""The ``pgflow dashboard`` subcommand: its options, and starting the server (imported only then, so
the command line works without the ``web`` extra for every other command)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..errors import ConfigurationError

TOKEN_ENV = "PGFLOW_DASHBOARD_TOKEN"


def add_parser(commands: Any) -> argparse.ArgumentParser:
    sub: argparse.ArgumentParser = commands.add_parser(
        "dashboard", help="serve a web dashboard: queues, workers, workflows, their steps and live streams")
    sub.add_argument("--app", dest="app_target", metavar="MODULE:APP",
                     help="the App (default: PGFLOW_DSN / PGFLOW_SCHEMA, else the embedded server)")
    sub.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    sub.add_argument("--port", type=int, default=8080, help="port to listen on (default: %(default)s)")
    sub.add_argument("--token", default=None,
                     help=f"ask every request for this token (bearer header or login form); default: ${TOKEN_ENV}")
    sub.add_argument("--allow-actions", action="store_true",
                     help="offer cancel, resume and fork (off unless given)")
    return sub


def options(args: argparse.Namespace) -> tuple[str, int, str | None, bool]:
    """(host, port, token, actions), checked before anything starts."""
    from .access import Access

    token = args.token if args.token is not None else (os.environ.get(TOKEN_ENV) or None)
    if not 0 < args.port < 65536:
        raise ConfigurationError(f"--port is from 1 to 65535, got {args.port}")
    try:
        Access(token)
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from None
    if token is None and not _loopback(args.host):
        raise ConfigurationError(
            f"--host {args.host} lets other machines in: give a --token (or ${TOKEN_ENV}), or serve on 127.0.0.1"
            " behind a reverse proxy that checks who comes in")
    return args.host, args.port, token, bool(args.allow_actions)


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(app: Any, args: argparse.Namespace) -> int:
    host, port, token, actions = options(args)
    try:
        from .server import serve
    except ImportError as exc:
        raise ConfigurationError(
            f"the dashboard needs Starlette and uvicorn: pip install 'pgflow[web]' ({exc})") from exc
    serve(app, host, port, token, actions)
    return 0
