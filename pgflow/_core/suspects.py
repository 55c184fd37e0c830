"""Suspects of a crash, run alone (see migration 0028).

A full claim rescues the workflows whose lease expired because their worker died. Those are
suspects: one of them may have killed its worker, and nothing tells which. So each is run again
alone: a worker that learns that suspects wait stops claiming, and once it runs nothing it claims one
suspect and nothing beside it until that run ends. A crash then kills only the suspect's run, and is
charged to it alone.

Apart from ``worker.py`` because it is a state of its own that the claim loop consults: whether
suspects wait (as the last full claim saw), and the one the worker runs alone now. The worker tells
it what its claims saw and which runs ended, and asks it whether to claim, and what.
"""

from __future__ import annotations

import logging

import anyio
import psycopg

from .engine import Claimed, Engine

log = logging.getLogger("pgflow.worker")


class Suspects:
    """A worker's view of the suspects of a crash, and its run alone of one of them."""

    def __init__(self) -> None:
        self.wait = False  # suspects wait to be run alone (as the last full claim saw)
        self.alone: str | None = None  # the one the worker runs alone now: while it runs, nothing else is claimed

    @property
    def draining(self) -> bool:
        """Nothing beside a suspect, and nothing new while suspects wait for the worker to empty (its
        claims then take none, but still rescue expired leases and look for suspects)."""
        return self.alone is not None or self.wait

    def due(self, running: bool) -> bool:
        """Whether to claim one suspect now: some wait, and the worker runs nothing."""
        return self.wait and self.alone is None and not running

    def saw(self, suspects: bool | None) -> None:
        """What a claim round saw (None: no full claim looked) replaces what was known, unless a
        suspect runs alone."""
        if suspects is not None and self.alone is None:
            self.wait = suspects

    def ended(self, id: str) -> None:
        """The worker's runs of workflow ``id`` are over: when it ran alone, look for the next suspect,
        or claim as usual."""
        if self.alone == id:
            self.alone = None
            self.wait = True

    async def claim(self, store: Engine, worker: str, queues: list[str], names: list[str],
                    lease: float) -> Claimed | None:
        """Claim one suspect. None when the claim failed (suspects still wait) or found none left
        (then they wait no more)."""
        try:
            with anyio.CancelScope(shield=True):
                suspect = await store.claims.claim_suspect(worker, queues, names, lease)
        except (psycopg.Error, OSError) as exc:
            log.warning("claim of a suspect failed, trying again later: %s", exc)
            return None
        if suspect is None:
            self.wait = False
        return suspect

    def run_alone(self, worker: str, suspect: Claimed) -> None:
        """Note that ``suspect`` now runs alone: nothing is claimed beside it until it ends."""
        log.info("worker %s runs workflow %s alone: its worker died under it (%s)", worker, suspect.id,
                 f"{suspect.crashes} times while running it alone" if suspect.crashes else "beside others")
        self.alone = suspect.id
