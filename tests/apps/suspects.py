"""Workflows for the crash attribution and attempt tests, served by worker processes of their own.

``poison`` kills its worker process (SIGKILL from inside a step, as a segfault or the OOM killer
would) a moment after it starts, while ``innocent`` workflows run beside it in the same process (until
the test releases them).
``crash_once`` kills its worker the first time its step runs and succeeds after, so a test can read
every attempt count after one crash. Every step appends a line to a side-effect file the test passes
in, so the test counts how often each body really ran.

A worker process serves ``app`` (configured from PGFLOW_DSN and PGFLOW_SCHEMA); the test process calls
``build`` on its own App, so the names (module + qualname) match.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import SimpleNamespace

import anyio

import pgflow

LIMIT = 3  # max_attempts of the workflows here
RELEASE_WAIT = 90.0  # seconds an innocent workflow waits for its release at most


def note(path: str, line: str) -> None:
    """Append one line to the side-effect file; a line per call, flushed before returning."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def build(app: pgflow.App) -> SimpleNamespace:
    @app.step
    async def work(path: str, name: str, release: str) -> list[int]:
        """Runs until the test releases it (creates the file ``release``): still running beside the
        poison however long the machine took to start them all."""
        note(path, f"{name} start {os.getpid()} {pgflow.step_attempt()}")
        with anyio.fail_after(RELEASE_WAIT):
            while not Path(release).exists():
                await anyio.sleep(0.05)
        note(path, f"{name} done {os.getpid()}")
        return [pgflow.attempt(), pgflow.step_attempt()]

    @app.step
    async def kill_my_worker(path: str, after: float) -> None:
        note(path, f"poison start {os.getpid()} {pgflow.step_attempt()}")
        await anyio.sleep(after)  # its neighbours are running by now
        os.kill(os.getpid(), signal.SIGKILL)

    @app.workflow(max_attempts=LIMIT)
    async def innocent(path: str, name: str, release: str) -> list[int]:
        attempts: list[int] = await work(path, name, release)
        return attempts

    @app.workflow(max_attempts=LIMIT)
    async def poison(path: str, after: float) -> None:
        await kill_my_worker(path, after)

    @app.workflow
    async def poison_by_default(path: str, after: float) -> None:
        await kill_my_worker(path, after)

    @app.step
    def crash_first_time(path: str, marker: str) -> list[int]:
        note(path, f"crash_once start {os.getpid()} {pgflow.step_attempt()}")
        if not Path(marker).exists():
            Path(marker).touch()
            os._exit(1)  # noqa: SLF001 - the crash under test: no cleanup, no goodbye
        return [pgflow.attempt(), pgflow.step_attempt()]

    @app.workflow(max_attempts=LIMIT)
    def crash_once(path: str, marker: str) -> list[int]:
        attempts: list[int] = crash_first_time(path, marker)
        return attempts

    return SimpleNamespace(innocent=innocent, poison=poison, poison_by_default=poison_by_default,
                           crash_once=crash_once, work=work, kill_my_worker=kill_my_worker,
                           crash_first_time=crash_first_time)


app = pgflow.App()  # env-configured; connects lazily, so only a worker process serving it connects
flows = build(app)
