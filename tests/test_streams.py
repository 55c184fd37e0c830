"""Streams in one process: ordering and completeness under many writers and readers, resuming from an
offset, and the ends of a stream (closed, succeeded, failed, cancelled).

Workflows run in an in-process worker (``async with app.worker(...)``) on the test's event loop; readers
are async generators on that loop, or sync generators in threads (``handle.stream`` blocks). Every wait
is bounded by ``anyio.fail_after``, so a reader that would hang fails the test instead. Workflows hold
still on ``threading.Event`` gates the test opens, never on sleeps. The shared pieces are in
tests/streaming.py.
"""

from __future__ import annotations

import threading
from typing import Any

import anyio
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pgflow

from .helpers import Point, query
from .streaming import (
    KINDS,
    READER_THREADS,
    WAIT,
    assert_dense,
    gate_async,
    read,
    read_async,
    read_sync,
    read_while_it_ends,
    wait_until,
)

pytestmark = pytest.mark.anyio



# -- 1. ordering and completeness under many writers and readers ---------------------------------------------


async def test_the_embedded_server_is_on_this_machine(app: pgflow.App, restartable: Any) -> None:
    """(Reached through a unix socket: its writers send writers in step as one batch a round. The
    addresses of other servers: tests/test_stream_batches.py.)"""
    assert await app._client.runtime().db(lambda store: store.db.on_this_machine()) is True


def build_counters(app: pgflow.App) -> dict[str, pgflow.Workflow]:  # type: ignore[type-arg]
    @app.workflow
    async def count_async(n: int) -> int:
        for i in range(n):
            await pgflow.write_stream_async("seq", i)
        await pgflow.close_stream_async("seq")
        return n

    @app.workflow
    def count_sync(n: int) -> int:
        for i in range(n):
            pgflow.write_stream("seq", i)
        pgflow.close_stream("seq")
        return n

    return {"async": count_async, "sync": count_sync}


@pytest.mark.parametrize("where", ["here", "elsewhere"])
async def test_many_writers_and_readers_joining_at_different_times_see_every_chunk_in_order(
    dsn: str, schema: str, where: str,
) -> None:
    """(The worker is told its server is on this machine, whose writer sends writers in step as one
    batch a round, or elsewhere, whose writer cuts them into two cohorts with two batches in flight.)"""
    async with pgflow.App(dsn, schema=schema, poll_interval=0.5, server_on_this_machine=where == "here") as app:
        await _many_writers_and_readers(app, dsn, schema, where)


async def _many_writers_and_readers(app: pgflow.App, dsn: str, schema: str, where: str) -> None:
    flows = build_counters(app)
    workflows, n = 32, 200
    # Enqueued before any worker runs, so the first reader of each stream is attached before its
    # first chunk; concurrency below the number of workflows keeps some queued while readers wait.
    handles = [await flows[KINDS[i % 2]].start_async(n) for i in range(workflows)]
    seen: dict[tuple[str, str], list[Any]] = {}

    async def early(i: int, h: pgflow.WorkflowHandle[Any], tg: anyio.abc.TaskGroup) -> None:
        got: list[Any] = []
        async for value in h.stream_async("seq"):
            got.append(value)
            if len(got) == n // 4:  # a second reader joins mid-stream, sync or async
                tg.start_soon(joiner, "mid", KINDS[(i + 1) % 2], h)
        seen[h.id, "early"] = got

    async def joiner(label: str, kind: str, h: pgflow.WorkflowHandle[Any]) -> None:
        seen[h.id, label] = await read(kind, h, "seq")

    async def late(i: int, h: pgflow.WorkflowHandle[Any], tg: anyio.abc.TaskGroup) -> None:
        assert await h.result_async(timeout=WAIT) == n
        await joiner("late", KINDS[i % 2], h)

    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as tg:
            for i, h in enumerate(handles):
                tg.start_soon(early, i, h, tg)
                tg.start_soon(late, i, h, tg)
            async with app.worker(concurrency=12) as worker:
                assert worker._parts.writer.cohorts is (where == "elsewhere")
                for h in handles:
                    assert await h.result_async(timeout=WAIT) == n
                await wait_until(lambda: len(seen) == 3 * workflows, "every reader to finish")

    assert len(seen) == 3 * workflows
    for (wid, label), got in seen.items():
        assert got == list(range(n)), (wid, label)
    for h in handles[:4]:
        await assert_dense(dsn, schema, h.id, "seq", list(range(n)), closed=True)
    counts = await query(dsn, f'SELECT workflow_id, count(*), count(value), max(position)'
                              f' FROM "{schema}".streams GROUP BY workflow_id')
    assert sorted(counts) == sorted((h.id, n + 1, n, n) for h in handles)


def interleaving_flows(app: pgflow.App) -> dict[str, pgflow.Workflow]:  # type: ignore[type-arg]
    """Registered once per App: hypothesis runs the test body once per example on the same fixtures."""
    if "streams-interleave-async" not in app.workflows:

        @app.workflow(name="streams-interleave-async")
        async def interleave_async(order: list[int], keys: int) -> int:
            counts = [0] * keys
            for k in order:
                await pgflow.write_stream_async(f"k{k}", counts[k])
                counts[k] += 1
            for k in range(keys):
                await pgflow.close_stream_async(f"k{k}")
            return len(order)

        @app.workflow(name="streams-interleave-sync")
        def interleave_sync(order: list[int], keys: int) -> int:
            counts = [0] * keys
            for k in order:
                pgflow.write_stream(f"k{k}", counts[k])
                counts[k] += 1
            for k in range(keys):
                pgflow.close_stream(f"k{k}")
            return len(order)

    return {"async": app.workflows["streams-interleave-async"], "sync": app.workflows["streams-interleave-sync"]}


@st.composite
def stream_plans(draw: st.DrawFn) -> list[tuple[str, int, list[int]]]:
    """Per workflow: (kind, number of keys, the order in which it writes to its keys)."""
    plans = []
    for _ in range(draw(st.integers(1, 4))):
        keys = draw(st.integers(1, 4))
        order = draw(st.lists(st.integers(0, keys - 1), max_size=40))
        plans.append((draw(st.sampled_from(KINDS)), keys, order))
    return plans


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plans=stream_plans())
async def test_property_every_key_of_every_workflow_reads_back_its_own_subsequence(
    app: pgflow.App, dsn: str, schema: str, plans: list[tuple[str, int, list[int]]],
) -> None:
    flows = interleaving_flows(app)
    handles = [await flows[kind].start_async(order, keys) for kind, keys, order in plans]
    got: dict[tuple[int, int], list[Any]] = {}

    async def reader(i: int, k: int) -> None:
        got[i, k] = await read_async(handles[i], f"k{k}")

    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as tg:
            for i, (_, keys, _) in enumerate(plans):
                for k in range(keys):
                    tg.start_soon(reader, i, k)
            async with app.worker(concurrency=4):
                for h, (_, _, order) in zip(handles, plans, strict=True):
                    assert await h.result_async(timeout=WAIT) == len(order)
                await wait_until(lambda: len(got) == sum(keys for _, keys, _ in plans), "readers")

    for i, (_, keys, order) in enumerate(plans):
        for k in range(keys):
            expected = list(range(order.count(k)))
            assert got[i, k] == expected
            await assert_dense(dsn, schema, handles[i].id, f"k{k}", expected, closed=True)


# -- 2. resuming from an offset -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_a_reader_resumes_from_any_offset(app: pgflow.App, kind: str) -> None:
    half = threading.Event()

    @app.workflow
    async def fifty() -> str:
        for i in range(50):
            if i == 25:  # the second half is written only once a reader has stopped and resumed
                await gate_async(half)
            await pgflow.write_stream_async("s", i)
        await pgflow.close_stream_async("s")
        return "done"

    async with app.worker(concurrency=2):
        h = await fifty.start_async()
        with anyio.fail_after(WAIT):
            # A reader stops after 10 chunks, as a browser that goes away would, and resumes at 10.
            first: list[int] = []
            if kind == "async":
                stream = h.stream_async("s")
                async for value in stream:
                    first.append(value)
                    if len(first) == 10:
                        break
                await stream.aclose()  # type: ignore[attr-defined]
            else:
                def take10() -> None:
                    for value in h.stream("s"):
                        first.append(value)
                        if len(first) == 10:
                            return

                await anyio.to_thread.run_sync(take10, limiter=READER_THREADS, abandon_on_cancel=True)
            assert first == list(range(10))

            async with anyio.create_task_group() as tg:
                rest: list[Any] = []

                async def resume() -> None:
                    rest.extend(await read(kind, h, "s", offset=10))

                tg.start_soon(resume)
                half.set()
            assert first + rest == list(range(50))
            assert await h.result_async(timeout=WAIT) == "done"

            # The stream is closed and its workflow finished: every offset reads the rest of it, and an
            # offset at or past its end (50 is the close marker's position) reads nothing and returns.
            for offset in [0, 1, 24, 25, 49, 50, 51, 1000]:
                assert await read(kind, h, "s", offset=offset) == list(range(offset, 50)), offset


@pytest.mark.parametrize("kind", KINDS)
async def test_a_negative_offset_is_refused(app: pgflow.App, kind: str) -> None:
    @app.workflow
    async def three() -> int:
        for i in range(3):
            await pgflow.write_stream_async("s", i)
        return 3

    async with app.worker(concurrency=2):
        h = await three.start_async()
        assert await h.result_async(timeout=WAIT) == 3
    with anyio.fail_after(WAIT), pytest.raises(ValueError, match=r"offset.*>= 0"):
        await read(kind, h, "s", offset=-1)


@pytest.mark.parametrize("kind", KINDS)
async def test_an_offset_past_the_end_of_a_closed_stream_returns_while_the_workflow_still_runs(
    app: pgflow.App, kind: str,
) -> None:
    release = threading.Event()

    @app.workflow
    async def closes_early() -> str:
        for i in range(3):
            await pgflow.write_stream_async("s", i)
        await pgflow.close_stream_async("s")
        await gate_async(release)
        return "done"

    async with app.worker(concurrency=2):
        h = await closes_early.start_async()
        try:
            with anyio.fail_after(WAIT):
                assert await read(kind, h, "s") == [0, 1, 2]
            assert await h.status_async() == "running"
            with anyio.fail_after(2):  # it returns in milliseconds; the workflow runs until released
                assert await read(kind, h, "s", offset=10) == []
        finally:
            release.set()
            await h.result_async(timeout=WAIT)


@pytest.mark.parametrize("kind", KINDS)
async def test_type_decodes_chunks_into_a_struct(app: pgflow.App, kind: str) -> None:
    @app.workflow
    async def points(n: int) -> int:
        for i in range(n):
            await pgflow.write_stream_async("p", Point(i, -i))
        return n

    async with app.worker(concurrency=2):
        h = await points.start_async(5)
        with anyio.fail_after(WAIT):
            assert await read(kind, h, "p", type=Point) == [Point(i, -i) for i in range(5)]
            assert await read(kind, h, "p", offset=3, type=Point) == [Point(3, -3), Point(4, -4)]
            assert await read(kind, h, "p") == [{"x": i, "y": -i} for i in range(5)]
            with pytest.raises(msgspec.ValidationError):
                await read(kind, h, "p", type=int)


async def test_reading_an_unknown_workflow_raises(app: pgflow.App) -> None:
    h = app.handle("no-such-workflow")
    with anyio.fail_after(WAIT):
        with pytest.raises(pgflow.UnknownWorkflow):
            await read_async(h, "s")
        with pytest.raises(pgflow.UnknownWorkflow):
            await read_sync(h, "s")


# -- 3. the end of a stream --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_close_ends_the_stream_while_its_workflow_still_runs(app: pgflow.App, kind: str) -> None:
    release = threading.Event()

    @app.workflow
    async def closer_async() -> str:
        for i in range(3):
            await pgflow.write_stream_async("s", i)
        await pgflow.close_stream_async("s")
        try:
            await pgflow.write_stream_async("s", 99)
        except ValueError as exc:
            after = str(exc)
        await pgflow.write_stream_async("other", "still open")
        await gate_async(release)
        return after

    @app.workflow
    def closer_sync() -> str:
        for i in range(3):
            pgflow.write_stream("s", i)
        pgflow.close_stream("s")
        try:
            pgflow.write_stream("s", 99)
        except ValueError as exc:
            after = str(exc)
        pgflow.write_stream("other", "still open")
        release.wait(WAIT)
        return after

    flow = closer_async if kind == "async" else closer_sync
    async with app.worker(concurrency=2):
        h = await flow.start_async()
        try:
            with anyio.fail_after(WAIT):
                assert await read(kind, h, "s") == [0, 1, 2]
                assert await h.status_async() == "running"
        finally:
            release.set()
        message = await h.result_async(timeout=WAIT)
    assert "is closed" in message
    assert await read(kind, h, "s") == [0, 1, 2]


@pytest.mark.parametrize("kind", KINDS)
async def test_a_stream_never_closed_ends_when_its_workflow_succeeds(app: pgflow.App, dsn: str, schema: str,
                                                                     kind: str) -> None:
    release = threading.Event()

    @app.workflow
    async def unclosed() -> int:
        for i in range(4):
            await pgflow.write_stream_async("s", i)
        await gate_async(release)
        return 4

    async with app.worker(concurrency=2):
        h = await unclosed.start_async()
        got: dict[str, list[Any]] = {}
        progress: dict[str, list[Any]] = {"s": [], "never-written": []}

        async def reader(key: str) -> None:
            if kind == "async":
                async for value in h.stream_async(key):
                    progress[key].append(value)
                got[key] = progress[key]
            else:
                got[key] = await read_sync(h, key)

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(reader, "s")
                tg.start_soon(reader, "never-written")
                if kind == "async":
                    # Attached to a running workflow that wrote all it will: only its end can end them.
                    await wait_until(lambda: len(progress["s"]) == 4, "the four chunks")
                    assert await h.status_async() == "running"
                release.set()
            assert got == {"s": [0, 1, 2, 3], "never-written": []}
        assert await h.result_async(timeout=WAIT) == 4
    await assert_dense(dsn, schema, h.id, "s", [0, 1, 2, 3], closed=False)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_failed_workflow_ends_its_stream_after_the_chunks_it_wrote(
    app: pgflow.App, dsn: str, schema: str, kind: str,
) -> None:
    fail_now = threading.Event()

    @app.workflow
    async def fails_async() -> None:
        for i in range(5):
            await pgflow.write_stream_async("s", i)
        await gate_async(fail_now)
        raise ValueError("broke after five")

    @app.workflow
    def fails_sync() -> None:
        for i in range(5):
            pgflow.write_stream("s", i)
        fail_now.wait(WAIT)
        raise ValueError("broke after five")

    flow = fails_async if kind == "async" else fails_sync
    h = await flow.start_async()
    try:
        # The reader sees all five chunks while the workflow runs; the failure then ends the stream.
        got, failure = await read_while_it_ends(app, kind, h, "s", pgflow.WorkflowFailed, at=5, then=fail_now.set)
    finally:
        fail_now.set()
    assert got == [0, 1, 2, 3, 4]
    assert failure.error_type == "ValueError"
    assert failure.message == "broke after five"
    assert await h.status_async() == "failed"
    await assert_dense(dsn, schema, h.id, "s", [0, 1, 2, 3, 4], closed=False)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_cancelled_workflow_ends_its_stream(app: pgflow.App, dsn: str, schema: str, kind: str) -> None:
    stop = threading.Event()  # only a safety net: the loops end by cancellation

    @app.workflow
    async def endless_async() -> None:
        i = 0
        while not stop.is_set():
            await pgflow.write_stream_async("s", i)
            i += 1
            await anyio.sleep(0.002)

    @app.workflow
    def endless_sync() -> None:
        i = 0
        while not stop.is_set():
            pgflow.write_stream("s", i)
            i += 1
            stop.wait(0.002)

    flow = endless_async if kind == "async" else endless_sync
    h = await flow.start_async()
    try:
        got, _ = await read_while_it_ends(app, kind, h, "s", pgflow.WorkflowCancelled, at=20, then=h.cancel,
                                          then_async=h.cancel_async)
    finally:
        stop.set()
    assert await h.status_async() == "cancelled"
    # The reader stopped on its own, after every chunk the workflow committed before it was stopped.
    assert len(got) >= 20
    assert got == list(range(len(got)))
    await assert_dense(dsn, schema, h.id, "s", got, closed=False)
