"""What a process forked from one that used pgflow must not share with its parent.

A fork copies memory, not threads: a child of a process that had made an App (gunicorn ``--preload``,
uWSGI's default, ``multiprocessing`` with fork, a prefork pool) inherits its sealing sender and nonce
counter, its event loop thread (which does not run in the child), its pools (whose sockets the parent
still uses) and its locks (perhaps held by a thread that is gone). Each object holding such state
registers here and is told of the fork in the child, before any code of the child runs, by
``os.register_at_fork``. A fork that skips Python's hooks (uWSGI forks from C) is caught by the same
objects comparing ``os.getpid()`` with the pid they were made in, on the paths that matter.

What a child inherits and must not use is kept here for the child's life, never closed: closing an
inherited connection would end the parent's session (libpq says goodbye on the shared socket).
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol


class ForkAware(Protocol):
    def forked(self) -> None:
        """Called in the child: start afresh, leaving what was the parent's untouched."""


_watched: weakref.WeakSet[ForkAware] = weakref.WeakSet()
_inherited: list[object] = []


def watch(obj: ForkAware) -> None:
    """Tell ``obj`` of every fork, in the child."""
    _watched.add(obj)


def keep_inherited(*objects: object) -> None:
    """Keep what the parent owns alive, unused, so that no finaliser of the child closes it."""
    _inherited.extend(obj for obj in objects if obj is not None)


def _after_fork_in_child() -> None:
    for obj in list(_watched):
        obj.forked()


os.register_at_fork(after_in_child=_after_fork_in_child)
