"""Group-committed workflow ends, one finisher per worker.

Recording an end is an UPDATE and a commit, and for short workflows it is most of their cost: a
worker running 16 no-ops at once would commit 16 times for 16 ends. So the ends of every execution
in a worker are gathered while earlier batches commit (two may be in flight) and written in one
statement, as stream chunks are, and each execution still awaits its own batch's commit before it
counts as finished. A batch carries its pings, sent by its commit: the statement itself pings each
end it recorded, with the end in the ping when it is small, so the caller waiting for it is answered
without reading the row; the ends refused (lost leases) ping nobody.

A batch that cannot be written because the server is away is tried again (``retrying``); past that,
every end in it fails as its single end would have, and the execution gives its workflow back. A
batch the server refuses for what one end holds is split until that end is alone, so it fails by
itself and the others are recorded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import psycopg

from .batches import GroupCommit
from .store import Store, retrying, unreachable


class _End:
    """An end waiting for its batch; ``recorded`` says whether the execution still owned it."""

    __slots__ = ("workflow_id", "lease", "status", "output", "error", "keys", "done", "recorded", "failure")

    def __init__(self, workflow_id: str, lease: int, status: str, output: bytes | None,
                 error: dict[str, Any] | None, keys: set[str]) -> None:
        self.workflow_id = workflow_id
        self.lease = lease
        self.status = status
        self.output = output
        self.error = error
        self.keys = keys
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

    def __init__(self, store: Store, channel: str, token: str | None, payloads: Callable[[set[str]], list[str]],
                 wake: Callable[[set[str]], None], queued: Callable[[], None] = lambda: None,
                 recorded: Callable[[int], None] = lambda ends: None, max_batch: int = 1000,
                 max_in_flight: int = 2) -> None:
        super().__init__(max_batch, max_in_flight)
        self._store = store
        self._queued = queued
        self._recorded = recorded
        self._channel = channel
        self._token = token  # None: the ends ping no other process (notify="off")
        self._payloads = payloads
        self._wake_local = wake
        self.pending = 0  # ends queued or in a batch in flight: their workflows' bodies are done

    async def finish(self, workflow_id: str, lease: int, status: str, output: bytes | None,
                     error: dict[str, Any] | None, keys: set[str]) -> bool:
        """Record an end once its batch has committed; False when its claim (``lease``, the claim's
        token) no longer held the workflow. ``keys`` are pinged with the commit, besides the end's own
        ``wf:`` ping."""
        end = _End(workflow_id, lease, status, output, error, keys)
        self.pending += 1
        try:
            self._queued()  # its slot is free: the next claim may go out beside this end's batch
            await self._submit(end)
            await end.done
        finally:
            self.pending -= 1
        if end.failure is not None:
            raise end.failure
        return end.recorded

    async def _flush(self, batch: list[_End]) -> None:
        keys = set().union(*(end.keys for end in batch))
        pings = self._payloads(keys)
        try:
            recorded = await retrying(lambda: self._store.finish_many(
                [e.workflow_id for e in batch], [e.lease for e in batch], [e.status for e in batch],
                [e.output for e in batch], [e.error for e in batch], self._channel, pings, self._token,
            ), f"recording the end of {len(batch)} workflows")
        except Exception as exc:  # noqa: BLE001 - given to the ends it concerns
            if not isinstance(exc, psycopg.Error) or unreachable(exc) or len(batch) == 1:
                for end in batch:
                    end.resolve(failure=exc)
                return
            middle = len(batch) // 2
            await self._flush(batch[:middle])
            await self._flush(batch[middle:])
            return
        self._recorded(len(batch))
        for end in batch:
            told = recorded.get((end.workflow_id, end.lease))
            if told is not None:
                keys.update(told)
            end.resolve(recorded=told is not None)
        self._wake_local(keys)
