"""fleet.py's processes: the worker processes it measures, and the rest of the machine, whose CPU use
(another benchmark, a test suite) would skew every figure on a small shared machine."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.fleet_app import APP_TARGET


def descendants(root: int) -> list[int]:
    """``root`` and every live process below it (a pgflow supervisor's children run in sessions of their
    own, so a process group would miss them)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = harness.proc_stat(int(entry.name))
            if fields is not None:
                parents.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(parents.get(pid, []))
    return found


def wait_for_quiet(limit: float, threshold: float = 0.25) -> float:
    """Wait (up to ``limit`` seconds) until the machine is nearly idle, so a run does not start while
    something else (another benchmark, a test suite) holds the CPUs; return the busy share (of all
    cores) seen in the last half-second sample."""
    deadline = time.monotonic() + limit
    while True:
        b0, i0, s0 = harness.machine_cpu()
        time.sleep(0.5)
        b1, i1, s1 = harness.machine_cpu()
        share = (b1 - b0 + s1 - s0) / max(1e-9, b1 - b0 + i1 - i0 + s1 - s0)
        if share < threshold or time.monotonic() > deadline:
            return share


def _ours(pid: int) -> bool:
    """A live ``pgflow worker`` process of this benchmark (not a recycled pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"pgflow" in cmdline and APP_TARGET.encode() in cmdline


class Worker(harness.Proc):
    """A ``python -m pgflow worker`` process, or a supervisor and its children: those run in sessions of
    their own, out of reach of Proc's process group, so every process of the tree seen is remembered and
    killed at the stop if it is still one of ours."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log: Path,
                 profile: Path | None = None) -> None:
        super().__init__(name, [sys.executable, "-m", "pgflow", "worker", APP_TARGET, *args], env, log)
        self.known: set[int] = set()
        self.profiler = None if profile is None else harness.profiler(self.pid, profile, "--subprocesses")

    def tree(self) -> list[int]:
        pids = descendants(self.pid) if self.alive() else []
        self.known.update(pids)
        return pids

    def cpu(self) -> float:
        """CPU seconds used so far by the live processes of the tree."""
        return sum(harness.process_cpu(pid) for pid in self.tree())

    def kill(self) -> float:
        """SIGKILL the process (a crash, not a stop: its children are left); return the time.time() of it."""
        t = time.time()
        os.kill(self.pid, signal.SIGKILL)
        self.popen.wait(10)
        return t

    def stop(self, wait: float = 15.0) -> None:
        """SIGTERM (the supervisor passes it on), then SIGKILL whatever of the tree is left."""
        self.tree()
        super().stop(wait)
        for pid in self.known - {self.pid}:
            if _ours(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        harness.stop_profiler(self.profiler)
