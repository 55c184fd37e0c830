"""Streams written by retried steps and by workflow bodies replayed after an interruption: every chunk
appears once, resumed from ``stream_offset`` or appended after the earlier attempt.
"""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest

import pgflow

from .streaming import (
    KINDS,
    READER_THREADS,
    WAIT,
    assert_dense,
    gate_async,
    read_while_run,
    wait_until,
)

pytestmark = pytest.mark.anyio



# -- 6. retried steps ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_a_retried_step_resumes_from_stream_offset_and_every_chunk_appears_once(
    app: pgflow.App, dsn: str, schema: str, kind: str,
) -> None:
    offsets: list[int] = []  # stream_offset as each attempt of the step saw it

    @app.step(max_attempts=3, backoff=0.01)
    async def tokens_async(n: int) -> int:
        start = pgflow.stream_offset("s")
        offsets.append(start)
        for i in range(start, n):
            await pgflow.write_stream_async("s", f"t{i}")
            if start == 0 and i == 2:
                raise ConnectionError("the model went away after 3 tokens")
        return n

    @app.step(max_attempts=3, backoff=0.01)
    def tokens_sync(n: int) -> int:
        start = pgflow.stream_offset("s")
        offsets.append(start)
        for i in range(start, n):
            pgflow.write_stream("s", f"t{i}")
            if start == 0 and i == 2:
                raise ConnectionError("the model went away after 3 tokens")
        return n

    @app.workflow
    async def chat_async() -> list[int]:
        await pgflow.write_stream_async("s", "begin")  # a body chunk before: not the step's
        n = await tokens_async(6)
        body = pgflow.stream_offset("s")
        await pgflow.write_stream_async("s", "end")
        await pgflow.close_stream_async("s")
        return [n, body]

    @app.workflow
    def chat_sync() -> list[int]:
        pgflow.write_stream("s", "begin")
        n = tokens_sync(6)
        body = pgflow.stream_offset("s")
        pgflow.write_stream("s", "end")
        pgflow.close_stream("s")
        return [n, body]

    flow = chat_async if kind == "async" else chat_sync
    h = await flow.start_async()
    expected = ["begin", *(f"t{i}" for i in range(6)), "end"]
    # In the body, stream_offset is how many chunks the stream holds.
    got = await read_while_run(app, kind, h, "s", result=[6, 7])
    assert offsets == [0, 3]  # the retry saw its first attempt's three chunks, not the body's one
    assert got == expected
    await assert_dense(dsn, schema, h.id, "s", expected, closed=True)
    [step] = await h.steps_async()
    assert step.attempts == 2


@pytest.mark.parametrize("kind", KINDS)
async def test_a_retried_step_that_ignores_stream_offset_appends_after_its_earlier_attempt(
    app: pgflow.App, dsn: str, schema: str, kind: str,
) -> None:
    attempts: list[int] = []

    @app.step(max_attempts=3, backoff=0.01)
    async def again_async() -> int:
        attempts.append(len(attempts) + 1)
        attempt = len(attempts)
        for i in range(3 if attempt == 1 else 5):
            await pgflow.write_stream_async("s", f"a{attempt}-{i}")
        if attempt == 1:
            raise ConnectionError("first attempt fails after its chunks")
        return attempt

    @app.step(max_attempts=3, backoff=0.01)
    def again_sync() -> int:
        attempts.append(len(attempts) + 1)
        attempt = len(attempts)
        for i in range(3 if attempt == 1 else 5):
            pgflow.write_stream("s", f"a{attempt}-{i}")
        if attempt == 1:
            raise ConnectionError("first attempt fails after its chunks")
        return attempt

    @app.workflow
    async def rewrite_async() -> int:
        attempt = await again_async()
        await pgflow.write_stream_async("s", "after")
        return attempt

    @app.workflow
    def rewrite_sync() -> int:
        attempt = again_sync()
        pgflow.write_stream("s", "after")
        return attempt

    flow = rewrite_async if kind == "async" else rewrite_sync
    h = await flow.start_async()
    expected = [*(f"a1-{i}" for i in range(3)), *(f"a2-{i}" for i in range(5)), "after"]
    got = await read_while_run(app, kind, h, "s", result=2)
    assert got == expected
    await assert_dense(dsn, schema, h.id, "s", expected, closed=False)


@pytest.mark.parametrize("reader_kind", KINDS)
async def test_body_writes_replayed_after_an_interruption_are_not_written_twice(
    app: pgflow.App, dsn: str, schema: str, reader_kind: str,
) -> None:
    # The first worker stops (its workflow goes back to the queue) while the workflow waits between its
    # writes; the second runs the body again from the start, and its first 13 chunks are not rewritten.
    release = threading.Event()
    runs: list[int] = []

    @app.step
    async def middle() -> str:
        for i in range(3):
            await pgflow.write_stream_async("s", f"step{i}")
        return "ok"

    @app.workflow
    async def resumable() -> int:
        runs.append(len(runs) + 1)
        for i in range(5):
            await pgflow.write_stream_async("s", i)
        await middle()
        for i in range(5, 10):
            await pgflow.write_stream_async("s", i)
        await gate_async(release)
        for i in range(10, 20):
            await pgflow.write_stream_async("s", i)
        await pgflow.close_stream_async("s")
        return len(runs)

    expected = [0, 1, 2, 3, 4, "step0", "step1", "step2", *range(5, 20)]
    h = await resumable.start_async()
    got: list[Any] = []
    errors: list[BaseException] = []

    async def reader() -> None:
        # Attached across both workers. Errors are kept, not raised, so that one fails the assertion
        # below instead of cancelling the worker blocks.
        try:
            if reader_kind == "async":
                async for value in h.stream_async("s"):
                    got.append(value)
            else:
                await anyio.to_thread.run_sync(lambda: got.extend(v for v in h.stream("s")),
                                               limiter=READER_THREADS, abandon_on_cancel=True)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    try:
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(reader)
                async with app.worker(concurrency=2):
                    await wait_until(lambda: len(got) == 13, "the chunks before the gate")
                assert await h.status_async() == "queued"
                release.set()
                async with app.worker(concurrency=2):
                    assert await h.result_async(timeout=WAIT) == 2
    finally:
        release.set()
    assert errors == []
    assert runs == [1, 2]
    assert got == expected
    await assert_dense(dsn, schema, h.id, "s", expected, closed=True)
