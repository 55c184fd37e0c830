"""An app made, and used, before its process forks: what gunicorn ``--preload`` loads once in the master
(this module is also its WSGI application), and what the fork tests import in the parent.

The poll is a minute long, so a caller that hears of an end within seconds heard it by a ping."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from typing import Any

import pgflow
from tests.channel import identity

app = pgflow.App(poll_interval=60.0)


@app.workflow(name="forked.echo")
def echo(value: int) -> int:
    return value


if os.environ.get("PGFLOW_FORK_PRELOAD") == "1":
    app.migrate()  # used in the master: its loop thread, pool and keyring exist before the fork
    identity(app)


def application(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    """``/identity``: who this worker seals as. ``/echo?n``: a workflow started and its result
    waited for (a ``pgflow worker`` runs it)."""
    if environ["PATH_INFO"] == "/echo":
        value = int(environ.get("QUERY_STRING") or "0")
        body: dict[str, Any] = {"pid": os.getpid(), "result": echo.start(value).result(timeout=30)}
    else:
        body = identity(app)
    start_response("200 OK", [("Content-Type", "application/json")])
    return [json.dumps(body).encode()]
