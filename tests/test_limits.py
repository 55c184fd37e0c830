"""Every size is bounded: values pgflow stores (``App(max_value_bytes=...)``), checked before anything
is written, and what one read of a stream brings into the reader."""

from __future__ import annotations

from typing import Any

import anyio
import psycopg
import pytest

import pgflow

from .helpers import ONE_SERVER

pytestmark = pytest.mark.anyio

LIMIT = 64 * 1024
WAIT = 60.0


async def count(dsn: str, schema: str, table: str) -> int:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute(f'SELECT count(*) FROM "{schema}".{table}')
        row = await cur.fetchone()
        assert row is not None
        return int(row[0])


@ONE_SERVER  # sizes are checked in Python before any statement: the same on any server
async def test_values_over_the_limit_are_refused_before_anything_is_written(dsn: str, schema: str) -> None:
    big = "x" * (LIMIT + 1)
    async with pgflow.App(dsn, schema=schema, max_value_bytes=LIMIT) as app:

        @app.step(name="limits.output")
        async def output(n: int) -> str:
            return "y" * n

        @app.workflow(name="limits.flow")
        async def flow(blob: str, out: int, event: int, result: int) -> str:
            if out:
                try:
                    await output(out)
                except pgflow.SerializationError as exc:
                    return f"step refused: {exc}"
            if event:
                await pgflow.set_event_async("e", "z" * event)
            return "r" * result

        await app.migrate_async()
        # At the start: the argument is named, with its size and the limit.
        for start in (lambda: flow.start_async(big, 0, 0, 0), lambda: app.start_by_name_async("limits.flow", big),
                      lambda: flow.start_many_async([("ok", 0, 0, 0), (big, 0, 0, 0)])):
            with pytest.raises(pgflow.SerializationError, match=rf"is {LIMIT + 1 + 3}\d* bytes|the limit is {LIMIT}"):
                await start()
        with pytest.raises(pgflow.SerializationError) as refused:
            flow.start(big, 0, 0, 0)
        assert "argument 'blob'" in str(refused.value) and f"the limit is {LIMIT}" in str(refused.value)
        assert await count(dsn, schema, "workflows") == 0

        waiting = await flow.start_async("ok", 0, LIMIT + 10, 0)
        with pytest.raises(pgflow.SerializationError, match="the message on 'go'"):
            await waiting.send_async("go", big)
        assert await count(dsn, schema, "messages") == 0

        async with app.worker():
            stepped = await flow.start_async("ok", LIMIT + 10, 0, 0)
            evented = await flow.start_async("ok", 0, LIMIT + 10, 0)
            resulted = await flow.start_async("ok", 0, 0, LIMIT + 10)
            with anyio.fail_after(WAIT):
                assert (await stepped.result_async()).startswith("step refused: the output of step 'limits.output'")
                for handle, what in ((evented, "the value of event 'e'"), (resulted, "the result of workflow")):
                    with pytest.raises(pgflow.WorkflowFailed) as failed:
                        await handle.result_async()
                    assert failed.value.error_type == "pgflow.errors.SerializationError"
                    assert what in failed.value.message and f"the limit is {LIMIT}" in failed.value.message
        assert await count(dsn, schema, "events") == 0
    with pytest.raises(pgflow.ConfigurationError, match="max_value_bytes"):
        pgflow.App(dsn, schema=schema, max_value_bytes=10)


async def test_one_read_brings_a_bounded_batch_of_a_stream(app: pgflow.App) -> None:
    """Chunks of 1.5 MiB: each read brings one (a read takes at most 1 MiB of a stream, its first chunk
    whatever its size), where it used to bring up to 1,000 of them, 8 MiB each at most."""
    size, n = 1536 * 1024, 4

    @app.workflow(name="limits.big_chunks")
    async def big_chunks() -> int:
        for i in range(n):
            await pgflow.write_stream_async("s", bytes([i]) * size)
        return n

    handle = await big_chunks.start_async()
    async with app.worker():
        with anyio.fail_after(WAIT):
            assert await handle.result_async() == n
    batches: list[list[Any]] = []
    read = app._client.runtime().read_stream(handle.id, "s", 0)
    try:
        async for batch in read:
            batches.append([position for position, _ in batch])
    finally:
        await read.aclose()
    assert batches == [[i] for i in range(n)]
