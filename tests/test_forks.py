"""A process forked after its App was made and used (gunicorn ``--preload``, ``multiprocessing`` with
fork, a prefork pool such as Celery's) seals with a sender of its own, so no two processes ever use
one (key, nonce) pair, and siblings hear each other's pings: a caller in one child learns of an end
written by another in seconds, although the poll is a minute long."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import socket
import time
import traceback
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio.to_thread
import pytest

import pgflow
from tests.channel import identity
from tests.processes import WAIT, Processes, wait_until

CALLERS = 3
RESULT_WITHIN = 20.0  # seconds a caller waits for its result: a third of the poll


def fork(how: str, target: Callable[[], None]) -> Callable[[], int]:
    """Run ``target`` in a forked child, as ``multiprocessing`` does or as a prefork pool does (a bare
    ``os.fork`` and ``os._exit``, as billiard's workers); returns a wait for its exit code."""
    if how == "multiprocessing":
        process = multiprocessing.get_context("fork").Process(target=target)
        process.start()

        def joined() -> int:
            process.join(WAIT)
            return -1 if process.exitcode is None else process.exitcode

        return joined
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            target()
            code = 0
        except BaseException:  # noqa: BLE001 - reported through the exit code and stderr
            traceback.print_exc()
        finally:
            os._exit(code)

    def waited() -> int:
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        return -1

    return waited


@pytest.mark.parametrize("how", ["multiprocessing", "prefork"])
def test_forked_children_seal_apart_and_hear_each_other(dsn: str, schema: str, tmp_path: Path, how: str) -> None:
    app = pgflow.App(dsn, schema=schema, poll_interval=60.0)

    @app.workflow(name="forked.echo")
    def echo(value: int) -> int:
        return value

    app.migrate()  # used before the fork: its loop thread, its pool and its keyring exist
    parent = identity(app)
    stop = multiprocessing.get_context("fork").Event()

    def serve() -> None:
        (tmp_path / "worker.json").write_text(json.dumps(identity(app)))

        async def run() -> None:
            async with app.worker(concurrency=4):
                await anyio.to_thread.run_sync(stop.wait)

        asyncio.run(run())

    def call(n: int) -> None:
        began = time.monotonic()
        # Due in a second: the worker learns of it by this caller's ping, and this caller waits for its
        # end before it comes (by the worker's ping). A dropped ping costs the minute's poll.
        result = echo.with_options(delay=1.0).start(n).result(timeout=RESULT_WITHIN)
        (tmp_path / f"caller{n}.json").write_text(json.dumps(
            {**identity(app), "result": result, "seconds": time.monotonic() - began}))

    worker = fork(how, serve)
    try:
        callers = [fork(how, lambda n=n: call(n)) for n in range(CALLERS)]  # type: ignore[misc]
        codes = [wait() for wait in callers]
    finally:
        stop.set()
        worker_code = worker()
    app.close()
    assert codes == [0] * CALLERS, f"a caller failed (a result not heard of within {RESULT_WITHIN}s?): {codes}"
    assert worker_code == 0
    seen = [json.loads((tmp_path / f"caller{n}.json").read_text()) for n in range(CALLERS)]
    assert [s["result"] for s in seen] == list(range(CALLERS))
    # (result() looks once more when its timeout ends: a result that came then came by no ping)
    assert all(s["seconds"] < RESULT_WITHIN / 2 for s in seen), f"a result came late, by no ping: {seen}"
    everyone = [parent, json.loads((tmp_path / "worker.json").read_text()), *seen]
    assert len({s["pid"] for s in everyone}) == len(everyone)
    assert len({s["sender"] for s in everyone}) == len(everyone), "two processes seal as one sender"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=WAIT) as answer:  # noqa: S310 - a loopback URL of the test's
        return dict(json.loads(answer.read()))


def test_gunicorn_preload_workers_seal_apart(worker_env: dict[str, str], procs: Processes) -> None:
    port = _free_port()
    env = {**worker_env, "PGFLOW_FORK_PRELOAD": "1"}
    master = procs.start("gunicorn", ["-m", "gunicorn", "--preload", "--workers", "3",
                                      "--bind", f"127.0.0.1:{port}", "tests.apps.forked:application"], env)
    runner = procs.worker("worker", "tests.apps.forked:app", env)
    base = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        try:
            _get(base + "/identity")
        except OSError:
            return False
        return True

    wait_until(answers, "gunicorn answers", procs, master)
    by_pid: dict[int, str] = {}
    for _ in range(300):  # the kernel hands each connection to one of the three workers
        seen = _get(base + "/identity")
        by_pid[seen["pid"]] = seen["sender"]
        if len(by_pid) == 3:
            break
    assert len(by_pid) >= 2, f"only one gunicorn worker answered: {by_pid}"
    assert len(set(by_pid.values())) == len(by_pid), f"gunicorn workers seal as one sender: {by_pid}"
    for n in range(3):  # the sync API works in a worker forked after the master used it, at ping speed
        began = time.monotonic()
        assert _get(f"{base}/echo?{n}")["result"] == n
        assert time.monotonic() - began < 30, "the result came by the minute's poll, not by a ping"
    assert runner.alive(), runner.describe()
