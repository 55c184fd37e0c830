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
process or another server of the fleet), for up to ``HOLD`` seconds (``judged_in_order``). Only a gap
still there after that is answered with the 409. Nothing is written before the predecessor: the wait
changes when an append is judged, never how.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from .._core.engine.free_appends import Append, Appended
from .._core.signals import Waiters

HOLD = 1.0  # seconds an overtaker waits for the append it overtook


async def judged_in_order(append: Append, submit: Callable[[Append], Awaitable[Appended]], waiters: Waiters,
                          key: str, hold: float = HOLD) -> Appended:
    """``append`` judged (``submit``: in a group commit); judged again on every append to its stream
    (``key``: its pings, from this process or another) while it is a gap, for up to ``hold`` seconds."""
    done = await submit(append)
    if done.outcome != "gap":
        return done
    loop = asyncio.get_running_loop()
    deadline = loop.time() + hold
    with waiters.watching([key]) as pinged:
        while done.outcome == "gap" and (left := deadline - loop.time()) > 0:
            pinged.arm()
            done = await submit(append)  # (armed first: an append that commits meanwhile wakes it)
            if done.outcome == "gap":
                await pinged.wait(left)
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
