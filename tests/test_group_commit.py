"""GroupCommit's batching, with no server: what goes together, how many batches are in flight, and
what a stop does with what is queued. (The finisher and the stream writer over a real server are
tests/test_ends.py's and tests/test_stream_batches.py's.)"""

from __future__ import annotations

import asyncio

import anyio
import pytest

from pgflow._core.batches import GroupCommit

pytestmark = pytest.mark.anyio


class Recorder(GroupCommit[int]):
    """Each batch's items, in the order they were sent; a batch waits for ``release`` when asked."""

    def __init__(self, max_in_flight: int = 2, hold: bool = False, drains: bool = False) -> None:
        super().__init__(max_batch=100, max_in_flight=max_in_flight)
        self.batches: list[list[int]] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.hold = hold
        self.release = asyncio.Event()
        self.drains = drains

    def put(self, item: int) -> None:
        self._put(item)

    async def _flush(self, batch: list[int]) -> None:
        self.batches.append(batch)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.hold:
                await self.release.wait()
        finally:
            self.in_flight -= 1


async def _turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_what_one_turn_puts_goes_in_one_batch_and_what_came_before_the_start_goes_too() -> None:
    recorder = Recorder()
    recorder.put(1)  # before run: kept until it starts
    async with anyio.create_task_group() as group:
        await group.start(recorder.run)
        await _turns()
        assert recorder.batches == [[1]]
        for n in (2, 3, 4):
            recorder.put(n)
        await _turns()
        assert recorder.batches == [[1], [2, 3, 4]]
        group.cancel_scope.cancel()


async def test_at_most_two_batches_are_in_flight_and_what_waits_goes_when_one_is_done() -> None:
    recorder = Recorder(hold=True)
    async with anyio.create_task_group() as group:
        await group.start(recorder.run)
        recorder.put(1)
        await _turns()
        recorder.put(2)
        await _turns()
        recorder.put(3)
        recorder.put(4)
        await _turns()
        assert recorder.batches == [[1], [2]] and recorder.in_flight == 2
        recorder.release.set()
        await _turns(10)
        assert recorder.batches == [[1], [2], [3, 4]]
        assert recorder.most_in_flight == 2
        group.cancel_scope.cancel()


@pytest.mark.parametrize("drains", [False, True])
async def test_a_stop_waits_for_the_batches_in_flight_and_a_draining_one_sends_what_is_queued(drains: bool) -> None:
    recorder = Recorder(max_in_flight=1, hold=True, drains=drains)
    stopped = anyio.Event()

    async def run_until_cancelled() -> None:
        try:
            await recorder.run()
        finally:
            stopped.set()

    async with anyio.create_task_group() as group:
        group.start_soon(run_until_cancelled)
        await _turns()
        recorder.put(1)
        await _turns()
        recorder.put(2)  # waits: one batch in flight at most
        await _turns()
        group.cancel_scope.cancel()
        with anyio.CancelScope(shield=True):
            await _turns()
            assert recorder.batches == [[1]] and not stopped.is_set()  # the stop waits for the batch
            recorder.release.set()
            await stopped.wait()
    assert recorder.batches == ([[1], [2]] if drains else [[1]])
    assert recorder.in_flight == 0
