"""Group-committed workflow ends, one finisher per worker.

Recording an end is an UPDATE and a commit, and for short workflows it is most of their cost: a
worker running 16 no-ops at once would commit 16 times for 16 ends. So the ends of every execution
in a worker are gathered while earlier batches commit (two may be in flight) and written in one
statement, as stream chunks are; a workflow counts as finished only once its batch has committed
(its log line, its count and its callers' news come after that commit). A batch's news rides on its
commit when every end in it was recorded: the ends themselves when they are small, so the caller
waiting for one is answered without reading the row. A batch with an end that was not recorded
(its lease was lost) sends nothing with its commit: the ends it did record are told through the
notifier afterwards.

A batch that cannot be written because the server is away is tried again (``retrying``); past that,
every end in it fails (logged: its lease runs out, and another worker runs the workflow again from
its journal). A batch the server refuses for what one end holds is split until that end is alone, so it fails by
itself and the others are recorded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .batches import GroupCommit, apart
from .engine import Engine, retrying
from .signals import End, News, Signals
from .signals import keys as signal_keys
from .signals.payload import carried_end

log = logging.getLogger("pgflow.execution")


Then = Callable[[bool, BaseException | None], None]  # told (recorded, failure) once the end's batch is done


class _End:
    """An end waiting for its batch, and what to do once the batch is done."""

    __slots__ = ("end", "lease_token", "keys", "carried", "then", "recorded")

    def __init__(self, end: End, lease_token: int, keys: set[str], then: Then) -> None:
        self.end = end
        self.lease_token = lease_token
        self.keys = keys
        self.carried = carried_end(end)  # small enough to ride in a payload
        self.then = then
        self.recorded = False

    def resolve(self, recorded: bool = False, failure: BaseException | None = None) -> None:
        self.recorded = recorded
        try:
            self.then(recorded, failure)
        except Exception:  # noqa: BLE001 - one end's bookkeeping must not stop the others'
            log.exception("after recording the end of %s", self.end.workflow_id)


class Finisher(GroupCommit[_End]):
    """Group commit for the ends of every execution in one worker. ``recorded`` is called with the
    size of each batch written.

    An execution hands its end over and is done (``finish_soon``): its task ends at once, and what
    follows the commit (the log line, the count, telling the callers) runs here, for the whole
    batch. (Each execution awaiting its own end, in a shielded scope, then waking up to log it, was a
    fifth of a no-op workflow's worker CPU.)"""

    drains = True  # the ends of workflows whose bodies are done: a stopping worker records them

    def __init__(self, store: Engine, signals: Signals, recorded: Callable[[int], None] = lambda ends: None,
                 max_batch: int = 1000, max_in_flight: int = 2) -> None:
        super().__init__(max_batch, max_in_flight)
        self._store = store
        self._signals = signals
        self._recorded = recorded
        self.pending = 0  # ends queued or in a batch in flight: their workflows' bodies are done

    def finish_soon(self, end: End, lease_token: int, keys: set[str], then: Then) -> bool:
        """Queue an end for the next batch; ``then(recorded, failure)`` is called once that batch is
        done (``recorded`` False: its claim, ``lease_token``, no longer held the workflow). ``keys`` are
        told with it. False when the finisher has stopped (the worker is stopping): ``finish`` then
        records it in the caller's task."""
        if self._stopped:
            return False
        self.pending += 1

        def done(recorded: bool, failure: BaseException | None) -> None:
            self.pending -= 1
            then(recorded, failure)

        self._put(_End(end, lease_token, keys, done))
        return True

    async def finish(self, end: End, lease_token: int, keys: set[str]) -> tuple[bool, BaseException | None]:
        """Record an end now, alone (for a worker whose finisher has stopped)."""
        answer: list[tuple[bool, BaseException | None]] = []
        await self._flush([_End(end, lease_token, keys, lambda recorded, failure: answer.append((recorded, failure)))])
        return answer[0]

    async def _flush(self, batch: list[_End]) -> None:
        await apart(batch, self._record, _fail)

    async def _record(self, batch: list[_End]) -> None:
        news = _news(batch)
        recorded, rode = await retrying(lambda: self._signals.ride(news, lambda pings: self._store.ends.finish_many(
            [e.end.workflow_id for e in batch], [e.lease_token for e in batch], [e.end.status for e in batch],
            [e.end.output for e in batch], [e.end.error for e in batch], pings,
        )), f"recording the end of {len(batch)} workflows")
        self._recorded(len(batch))
        for item in batch:
            item.resolve(recorded=(item.end.workflow_id, item.lease_token) in recorded)
        if len(recorded) == len(batch):
            self._signals.told(news, rode)
        else:  # only what was recorded may be told, and it did not ride
            self._signals.announce(_news([item for item in batch if item.recorded]))


def _fail(batch: list[_End], exc: Exception) -> None:
    for item in batch:
        item.resolve(failure=exc)


def _news(batch: list[_End]) -> News:
    """What a batch of ends tells: each end (or, for one too big to carry, its key) and the keys
    the executions asked to be told with it."""
    keys: set[str] = set().union(*(item.keys for item in batch))
    keys.update(signal_keys.ended(item.end.workflow_id) for item in batch if not item.carried)
    return News(sorted(keys), [item.end for item in batch if item.carried])
