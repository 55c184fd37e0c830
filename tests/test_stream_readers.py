"""Readers of one event loop share their fetches; one that holds its batch (its consumer busy with
it) must not hold back the others."""

from __future__ import annotations

import anyio
import pytest

import pgflow

pytestmark = pytest.mark.anyio

WAIT = 30.0


async def test_a_reader_holding_its_batch_does_not_hold_back_the_others(app: pgflow.App) -> None:
    first_read = anyio.Event()  # reader A has its first chunk, and holds it
    more = anyio.Event()        # workflow A may write again: A's stream is pinged while A holds
    go_b = anyio.Event()        # workflow B may write

    @app.workflow(name="readers.a")
    async def a() -> None:
        await pgflow.write_stream_async("s", 0)
        await more.wait()
        await pgflow.write_stream_async("s", 1)
        await pgflow.close_stream_async("s")

    @app.workflow(name="readers.b")
    async def b() -> None:
        await go_b.wait()
        for n in range(5):
            await pgflow.write_stream_async("s", n)
        await pgflow.close_stream_async("s")

    got_b: list[int] = []
    release_a, b_done = anyio.Event(), anyio.Event()

    async with app.worker(concurrency=2):
        ha, hb = await a.start_async(), await b.start_async()

        async def read_a() -> None:
            async for _ in ha.stream_async("s"):
                first_read.set()
                await release_a.wait()  # the consumer is busy with its batch

        async def read_b() -> None:
            async for value in hb.stream_async("s"):
                got_b.append(value)
            b_done.set()

        async with anyio.create_task_group() as readers:
            readers.start_soon(read_a)
            readers.start_soon(read_b)
            with anyio.fail_after(WAIT):
                await first_read.wait()
                more.set()
                await ha.result_async()  # A's second chunk and its end are committed and pinged
                go_b.set()
                await b_done.wait()  # B's whole stream arrives while A still holds its first batch
            release_a.set()
    assert got_b == [0, 1, 2, 3, 4]
