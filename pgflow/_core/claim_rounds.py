"""One claim round of a worker over all its queues, and when its claim loop looks again.

Apart from ``worker.py``, which decides when to claim and what to run: this is what a round takes and
what it learns, from the store alone. The queues without limits are claimed in one statement; each
rate- or concurrency-limited queue apart, since its limits are its own, while slots stay free.
"""

from __future__ import annotations

from .engine import Engine
from .engine.claimed import Claimed, Round


async def claim_round(store: Engine, owner: str, unlimited: list[str], limited: list[str], names: list[str],
                      free: int, lease: float) -> Round:
    """Claim up to ``free`` from the queues; also say when the next delayed workflow falls due, when a
    rate-limited queue's bucket next has a token, and whether suspects wait (None: no full claim
    looked; each that did tells, and one that saw some is enough)."""
    claimed: list[Claimed] = []
    due: float | None = None
    refill: float | None = None
    looked: list[bool] = []
    if unlimited:
        found = await store.claims.claim_round(owner, unlimited, names, free, lease)
        claimed, due = found.claimed, found.due
        looked += [] if found.suspects is None else [found.suspects]
    for queue in limited:
        if len(claimed) < free:
            more = await store.claims.claim_limited(owner, queue, names, free - len(claimed), lease)
            claimed += more.claimed
            due = _earliest(due, more.due)
            refill = _earliest(refill, more.refill)
            looked += [] if more.suspects is None else [more.suspects]
    return Round(claimed, due, any(looked) if looked else None, refill)


def next_look(poll: float, free: int, claimed: int, due: float | None, refill: float | None) -> float:
    """Seconds until the claim loop looks again (woken earlier by pings). At once when every
    free slot was filled (there may be more); when due workflows were left (others hold them, or
    a queue's limit does), at the poll, a ping (a limited queue's workflow finishing sends one)
    or a rate-limited queue's next token, not at once, which would spin."""
    if claimed == free:
        return 0.0
    wait = poll if due is None or due <= 0 else min(poll, due)
    return wait if refill is None else min(wait, refill)


def _earliest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)
