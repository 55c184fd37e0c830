"""Bounds on what one process takes in: what a worker reads back is data from whoever could write the
row (arguments over the worker's own limit fail their workflow, with a clear error, before they are
decoded), and a read shared by many streams holds a bounded batch however big their chunks are."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import pgflow
from pgflow._core.engine.chunks import Chunks
from pgflow._core.streams import reader

pytestmark = pytest.mark.anyio


async def test_a_worker_refuses_stored_arguments_over_its_limit(dsn: str, schema: str) -> None:
    async def take(text: str) -> int:
        return len(text)

    async with pgflow.App(dsn, schema=schema, max_value_bytes=1 << 20) as roomy, \
            pgflow.App(dsn, schema=schema, max_value_bytes=1024) as strict:
        big = roomy.workflow(name="limits.take")(take)
        strict.workflow(name="limits.take")(take)
        small = await big.start_async("x" * 100)
        large = await big.start_async("x" * 4096)  # within the caller's limit, over the worker's
        async with strict.worker(concurrency=2):
            assert await small.result_async(timeout=60) == 100
            with pytest.raises(pgflow.WorkflowFailed) as failed:
                await large.result_async(timeout=60)
        assert "limit is 1024" in str(failed.value) and "limits.take" in str(failed.value)


async def test_a_shared_read_of_many_streams_holds_a_bounded_batch(
    dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Readers of one loop share a query; one stream's next chunk may be 8 MiB, so a query of a thousand
    streams could hold gigabytes. A query of many holds at most ``QUERY_BYTES``: a chunk over its share
    is left for a read of its stream alone, and every reader still gets every chunk, in order."""
    monkeypatch.setattr(reader, "QUERY_BYTES", 1 << 20)
    big = b"x" * (2 << 20)
    queries: list[tuple[int, int]] = []  # (streams asked, bytes answered)
    read_streams = Chunks.read_streams

    async def recorded(self: Chunks, *args: Any) -> Any:
        answer = await read_streams(self, *args)
        queries.append((len(args[0]), sum(len(v or b"") for chunks in answer[0] for _, v in chunks)))
        return answer

    monkeypatch.setattr(Chunks, "read_streams", recorded)

    async def write() -> None:
        for value in (b"a", big, b"b", big, b"c"):
            await pgflow.write_stream_async("data", value)
        await pgflow.close_stream_async("data")

    async with pgflow.App(dsn, schema=schema) as app:
        wf = app.workflow(name="limits.write")(write)
        handles = [await wf.start_async() for _ in range(4)]
        async with app.worker(concurrency=4):
            for handle in handles:
                await handle.result_async(timeout=60)

        async def read(handle: pgflow.WorkflowHandle[None]) -> list[bytes]:
            return [value async for value in handle.stream_async("data")]

        read_all = [asyncio.create_task(read(h)) for h in handles]
        assert await asyncio.gather(*read_all) == [[b"a", big, b"b", big, b"c"]] * 4
    shared = [answered for streams, answered in queries if streams > 1]
    assert shared, "no query was shared: the test proves nothing"
    assert max(shared) <= 1 << 20, queries
    assert max(answered for _, answered in queries) >= len(big)  # the big chunks came, each read alone
