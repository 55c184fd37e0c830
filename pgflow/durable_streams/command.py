"""The ``pgflow streams serve`` subcommand: the dashboard's rules for who may connect (loopback by
default; any other address needs a token, read from the environment or a file), then uvicorn."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..dashboard.access import WILDCARDS, Hosts, is_loopback
from ..dashboard.command import _read_token, check_port
from ..errors import ConfigurationError

TOKEN_ENV = "PGFLOW_STREAMS_TOKEN"
HOSTS_ENV = "PGFLOW_STREAMS_ALLOWED_HOSTS"
HOW_TO_GIVE = f"set ${TOKEN_ENV} or give --token-file PATH"


def add_parser(commands: Any, with_app: Any) -> argparse.ArgumentParser:
    streams = commands.add_parser("streams", help="Durable Streams over HTTP: workflows' streams and free ones")
    actions = streams.add_subparsers(dest="streams_command", required=True)
    serve = actions.add_parser("serve", help="serve the Durable Streams protocol (PUT, POST, GET, HEAD, DELETE)")
    serve.add_argument("--app", dest="app_target", metavar="MODULE:APP",
                       help="the App (default: PGFLOW_DSN / PGFLOW_SCHEMA, else the embedded server)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    serve.add_argument("--port", type=int, default=4437, help="port to listen on (default: %(default)s)")
    serve.add_argument("--token-file", metavar="PATH", default=None,
                       help=f"ask every request for the token in this file (Authorization: Bearer);"
                            f" default: ${TOKEN_ENV}")
    serve.add_argument("--token", default=None, help=f"the token itself (visible in ps: prefer ${TOKEN_ENV})")
    serve.add_argument("--allowed-host", dest="allowed_hosts", action="append", metavar="HOST", default=None,
                       help=f"a Host name this server answers to besides loopback and --host (default: ${HOSTS_ENV})")
    serve.add_argument("--cors-origin", dest="cors", action="append", metavar="ORIGIN", default=None,
                       help="a browser origin (https://app.example.com, or * for any) let in; repeatable")
    serve.add_argument("--long-poll-timeout", type=float, default=20.0,
                       help="seconds a long-poll waits for data (default: %(default)s)")
    result: argparse.ArgumentParser = serve
    return result


def run(app: Any, args: argparse.Namespace) -> int:
    token = _token(args)
    if not 0 < args.port < 65536:
        raise ConfigurationError(f"--port is from 1 to 65535, got {args.port}")
    if token is not None and len(token) < 16:
        raise ConfigurationError("the token must be at least 16 characters long")
    if token is None and not is_loopback(args.host):
        raise ConfigurationError(f"--host {args.host} lets other machines in: give a token ({HOW_TO_GIVE}),"
                                 " or serve on 127.0.0.1 behind a reverse proxy that checks who comes in")
    hosts = args.allowed_hosts
    if hosts is None:
        hosts = [h.strip() for h in os.environ.get(HOSTS_ENV, "").split(",") if h.strip()]
    try:
        Hosts(hosts, args.host)
    except ValueError as exc:
        raise ConfigurationError(f"--allowed-host: {exc}") from None
    if not 0 < args.long_poll_timeout <= 300:
        raise ConfigurationError("--long-poll-timeout is more than 0 and at most 300 seconds")
    check_port(args.host, args.port)
    try:
        from .._serving import serve_until_stopped
    except ImportError as exc:
        raise ConfigurationError(
            f"the streams server needs uvicorn: pip install 'pgflow-durable[web]' ({exc})") from exc
    from .server import asgi_app

    asgi = asgi_app(app, token=token, allowed_hosts=hosts, bind=args.host, cors=args.cors or (),
                    long_poll=args.long_poll_timeout)
    bound = [] if is_loopback(args.host) else ["any IP address"] if args.host in WILDCARDS else [args.host]
    print(f"pgflow streams on http://{args.host}:{args.port} (schema {app.schema!r};"
          f" {'token required' if token else 'no token'}; answers to"
          f" {', '.join(['loopback names', *bound, *hosts])})", flush=True)
    return 0 if serve_until_stopped(asgi, args.host, args.port) else 1  # (uvicorn said why it did not start)


def _token(args: argparse.Namespace) -> str | None:
    if args.token is not None and args.token_file is not None:
        raise ConfigurationError("give the token once: --token-file PATH or --token, not both")
    if args.token_file is not None:
        from pathlib import Path

        return _read_token(Path(args.token_file))
    if args.token is not None:
        print(f"pgflow: warning: --token is visible to every user of this machine: {HOW_TO_GIVE} instead",
              file=sys.stderr, flush=True)
        return str(args.token)
    return os.environ.get(TOKEN_ENV) or None
