"""The harness of the multi-process tests: worker processes that are always killed and reaped, and
waits on events other processes cause, bounded and failing early when a process they need has died."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

import pgflow

WAIT = 90.0  # seconds: the bound of every wait for something another process does
EXIT_WAIT = 45.0  # seconds a process that was told to stop gets before the test calls it stuck
LEASE = 2.0  # seconds: the lease of workers here, so a takeover comes soon


class Proc:
    """A child process whose stdout and stderr go to one log file, read back for failure messages."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], cwd: Path, log: Path) -> None:
        self.name = name
        self.args = args
        self.log = log
        with log.open("wb") as out:
            self.popen = subprocess.Popen(args, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                          stdout=out, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def describe(self) -> str:
        state = self.popen.poll()
        status = "running" if state is None else f"exit code {state}"
        return f"--- {self.name} (pid {self.pid}, {status}): {' '.join(self.args[1:])}\n{self.output()}"

    def signal(self, signum: int) -> None:
        self.popen.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL, and make sure it was that which ended the process."""
        self.popen.send_signal(signal.SIGKILL)
        assert self.wait_exit() == -signal.SIGKILL, self.describe()

    def wait_exit(self, timeout: float = EXIT_WAIT) -> int:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name} did not exit within {timeout}s\n{self.describe()}")

    def stop(self) -> None:
        """Kill (if still running; a stopped process dies too) and reap."""
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()


class Processes:
    """Starts child processes for one test and always kills and reaps them afterwards."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[Proc] = []

    def start(self, name: str, args: list[str], env: dict[str, str]) -> Proc:
        proc = Proc(name, [sys.executable, *args], env, self.tmp_path, self.tmp_path / f"{name}.log")
        self.started.append(proc)
        return proc

    def worker(self, name: str, target: str, env: dict[str, str], *, queues: str = "default",
               concurrency: int = 4, lease: float = LEASE, grace: float | None = None,
               extra: Sequence[str] = ()) -> Proc:
        """``python -m pgflow worker target`` (``grace`` None: the CLI's default)."""
        more = [*(["--grace", str(grace)] if grace is not None else []), *extra]
        return self.start(name, ["-m", "pgflow", "worker", target, "--queues", queues,
                                 "--concurrency", str(concurrency), "--lease", str(lease), *more], env)

    def logs(self) -> str:
        return "\n".join(proc.describe() for proc in self.started)

    def stop_all(self) -> None:
        for proc in self.started:
            proc.stop()


FLEET = "tests.apps.fleet:app"


def fleet_worker(procs: Processes, name: str, env: dict[str, str], **options: Any) -> Proc:
    """A worker process serving the fleet app (tests/apps/fleet.py), with a short drain unless a test
    says otherwise."""
    return procs.worker(name, FLEET, env, **{"grace": 5.0, **options})


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    processes = Processes(tmp_path)
    try:
        yield processes
    finally:
        processes.stop_all()


def _check_alive(what: str, procs: Processes, alive: tuple[Proc, ...], deadline: float, timeout: float) -> None:
    """Fail now if a process the wait needs has exited, or the wait is over its deadline."""
    for proc in alive:
        if proc.popen.poll() is not None:
            pytest.fail(f"{proc.name} exited while waiting for {what}\n{procs.logs()}")
    if time.monotonic() > deadline:
        pytest.fail(f"timed out after {timeout}s waiting for {what}\n{procs.logs()}")


def wait_until(condition: Callable[[], Any], what: str, procs: Processes, *alive: Proc,
               timeout: float = WAIT) -> Any:
    """Wait for an event another process causes; fail early if a process that must cause it died.
    Returns the condition's first truthy value."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        _check_alive(what, procs, alive, deadline, timeout)
        time.sleep(0.05)
    return value


async def wait_until_async(condition: Callable[[], Any], what: str, procs: Processes, *alive: Proc,
                           timeout: float = WAIT) -> Any:
    """``wait_until`` for a test whose own tasks (readers, say) must go on running while it waits."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        _check_alive(what, procs, alive, deadline, timeout)
        await anyio.sleep(0.02)
    return value


def result_of(handle: pgflow.WorkflowHandle[Any], procs: Processes, timeout: float = WAIT) -> Any:
    """``handle.result(timeout)``, with the workers' logs in the failure message if it does not succeed."""
    try:
        return handle.result(timeout=timeout)
    except TimeoutError:
        pytest.fail(f"{handle.id} not finished after {timeout}s (status {handle.status()})\n{procs.logs()}")
    except pgflow.WorkflowFailed as exc:
        pytest.fail(f"{exc}\n{exc.traceback}\n{procs.logs()}")


def failure_of(handle: pgflow.WorkflowHandle[Any], procs: Processes, timeout: float = WAIT) -> pgflow.WorkflowFailed:
    """The WorkflowFailed that ``handle.result`` raises; the test fails if it returns or times out."""
    try:
        value = handle.result(timeout=timeout)
    except pgflow.WorkflowFailed as exc:
        return exc
    except TimeoutError:
        pytest.fail(f"{handle.id} not finished after {timeout}s (status {handle.status()})\n{procs.logs()}")
    pytest.fail(f"{handle.id} succeeded with {value!r}, expected a failure\n{procs.logs()}")


def is_gone(pid: int) -> bool:
    """Whether process ``pid`` has ended and been reaped (by the supervisor, which restarts it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []


