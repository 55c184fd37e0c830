"""Workflows that fail, or whose steps fail, run by worker processes for the failure-reporting tests.

See tests/apps/crashy.py for how the test process and the worker process share these definitions.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import anyio

import pgflow

from .crashy import GATE_POLL, note


class InputRejected(Exception):
    """A custom exception defined in the app module: the workflow catches it by its type."""


def validate_payload(n: int) -> None:
    """A plain function (not a step) the failing workflows call; its name must show in the traceback."""
    if n > 0:
        raise ValueError(f"bad input {n}")


def build(app: pgflow.App) -> SimpleNamespace:
    @app.workflow
    async def explode_async(n: int) -> int:
        validate_payload(n)
        return n

    @app.workflow
    def explode_sync(n: int) -> int:
        validate_payload(n)
        return n

    @app.step
    def reject(path: str, n: int) -> int:
        note(path, "reject")
        raise InputRejected(f"rejected {n}", n)

    @app.step
    async def hold_async(path: str, gate: str) -> str:
        note(path, "hold start")
        while not Path(gate).exists():
            await anyio.sleep(GATE_POLL)
        return "held"

    @app.step
    def hold_sync(path: str, gate: str) -> str:
        note(path, "hold start")
        while not Path(gate).exists():
            time.sleep(GATE_POLL)
        return "held"

    @app.workflow
    async def recover_async(path: str, gate: str, n: int) -> str:
        try:
            await reject(path, n)
        except InputRejected as exc:
            caught = f"caught {type(exc).__name__} {exc.args!r}"
        else:
            caught = "not raised"
        return caught + " " + await hold_async(path, gate)

    @app.workflow
    def recover_sync(path: str, gate: str, n: int) -> str:
        try:
            reject(path, n)
        except InputRejected as exc:
            caught = f"caught {type(exc).__name__} {exc.args!r}"
        else:
            caught = "not raised"
        return caught + " " + hold_sync(path, gate)

    return SimpleNamespace(
        reject=reject,
        hold={"async": hold_async, "sync": hold_sync},
        explode={"async": explode_async, "sync": explode_sync},
        recover={"async": recover_async, "sync": recover_sync},
    )


app = pgflow.App()  # env-configured; connects lazily, so only a worker process serving it connects
flows = build(app)
