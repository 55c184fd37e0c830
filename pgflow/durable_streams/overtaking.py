"""Appends of an idempotent producer that overtook an earlier one of its own on the way here.

A producer that keeps several batches in flight (the official clients keep up to five, each on a
connection of its own) sends its sequence numbers in order, but they need not arrive in order: a batch
on a slower connection is overtaken by the next. Answered at once, the overtaker is a 409 (a gap); the
client waits for the earlier batches, sends it again, and its readers see it a round trip late. Under
load that turns into a storm, since the overtaker's successors are refused too and all of them are
sent again together, in no particular order, measured at a third of all POSTs at 2,000 messages/s.

So the server puts right what the network mixed up, as a reader of the protocol would expect from
sequence numbers: the appends of one producer to one stream that a group commit takes together are
judged in their sequence order (``in_sequence_order``), and an append whose predecessor has not come
yet waits for it, judged again whenever its stream is appended to (the pings of the stream, from this
process or another server of the fleet), for up to ``HOLD`` seconds (``Overtaking``; a gap far ahead
is not held). Only a gap still there after that is answered with the 409. Nothing is written before
the predecessor: the wait changes when an append is judged, never how.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from .._core.engine.free_appends import Append, Appended
from .._core.signals import Waiters

HOLD = 1.0  # seconds an overtaker waits for the append it overtook
AHEAD = 16  # an append further ahead of the one expected overtook nothing: it is a 409 at once
MOST_HELD = 1000  # overtakers waiting at once in one process, at most (the others: a 409 at once)


class Overtaking:
    """The appends of idempotent producers as ``submit`` judges them (in a group commit), in order:
    an overtaker is judged again on every append to its stream (its pings, from this process or another)
    while it is a gap, for up to ``hold`` seconds. Bounded, since each wake of a held append is a
    judging: only a gap of at most ``AHEAD`` is held, and at most ``most`` appends at once."""

    def __init__(self, submit: Callable[[Append], Awaitable[Appended]], hold: float = HOLD,
                 most: int = MOST_HELD) -> None:
        self.submit = submit
        self.hold = hold
        self.most = most
        self.held = 0

    async def judged(self, append: Append, waiters: Waiters, key: str) -> Appended:
        done = await self.submit(append)
        producer = append.producer
        if (done.outcome != "gap" or producer is None or producer.seq - done.expected > AHEAD
                or self.held >= self.most):
            return done
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.hold
        self.held += 1
        try:
            with waiters.watching([key]) as pinged:
                while done.outcome == "gap" and (left := deadline - loop.time()) > 0:
                    pinged.arm()
                    done = await self.submit(append)  # (armed first: an append committed meanwhile wakes it)
                    if done.outcome == "gap":
                        await pinged.wait(left)
        finally:
            self.held -= 1
        return done


def in_sequence_order(appends: Sequence[Append]) -> list[int]:
    """The order in which to judge ``appends``: as given, except that each producer's appends to a stream
    (one epoch) take the places they hold among themselves in the order of their sequence numbers. A
    permutation of the positions (``order[i]`` is the append judged i-th)."""
    places: dict[tuple[str, str, int], list[tuple[int, int]]] = {}  # (seq, position), by producer
    for i, append in enumerate(appends):
        if (producer := append.producer) is not None:
            places.setdefault((append.path, producer.id, producer.epoch), []).append((producer.seq, i))
    order = list(range(len(appends)))
    for held in places.values():
        if len(held) > 1:
            for (_, place), (_, i) in zip(held, sorted(held), strict=True):
                order[place] = i
    return order
