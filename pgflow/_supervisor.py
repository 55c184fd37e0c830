"""``pgflow worker --processes N``: run N worker processes, restart the ones that die, stop them all.

Each child runs ``pgflow worker`` with the same arguments in a session of its own, so a Ctrl-C at the
terminal reaches only the supervisor, which passes it on. A child that exits on its own is restarted
after a wait that doubles with each exit in a row (``Backoff``) and starts over once a child of that
slot has lived ``reset_after`` seconds; the other children serve on meanwhile. A child that reports a
usage error (exit 2) stops everything, since a restart cannot fix it.

A SIGTERM or SIGINT (the first) is passed on to every child as a SIGTERM, which drains it; a second
one stops them now. The supervisor's exit code is the worst of the codes of the children it stopped:
0 when each drained cleanly, whatever state each was in. A child that was waiting to be restarted is
not started again and does not count (its exit was dealt with when it happened), and neither does a
SIGTERM death, which only a child that was starting or leaving (no handler yet, or no more: it held
no workflow) dies of.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType

log = logging.getLogger("pgflow.supervisor")

EXIT_USAGE = 2
TICK = 0.1  # seconds between the supervisor's looks at its children and the signals it received


@dataclass(frozen=True)
class Backoff:
    """The wait before restarting a child that exited on its own: ``first`` after one exit, doubling
    with each exit in a row up to ``most``; a child that lives ``reset_after`` seconds starts the count
    over. Small on purpose: a slot waiting is a worker down, and one crash in a while (an OOM kill)
    should cost a second, while a child that cannot start at all does not spin."""

    first: float = 1.0
    most: float = 10.0
    reset_after: float = 30.0

    def wait(self, exits_in_a_row: int) -> float:
        return float(min(self.most, self.first * 2 ** max(0, exits_in_a_row - 1)))


class _Slot:
    """One of the N places a child runs in: its current child, when that started, how many children
    in a row exited on their own, and when the next one starts (while it waits to restart)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.child: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.exits_in_a_row = 0
        self.restart_at: float | None = None


class Supervisor:
    def __init__(self, worker_args: Sequence[str], processes: int, backoff: Backoff = Backoff(),
                 log_level: str | None = None) -> None:
        level = ["--log-level", log_level] if log_level else []
        self._command = [sys.executable, "-m", "pgflow", *level, "worker", *worker_args]
        self._slots = [_Slot(index) for index in range(processes)]
        self._backoff = backoff
        self._signals: list[int] = []  # appended by the handler; everything else happens in the loop

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append(signum)

    def run(self) -> int:
        """Supervise until a signal, or a child's usage error; the exit code (see the module)."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            log.info("supervisor %s running %d worker processes (a restart waits %gs, doubling to %gs;"
                     " the wait starts over once a process has lived %gs)", os.getpid(), len(self._slots),
                     self._backoff.first, self._backoff.most, self._backoff.reset_after)
            for slot in self._slots:
                self._spawn(slot)
            code = self._watch()
            if code is None:
                log.info("received %s: stopping the worker processes", signal.Signals(self._signals[0]).name)
            return self._stop(code or 0)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _spawn(self, slot: _Slot) -> None:
        slot.child = subprocess.Popen(self._command, start_new_session=True)
        slot.started, slot.restart_at = time.monotonic(), None
        log.info("started worker process %d (pid %d)", slot.index, slot.child.pid)

    def _watch(self) -> int | None:
        """Keep every slot's child running until a signal (None) or a child's usage error (2)."""
        while not self._signals:
            now = time.monotonic()
            for slot in self._slots:
                if self._look(slot, now) == EXIT_USAGE:
                    return EXIT_USAGE
            time.sleep(TICK)
        return None

    def _look(self, slot: _Slot, now: float) -> int | None:
        """One look at a slot: start its child when its wait is over, count a long life, and deal
        with an exit. Returns the child's code when it exited with a usage error."""
        if slot.child is None:
            if slot.restart_at is not None and now >= slot.restart_at:
                self._spawn(slot)
            return None
        lived = now - slot.started
        if lived >= self._backoff.reset_after:
            slot.exits_in_a_row = 0
        code = slot.child.poll()
        if code is None:
            return None
        if code == EXIT_USAGE:
            log.error("worker process %d exited with a usage error (2); stopping", slot.index)
            slot.child = None
            return EXIT_USAGE
        slot.exits_in_a_row += 1
        wait = self._backoff.wait(slot.exits_in_a_row)
        log.warning("worker process %d (pid %d) exited with %d after %.1fs; restarting in %.2fs (exit %d in a row)",
                    slot.index, slot.child.pid, exit_code(code), lived, wait, slot.exits_in_a_row)
        slot.child, slot.restart_at = None, now + wait
        return None

    def _stop(self, code: int) -> int:
        """Pass the signal on as a SIGTERM to every child that runs, and each later signal too (the
        second stops them now); wait for them all. The worst of their codes, and ``code``."""
        stopping = []
        for slot in self._slots:
            slot.restart_at = None  # a slot waiting to restart stays empty
            if slot.child is not None and slot.child.poll() is None:
                stopping.append(slot.child)
            elif slot.child is not None:  # exited just now, unseen: as good as waiting to restart
                log.warning("worker process %d (pid %d) had exited with %d", slot.index, slot.child.pid,
                            exit_code(slot.child.returncode))
        forwarded = 0
        while True:
            running = [child for child in stopping if child.poll() is None]
            if not running:
                break
            if forwarded < max(1, len(self._signals)):
                forwarded += 1
                if forwarded > 1:
                    log.warning("received a signal again: stopping the worker processes now")
                for child in running:
                    child.send_signal(signal.SIGTERM)
            time.sleep(TICK)
        return max([code, *(_stopped_code(child.returncode) for child in stopping)])


def _stopped_code(returncode: int) -> int:
    """A stopped child's code as it counts for the supervisor: a SIGTERM death is a child that had no
    handler yet, or none any more (starting, or leaving after its drain), so held no workflow."""
    return 0 if returncode == -signal.SIGTERM else exit_code(returncode)


def exit_code(returncode: int) -> int:
    """A child's returncode as a shell reports it: one killed by signal N (``-N``) is 128 + N.

    Left negative, a child killed by SIGKILL (out of memory, a kill -9 during the drain) would rank
    below a clean exit in ``supervise``, and the supervisor would report the fleet stopped cleanly
    when that child's workflows were cut short."""
    return 128 - returncode if returncode < 0 else returncode


def supervise(worker_args: Sequence[str], processes: int, backoff: Backoff = Backoff(),
              log_level: str | None = None) -> int:
    """Run ``processes`` workers until a signal; the exit code is the worst of the children's."""
    return Supervisor(worker_args, processes, backoff, log_level).run()
