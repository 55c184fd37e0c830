"""The event loop pgflow runs its own loops on: a worker started by ``pgflow worker``, and the private
loop of the sync API. uvloop where it is installed (a dependency on Linux and macOS), else asyncio's.

A no-op workflow's path through a worker is mostly the event loop's own Python (call_soon, timers,
the selector): with uvloop, whose loop is compiled, a worker spends about a quarter fewer instructions
per workflow (benchmarks/README.md). An application's own loop stays the application's choice: its
async calls run on whatever loop it runs.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from typing import Any, Literal

from ..errors import ConfigurationError

Choice = Literal["auto", "uvloop", "asyncio"]
CHOICES: tuple[Choice, ...] = ("auto", "uvloop", "asyncio")


def uses_uvloop(choice: Choice) -> bool:
    """Whether ``choice`` means uvloop here; "uvloop" where it is not installed says what to do."""
    installed = importlib.util.find_spec("uvloop") is not None
    if choice == "uvloop" and not installed:
        raise ConfigurationError("the uvloop event loop was asked for but is not installed here:"
                                 " pip install uvloop, or choose --loop asyncio")
    return choice != "asyncio" and installed


def backend_options(choice: Choice) -> dict[str, Any]:
    """``anyio.run``'s backend options for ``choice``."""
    return {"use_uvloop": uses_uvloop(choice)}


def from_environment() -> Choice:
    """The loop ``PGFLOW_LOOP`` names (default auto), checked."""
    choice = os.environ.get("PGFLOW_LOOP", "auto")
    if choice not in CHOICES:
        raise ConfigurationError(f"PGFLOW_LOOP is one of {', '.join(CHOICES)}, got {choice!r}")
    return choice


def new_event_loop(choice: Choice) -> asyncio.AbstractEventLoop:
    if uses_uvloop(choice):
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def running() -> str:
    """The running loop's kind, for a worker's start line: "uvloop" or "asyncio"."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
