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
yet waits here for it, up to ``HOLD`` seconds, before it is judged again. Only a gap still there after
that is answered with the 409. Nothing is written before the predecessor: the wait changes when an
append is judged, never how.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence

from .._core.engine.free_appends import Append, Appended, Producer

HOLD = 1.0  # seconds an overtaker waits for the append it overtook
REMEMBERED = 4096  # (stream, producer) pairs whose last committed sequence number is kept


class Overtakers:
    """The producers' last committed sequence numbers in this process, and the appends waiting for one."""

    def __init__(self) -> None:
        self._last: OrderedDict[tuple[str, str], tuple[int, int]] = OrderedDict()
        self._waiting: dict[tuple[str, str], list[tuple[Producer, asyncio.Future[None]]]] = {}

    def committed(self, path: str, done: Appended, producer: Producer) -> None:
        """``producer``'s append to ``path`` committed, or was found there already: the producer's state
        is ``done``'s (the later one kept, as the server keeps it)."""
        key = (path, producer.id)
        state = (done.epoch, done.seq)
        if state < self._last.get(key, (-1, -1)):
            return
        self._last[key] = state
        self._last.move_to_end(key)
        if len(self._last) > REMEMBERED:
            self._last.popitem(last=False)
        waiting = self._waiting.get(key)
        if waiting:
            for producer_waiting, future in waiting:
                if self._arrived(key, producer_waiting) and not future.done():
                    future.set_result(None)

    async def wait(self, path: str, producer: Producer, hold: float = HOLD) -> None:
        """Until the append before ``producer``'s (same epoch, the sequence number before) has committed
        here, or ``hold`` seconds have passed."""
        key = (path, producer.id)
        if self._arrived(key, producer):
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (producer, future)
        self._waiting.setdefault(key, []).append(entry)
        try:
            await asyncio.wait_for(future, hold)
        except TimeoutError:
            pass
        finally:
            waiting = self._waiting[key]
            waiting.remove(entry)
            if not waiting:
                del self._waiting[key]

    def waiting(self) -> int:
        """How many appends wait for the one they overtook."""
        return sum(map(len, self._waiting.values()))

    def _arrived(self, key: tuple[str, str], producer: Producer) -> bool:
        """The append before ``producer``'s has committed (or a later epoch has: judged again, it is fenced)."""
        last = self._last.get(key)
        return last is not None and last >= (producer.epoch, producer.seq - 1)


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
