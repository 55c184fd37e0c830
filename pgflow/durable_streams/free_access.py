"""How the free-stream handlers reach pgflow's tables: statements per store, batches, pings.

What the read path (``free_reads``) and the write path (``free_writes``) share: ``db`` runs statements
of ``FreeStreams`` on the app's runtime; appends go through a ``Batcher`` (group commit), reads of a
stream's chunks through another (shared reads); after an append commits, it is handed to the live
readers of its stream in this process (``publish``, ``following``) and its stream's key is pinged
(``ping_key``), so that readers waiting on it anywhere in the fleet look again.
"""

from __future__ import annotations

import base64
import hashlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from .._core.engine.free_appends import Append, Appended
from .._core.engine.free_streams import Chunk, FreeStream, FreeStreams
from .._core.signals import News
from ..app import App
from .batching import Batcher
from .following import Follower
from .overtaking import Overtaking, in_sequence_order

T = TypeVar("T")
log = logging.getLogger("pgflow.durable_streams")
READ_ROWS = 1000  # rows of one answer, at most
READ_BYTES = 1024 * 1024  # bytes of one answer, at most (its first chunk whatever its size)
BATCH = 256  # appends in one transaction, at most
_KEY_PERSON = b"pgflow.freestrm"


def ping_key(path: str) -> str:
    """The signal key of a free stream: a digest, so a payload does not carry the path."""
    digest = hashlib.blake2b(path.encode("utf-8", "surrogateescape"), digest_size=12, person=_KEY_PERSON).digest()
    return "fs:" + base64.b64encode(digest).decode()


class FreeStreamsAccess:
    """The tables, for the handlers; ``long_poll`` seconds a long-poll waits, ``max_body`` bytes an append
    may carry."""

    def __init__(self, app: App, long_poll: float, max_body: int) -> None:
        self.app = app
        self.long_poll = long_poll
        self.max_body = max_body
        self.appends: Batcher[Append, Appended] = Batcher(self._append_many, BATCH)
        self.reads: Batcher[tuple[str, int], tuple[FreeStream | None, list[Chunk]]] = Batcher(self._read_many, BATCH)
        self.followers: dict[str, set[Follower]] = {}  # the live readers of this process, by path
        self.overtaking = Overtaking(self.appends.submit)  # producers' appends, in their order

    async def _append_many(self, given: list[Append]) -> list[Appended | Exception]:
        runtime = self.app._internals().runtime()
        await runtime.store()  # (the signals service is configured once the store is open)
        signals = runtime.signals
        order = in_sequence_order(given)  # (a producer's appends that overtook each other: see overtaking)
        appends = [given[i] for i in order]
        news = News(sorted({ping_key(append.path) for append in appends}))
        judged, rode = await runtime.db(lambda store: signals.ride(
            news, lambda pings: store.free_streams.append_many(appends, pings)))
        results: list[Appended | Exception] = list(judged)
        for i, done in zip(order, judged, strict=True):
            results[i] = done
        try:  # (committed: told even if its client left; a failure here must not make the batch run again)
            self.publish([(append.path, done) for append, done in zip(appends, judged, strict=True)
                          if isinstance(done, Appended) and done.outcome == "ok"], rode)
        except Exception:  # noqa: BLE001 - readers still find it on the slow poll
            log.exception("durable streams: telling the readers of a committed batch failed")
        return results

    def publish(self, written: list[tuple[str, Appended]], rode: bool) -> None:
        """Appends committed (with their pings, when ``rode``): handed to this process's live readers of
        their streams (``following``), who are then woken with the rest of this process's waiters by
        the pings of those streams, which go to every other process too if they did not ride."""
        by_path: dict[str, list[Appended]] = {}
        for path, done in written:
            by_path.setdefault(path, []).append(done)
        followers = [f for path, dones in by_path.items() for f in self.followers.get(path, ()) if f.handed(dones)]
        try:
            self.app._internals().runtime().signals.told(News(sorted(ping_key(path) for path in by_path)), rode)
        finally:
            for follower in followers:
                follower.told()

    async def _read_many(self, asks: list[tuple[str, int]]) -> list[tuple[FreeStream | None, list[Chunk]] | Exception]:
        return list(await self.db(lambda s: s.read_many(asks, READ_ROWS, READ_BYTES)))

    async def db(self, fn: Callable[[FreeStreams], Awaitable[T]]) -> T:
        runtime = self.app._internals().runtime()

        return await runtime.db(lambda store: fn(store.free_streams))

    def ping(self, path: str) -> None:
        self.app._internals().runtime().signals.announce(News([ping_key(path)]))
