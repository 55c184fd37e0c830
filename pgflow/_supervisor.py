"""``pgflow worker --processes N``: run N worker processes, restart the ones that die, stop them all.

Each child runs ``pgflow worker`` with the same arguments in a session of its own, so a Ctrl-C at the
terminal reaches only the supervisor, which passes every SIGTERM or SIGINT on to its children: the first
drains them, a second stops them now. A child that exits on its own is restarted, with a growing delay
when it keeps dying young; a child that reports a usage error (exit 2) stops everything, since a
restart cannot fix it.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType

log = logging.getLogger("pgflow.supervisor")

EXIT_USAGE = 2
YOUNG = 10.0  # a child that dies sooner than this after starting is restarted with backoff


class Supervisor:
    def __init__(self, worker_args: Sequence[str], processes: int) -> None:
        self._command = [sys.executable, "-m", "pgflow", "worker", *worker_args]
        self._processes = processes
        self._children: dict[int, tuple[subprocess.Popen[bytes], float]] = {}
        self._signals: list[int] = []
        self._delay = [0.0] * processes

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append(signum)
        for child, _ in self._children.values():
            if child.poll() is None:
                child.send_signal(signum)

    def _spawn(self, slot: int) -> None:
        child = subprocess.Popen(self._command, start_new_session=True)
        self._children[slot] = (child, time.monotonic())
        log.info("started worker process %d (pid %d)", slot, child.pid)

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            for slot in range(self._processes):
                self._spawn(slot)
            code = self._watch()
            for child, _ in self._children.values():
                child.wait()
            return code
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _watch(self) -> int:
        restart_at: dict[int, float] = {}
        while not self._signals:
            now = time.monotonic()
            for slot, (child, started) in list(self._children.items()):
                code = child.poll()
                if code is None or slot in restart_at:
                    continue
                if code == EXIT_USAGE:
                    log.error("worker process %d exited with a usage error; stopping", slot)
                    self._on_signal(signal.SIGTERM, None)
                    return EXIT_USAGE
                young = now - started < YOUNG
                self._delay[slot] = min(30.0, max(1.0, self._delay[slot] * 2)) if young else 0.0
                log.warning("worker process %d (pid %d) exited with %d; restarting in %.0fs",
                            slot, child.pid, code, self._delay[slot])
                restart_at[slot] = now + self._delay[slot]
            for slot, when in list(restart_at.items()):
                if now >= when:
                    del restart_at[slot]
                    self._spawn(slot)
            time.sleep(0.2)
        return 0


def exit_code(returncode: int) -> int:
    """A child's returncode as a shell reports it: one killed by signal N (``-N``) is 128 + N.

    Left negative, a child killed by SIGKILL (out of memory, a kill -9 during the drain) would rank
    below a clean exit in ``supervise``, and the supervisor would report the fleet stopped cleanly
    when that child's workflows were cut short."""
    return 128 - returncode if returncode < 0 else returncode


def supervise(worker_args: Sequence[str], processes: int) -> int:
    """Run ``processes`` workers until a signal; the exit code is the worst of the children's."""
    supervisor = Supervisor(worker_args, processes)
    code = supervisor.run()
    codes = [exit_code(child.returncode) for child, _ in supervisor._children.values()]
    return max([code, *codes])
