"""Group commit of the notes that step attempts are starting, one batcher per worker.

Every step attempt notes its start before it runs (so an attempt cut short by a crash is counted),
and that note is a round trip the step waits for. Alone, a note goes out at once; while one batch
is out, the notes of every other execution in the worker gather and go in the next one, so a busy
worker pays one statement for many step starts instead of one each.
"""

from __future__ import annotations

import asyncio

from .batches import GroupCommit
from .engine import Engine, Fence, StepStart


class StepStarts(GroupCommit[tuple[StepStart, "asyncio.Future[Fence]"]]):
    """One batch of notes at a time: while it is out, the next gathers."""

    drains = True  # a step cut short by the worker stopping waits for its note, which counts it

    def __init__(self, store: Engine, max_batch: int = 1000) -> None:
        super().__init__(max_batch, max_in_flight=1)
        self._store = store

    async def note(self, start: StepStart) -> Fence:
        """Note the start and return its fence once its batch committed. A failed batch raises its
        error in every note of it; each caller retries its own."""
        done: asyncio.Future[Fence] = asyncio.get_running_loop().create_future()
        await self._submit((start, done))
        return await done

    async def _flush(self, batch: list[tuple[StepStart, asyncio.Future[Fence]]]) -> None:
        try:
            answers = await self._store.journal.start_steps([note for note, _ in batch])
        except Exception as exc:  # noqa: BLE001 - every waiter gets it, and decides
            for _, done in batch:
                if not done.done():
                    done.set_exception(exc)
            return
        for (_, done), answer in zip(batch, answers, strict=True):
            if not done.done():  # its step may have been cancelled meanwhile
                done.set_result(answer)
