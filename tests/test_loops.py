"""The event loop pgflow runs its own loops on (``pgflow/_core/loops.py``): a CLI worker on the loop
its ``--loop`` (or ``PGFLOW_LOOP``) names, uvloop by default where it is installed, and the sync API's
private loop likewise; a choice that cannot be had is a usage error, before anything connects. And the
CLI worker's process, set up once: what importing its app made is frozen out of the collector's sight."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys

import pytest

import pgflow
from pgflow._core.sync import LoopThread

from .helpers import ONE_SERVER
from .processes import Processes, wait_until

WAIT = 60.0


async def _kind() -> str:
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


async def _nothing() -> None:
    return None


@ONE_SERVER  # the process's event loop: the same on any server
@pytest.mark.parametrize(("given", "runs_on"), [(None, "uvloop"), ("uvloop", "uvloop"), ("asyncio", "asyncio")])
def test_a_cli_worker_runs_its_workflows_on_the_loop_it_is_given(
        procs: Processes, worker_env: dict[str, str], app: pgflow.App, given: str | None, runs_on: str) -> None:
    kind = app.workflow(name="probed.loop")(_kind)
    worker = procs.worker("w", "tests.apps.probed:app", worker_env, extra=["--loop", given] if given else [])
    assert kind.start().result(timeout=WAIT) == runs_on
    wait_until(lambda: f"loop {runs_on}" in worker.output(), "the start line to name the loop", procs, worker)


async def _frozen() -> int:
    return gc.get_freeze_count()


@ONE_SERVER  # the process's garbage collector: the same on any server
def test_a_cli_worker_freezes_what_importing_its_app_made(
        procs: Processes, worker_env: dict[str, str], app: pgflow.App) -> None:
    """So that a full collection in the middle of its work scans only what it made since (session 17 in
    benchmarks/README.md: a collection of the whole heap held every chunk of its moment for 21 ms)."""
    frozen = app.workflow(name="probed.frozen")(_frozen)
    procs.worker("w", "tests.apps.probed:app", worker_env)
    assert frozen.start().result(timeout=WAIT) > 10_000  # pgflow, psycopg, msgspec, the app: all of it
    assert gc.get_freeze_count() == 0  # (this process, which is no CLI worker, froze nothing)


@pytest.mark.parametrize(("argv", "env", "said"), [
    (["--loop", "tokio"], {}, "argument --loop: invalid choice: 'tokio'"),
    ([], {"PGFLOW_LOOP": "tokio"}, "pgflow: error: PGFLOW_LOOP is one of auto, uvloop, asyncio, got 'tokio'"),
])
def test_a_loop_that_does_not_exist_is_a_usage_error(argv: list[str], env: dict[str, str], said: str) -> None:
    result = subprocess.run([sys.executable, "-m", "pgflow", "worker", "no_such_module_here:app", *argv],
                            env={**os.environ, **env}, capture_output=True, text=True, timeout=WAIT)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert said in result.stderr.splitlines()[-1], result.stderr


@pytest.mark.parametrize(("given", "runs_on"), [(None, "uvloop"), ("asyncio", "asyncio")])
def test_the_sync_apis_private_loop_is_the_one_pgflow_loop_names(
        monkeypatch: pytest.MonkeyPatch, given: str | None, runs_on: str) -> None:
    if given is None:
        monkeypatch.delenv("PGFLOW_LOOP", raising=False)
    else:
        monkeypatch.setenv("PGFLOW_LOOP", given)
    thread = LoopThread("test-loop", _nothing)
    try:
        assert thread.run(_kind) == runs_on
    finally:
        thread.stop()
