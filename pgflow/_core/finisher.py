"""Group-committed workflow ends, one finisher per worker.

Recording an end is an UPDATE and a commit, and for short workflows it is most of their cost: a
worker running 16 no-ops at once would commit 16 times for 16 ends. So the ends of every execution
in a worker are gathered while earlier batches commit (two may be in flight) and written in one
statement, as stream chunks are, and each execution still awaits its own batch's commit before it
counts as finished. A batch's news rides on its commit when every end in it was recorded: the ends
themselves when they are small, so the caller waiting for one is answered without reading the row.
A batch with an end that was not recorded (its lease was lost) sends nothing with its commit: the
ends it did record are told through the notifier afterwards.

A batch that cannot be written because the server is away is tried again (``retrying``); past that,
every end in it fails as its single end would have, and the execution gives its workflow back. A
batch the server refuses for what one end holds is split until that end is alone, so it fails by
itself and the others are recorded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import psycopg

from .batches import GroupCommit
from .signals import End, News, Signals
from .signals import keys as signal_keys
from .signals.payload import carried_end
from .store import Store, retrying, unreachable


class _End:
    """An end waiting for its batch; ``recorded`` says whether the execution still owned it."""

    __slots__ = ("end", "lease", "keys", "carried", "done", "recorded", "failure")

    def __init__(self, end: End, lease: int, keys: set[str]) -> None:
        self.end = end
        self.lease = lease
        self.keys = keys
        self.carried = carried_end(end)  # small enough to ride in a payload
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.recorded = False
        self.failure: BaseException | None = None

    def resolve(self, recorded: bool = False, failure: BaseException | None = None) -> None:
        self.recorded = recorded
        self.failure = failure
        if not self.done.done():  # its execution may have been cancelled meanwhile
            self.done.set_result(None)


class Finisher(GroupCommit[_End]):
    """Group commit for the ends of every execution in one worker. ``queued`` is called when an end
    joins the queue (its workflow's slot is free), ``recorded`` with the size of each batch written."""

    drains = True  # the ends of workflows whose bodies are done: a stopping worker records them

    def __init__(self, store: Store, signals: Signals, queued: Callable[[], None] = lambda: None,
                 recorded: Callable[[int], None] = lambda ends: None, max_batch: int = 1000,
                 max_in_flight: int = 2) -> None:
        super().__init__(max_batch, max_in_flight)
        self._store = store
        self._signals = signals
        self._queued = queued
        self._recorded = recorded
        self.pending = 0  # ends queued or in a batch in flight: their workflows' bodies are done

    async def finish(self, end: End, lease: int, keys: set[str]) -> bool:
        """Record an end once its batch has committed; False when its claim (``lease``, the claim's
        token) no longer held the workflow. ``keys`` are told with it (besides the end itself)."""
        item = _End(end, lease, keys)
        self.pending += 1
        try:
            self._queued()  # its slot is free: the next claim may go out beside this end's batch
            await self._submit(item)
            await item.done
        finally:
            self.pending -= 1
        if item.failure is not None:
            raise item.failure
        return item.recorded

    async def _flush(self, batch: list[_End]) -> None:
        news = _news(batch)
        try:
            recorded, rode = await retrying(lambda: self._signals.ride(news, lambda pings: self._store.finish_many(
                [e.end.workflow_id for e in batch], [e.lease for e in batch], [e.end.status for e in batch],
                [e.end.output for e in batch], [e.end.error for e in batch], pings,
            )), f"recording the end of {len(batch)} workflows")
        except Exception as exc:  # noqa: BLE001 - given to the ends it concerns
            if not isinstance(exc, psycopg.Error) or unreachable(exc) or len(batch) == 1:
                for item in batch:
                    item.resolve(failure=exc)
                return
            middle = len(batch) // 2
            await self._flush(batch[:middle])
            await self._flush(batch[middle:])
            return
        self._recorded(len(batch))
        for item in batch:
            item.resolve(recorded=(item.end.workflow_id, item.lease) in recorded)
        if len(recorded) == len(batch):
            self._signals.told(news, rode)
        else:  # only what was recorded may be told, and it did not ride
            self._signals.announce(_news([item for item in batch if item.recorded]))


def _news(batch: list[_End]) -> News:
    """What a batch of ends tells: each end (or, for one too big to carry, its key) and the keys
    the executions asked to be told with it."""
    keys: set[str] = set().union(*(item.keys for item in batch))
    keys.update(signal_keys.ended(item.end.workflow_id) for item in batch if not item.carried)
    return News(sorted(keys), [item.end for item in batch if item.carried])
