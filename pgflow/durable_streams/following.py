"""A live reader's place in a free-standing stream (an SSE answer): woken by the pings of its stream
and by the slow poll, and handed what this process appends to it.

After a batch of appends commits, ``FreeStreamsAccess.publish`` hands each append to the followers of
its stream in this process (the stream as the append left it, and the units it wrote), then pings the
stream's key as before, which wakes them (that wake is known for the hand's own). A follower woken only
by such hands, each of whose appends
begins where the one before ended and the first where the reader is, has in hand exactly what a read
of the table from its position would find, up to the last of them: it needs no query. Any other wake
(a ping from another process, the slow poll, a delete, a listener that reconnected), an append that
does not follow on, or more than one answer's worth, and it reads the table, the only truth, as every
reader did before. (Streams with a TTL or an expiry time are always read: a read moves a sliding TTL
on, and finds an expired stream gone.)

The follower stays registered for the answer's whole life, armed again before each look, so a ping
that comes while the reader is busy sending is not lost, and a reader that keeps up costs one look per
wake rather than a second one to close the gap a new registration left.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from .._core.engine.free_appends import Appended
from .._core.engine.free_streams import Chunk, FreeStream, base_type
from .._core.signals import PollTicks, Waiters


class Follower:
    """One live reader's wakes and hands (see the module's docstring); ``take`` re-arms it."""

    __slots__ = ("_loop", "_woken", "_ticks", "_foreign", "_handed", "_telling")

    def __init__(self, ticks: PollTicks) -> None:
        self._loop = asyncio.get_running_loop()
        self._ticks = ticks
        self._woken: asyncio.Future[None] = self._loop.create_future()
        self._woken.set_result(None)
        self._foreign = 1  # wakes that came with no hand: the first look reads the table (no ping was heard before)
        self._handed: list[Appended] = []
        self._telling = False

    def wake(self) -> None:
        """A ping of the stream, the slow poll, or a listener that reconnected (not foreign between
        ``handed`` and ``told``: the ping of the appends handed)."""
        if not self._telling:
            self._foreign += 1
        if not self._woken.done():
            self._woken.set_result(None)

    def hand(self, stream_id: int, position: int, value: bytes | None) -> None:
        """(A workflow stream's chunk carried by news: never this stream's.)"""
        self.wake()

    def handed(self, dones: list[Appended]) -> bool:
        """Appends this process committed to the stream, in order; the wakes until ``told`` are their
        own ping. (True: for a comprehension's filter.)"""
        self._handed += dones
        self._telling = True
        if not self._woken.done():
            self._woken.set_result(None)
        return True

    def told(self) -> None:
        self._telling = False

    async def wait(self, timeout: float) -> bool:
        """Until woken since the last ``take`` (at once if it was), or by the slow poll; False when
        ``timeout`` seconds passed first."""
        woken = self._woken
        if not woken.done():
            self._ticks.add(self)
            expiry = self._loop.call_later(timeout, _expire, woken)
            try:
                await woken
            finally:
                expiry.cancel()
        return self._foreign > 0 or bool(self._handed)

    def take(self, position: int, rows: int, budget: int) -> tuple[FreeStream, list[Chunk]] | None:
        """Re-arm; what the hands since the last ``take`` bring from ``position`` on, when they alone
        woke it, follow on from there, and fit in one answer (``rows`` chunks, ``budget`` bytes);
        else None: read the table."""
        handed, foreign = self._handed, self._foreign
        self._handed, self._foreign = [], 0
        if self._woken.done():
            self._woken = self._loop.create_future()
        if foreign > 0 or not handed:
            return None
        chunks: list[Chunk] = []
        at, used = position, 0
        stream: FreeStream | None = None
        for done in handed:
            stream = done.stream
            if stream is None or stream.ttl is not None or stream.expires_at is not None:
                return None
            sizes = [1 for _ in done.units] if base_type(stream.content_type) == "application/json" \
                else [len(unit) for unit in done.units]
            start = stream.tail - sum(sizes)
            if start < at:  # (already read: a look at the table came after its commit)
                if stream.tail > at:
                    return None  # (partly read: only the table knows where the reader's chunk begins)
                continue
            if start > at:  # what came between was not appended here
                return None
            for unit, size in zip(done.units, sizes, strict=True):
                chunks.append(Chunk(at, at + size, stream.tail, unit))
                at += size
                used += len(unit)
        if stream is None or len(chunks) > rows or used > budget:
            return None
        return stream, chunks


def _expire(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)


@contextlib.contextmanager
def following(followers: dict[str, set[Follower]], waiters: Waiters, path: str, key: str) -> Iterator[Follower]:
    """A follower of the stream at ``path`` (pinged on ``key``) for the block."""
    follower = Follower(waiters.ticks)
    followers.setdefault(path, set()).add(follower)
    waiters.add(key, follower)
    try:
        yield follower
    finally:
        waiters.remove(key, follower)
        mine = followers.get(path)
        if mine is not None:
            mine.discard(follower)
            if not mine:
                del followers[path]
