"""Streams in one process: ordering, resuming, the ends of a stream, pings and polls, retried steps, limits.

Workflows run in an in-process worker (``async with app.worker(...)``) on the test's event loop; readers
are async generators on that loop, or sync generators in threads (``handle.stream`` blocks). Every wait
is bounded by ``anyio.fail_after``, so a reader that would hang fails the test instead. Workflows hold
still on ``threading.Event`` gates the test opens, never on sleeps.

Where a test needs a reader that depends on pings or on the poll alone, it reads through a second App on
the same schema: each App has its own waiters, listener and poll, and a poll of 60 s where a test must
show that pings (not the poll) delivered.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import msgspec
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg_pool import AsyncConnectionPool

import pgflow
from pgflow import codec
from pgflow._core.signals import News
from pgflow._core.signals import keys as signal_keys
from pgflow._core.signals.notifier import Notifier, Refusals
from pgflow.streams import MAX_CHUNK_BYTES, MAX_KEY_BYTES

from .channel import named, opened, seal
from .helpers import Point, query

pytestmark = pytest.mark.anyio

KINDS = ["async", "sync"]
WAIT = 60.0  # seconds: the bound of every wait on something a worker does
GATE_POLL = 0.01  # seconds between looks at a gate inside a workflow body
SLOW_POLL = 60.0  # the poll of an App whose readers must be woken by pings, not by the poll
PING_WAIT = 25.0  # seconds within which only a ping, not such a poll, can deliver


# -- helpers ------------------------------------------------------------------------------------------------

_readers = anyio.CapacityLimiter(64)  # threads for sync readers, apart from the worker's own


async def read_async(handle: pgflow.WorkflowHandle[Any], key: str, offset: int = 0, *,
                     type: Any = Any) -> list[Any]:
    return [value async for value in handle.stream_async(key, offset, type=type)]


async def read_sync(handle: pgflow.WorkflowHandle[Any], key: str, offset: int = 0, *,
                    type: Any = Any) -> list[Any]:
    """``list(handle.stream(...))`` in a thread; abandoned (not awaited) if the test times out."""
    return await anyio.to_thread.run_sync(lambda: list(handle.stream(key, offset, type=type)),
                                          limiter=_readers, abandon_on_cancel=True)


async def read(kind: str, handle: pgflow.WorkflowHandle[Any], key: str, offset: int = 0, *,
               type: Any = Any) -> list[Any]:
    return await (read_async if kind == "async" else read_sync)(handle, key, offset, type=type)


async def consume(kind: str, handle: pgflow.WorkflowHandle[Any], key: str, into: list[Any],
                  offset: int = 0) -> None:
    """Read a stream to its end, appending each chunk to ``into`` as it arrives (progress is visible)."""
    if kind == "async":
        async for value in handle.stream_async(key, offset):
            into.append(value)
    else:
        def run() -> None:
            for value in handle.stream(key, offset):
                into.append(value)

        await anyio.to_thread.run_sync(run, limiter=_readers, abandon_on_cancel=True)


async def stored(dsn: str, schema: str, workflow_id: str, key: str) -> list[tuple[int, Any]]:
    """(position, decoded value or None for the close marker) of every row of one stream."""
    rows = await query(dsn, f'SELECT position, value FROM "{schema}".streams'
                            " WHERE workflow_id = %s AND key = %s ORDER BY position", workflow_id, key)
    return [(p, None if v is None else codec.decode(v)) for p, v in rows]


async def assert_dense(dsn: str, schema: str, workflow_id: str, key: str, values: list[Any], *,
                       closed: bool) -> None:
    """The table holds exactly ``values`` at positions 0..n-1, then one close marker if ``closed``."""
    expected = list(enumerate(values)) + ([(len(values), None)] if closed else [])
    assert await stored(dsn, schema, workflow_id, key) == expected


async def wait_until(condition: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    """For conditions no event announces (another App's state); polls, bounded."""
    with anyio.fail_after(timeout):
        while not condition():
            await anyio.sleep(0.01)


async def gate_async(gate: threading.Event) -> None:
    while not gate.wait(0):
        await anyio.sleep(GATE_POLL)


def other_app(dsn: str, schema: str, **settings_: Any) -> pgflow.App:
    return pgflow.App(dsn, schema=schema, **settings_)


# -- 1. ordering and completeness under many writers and readers ---------------------------------------------


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


async def test_many_writers_and_readers_joining_at_different_times_see_every_chunk_in_order(
    app: pgflow.App, dsn: str, schema: str,
) -> None:
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
            async with app.worker(concurrency=12):
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

                await anyio.to_thread.run_sync(take10, limiter=_readers, abandon_on_cancel=True)
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
    got: list[Any] = []

    async def reader() -> None:
        # The reader sees all five chunks while the workflow runs; the failure then ends the stream.
        if kind == "async":
            async for value in h.stream_async("s"):
                got.append(value)
                if len(got) == 5:
                    fail_now.set()
        else:
            def consume() -> None:
                for value in h.stream("s"):
                    got.append(value)
                    if len(got) == 5:
                        fail_now.set()

            await anyio.to_thread.run_sync(consume, limiter=_readers, abandon_on_cancel=True)

    try:
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(reader)
                async with app.worker(concurrency=2):
                    with pytest.raises(pgflow.WorkflowFailed) as failed:
                        await h.result_async(timeout=WAIT)
    finally:
        fail_now.set()
    assert got == [0, 1, 2, 3, 4]
    assert failed.value.error_type == "ValueError"
    assert failed.value.message == "broke after five"
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
    got: list[Any] = []

    async def reader() -> None:
        if kind == "async":
            async for value in h.stream_async("s"):
                got.append(value)
                if len(got) == 20:
                    await h.cancel_async()
        else:
            def consume() -> None:
                for value in h.stream("s"):
                    got.append(value)
                    if len(got) == 20:
                        h.cancel()

            await anyio.to_thread.run_sync(consume, limiter=_readers, abandon_on_cancel=True)

    try:
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(reader)
                async with app.worker(concurrency=2):
                    with pytest.raises(pgflow.WorkflowCancelled):
                        await h.result_async(timeout=WAIT)
    finally:
        stop.set()
    assert await h.status_async() == "cancelled"
    # The reader stopped on its own, after every chunk the workflow committed before it was stopped.
    assert len(got) >= 20
    assert got == list(range(len(got)))
    await assert_dense(dsn, schema, h.id, "s", got, closed=False)


# -- 4 and 5. pings and the poll ----------------------------------------------------------------------------


async def test_with_notify_off_a_reader_in_another_app_gets_every_chunk_by_the_poll(
    dsn: str, schema: str,
) -> None:
    # The writer sends no NOTIFY at all: a reader in another App learns of new chunks only by its poll.
    half = threading.Event()
    async with other_app(dsn, schema, notify="off", poll_interval=0.2) as writer, \
            other_app(dsn, schema, poll_interval=0.2) as reader_app:

        @writer.workflow
        async def hundred() -> int:
            for i in range(100):
                if i == 50:
                    await gate_async(half)
                await pgflow.write_stream_async("s", i)
            await pgflow.close_stream_async("s")
            return 100

        h = await hundred.start_async()
        theirs = reader_app.handle(h.id)
        got: dict[str, list[Any]] = {}
        progress: list[Any] = []

        async def async_reader() -> None:
            async for value in theirs.stream_async("s"):
                progress.append(value)
            got["async"] = progress

        async def sync_reader() -> None:
            got["sync"] = await read_sync(theirs, "s")

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(async_reader)
                tg.start_soon(sync_reader)
                async with writer.worker(concurrency=2):
                    # The readers wait mid-stream on the poll while the writer is held.
                    await wait_until(lambda: len(progress) == 50, "the first half")
                    half.set()
                    assert await h.result_async(timeout=WAIT) == 100
        assert writer.stats().notify_flushes == 0
    assert got == {"async": list(range(100)), "sync": list(range(100))}


@pytest.mark.parametrize("kind", KINDS)
async def test_with_notify_off_readers_in_the_writing_app_are_woken_directly(
    dsn: str, schema: str, kind: str,
) -> None:
    # A slow poll: the reader would take minutes if only the poll woke it between chunks.
    async with other_app(dsn, schema, notify="off", poll_interval=SLOW_POLL) as app:

        @app.workflow
        async def trickle(n: int) -> int:
            for i in range(n):
                await anyio.sleep(0.01)  # the reader catches up and waits before each chunk
                await pgflow.write_stream_async("s", i)
            await pgflow.close_stream_async("s")
            return n

        h = await trickle.start_async(30)
        with anyio.fail_after(PING_WAIT):
            async with anyio.create_task_group() as tg:
                got: list[Any] = []

                async def reader() -> None:
                    got.extend(await read(kind, h, "s"))

                tg.start_soon(reader)
                async with app.worker(concurrency=2):
                    assert await h.result_async(timeout=PING_WAIT) == 30
        assert got == list(range(30))


@pytest.mark.parametrize("kind", KINDS)
async def test_a_second_app_in_the_same_process_is_woken_by_the_first_apps_pings(
    dsn: str, schema: str, kind: str,
) -> None:
    # The reading App polls every 60 s; everything must arrive well before that, by pings through its
    # own listener (in-process wakes reach only the writing App's own waiters).
    release = threading.Event()
    async with other_app(dsn, schema, poll_interval=0.5) as writer, \
            other_app(dsn, schema, poll_interval=SLOW_POLL) as reader_app:

        @writer.workflow
        async def gated(n: int) -> int:
            for i in range(n):
                if i == n // 2:
                    await gate_async(release)
                await pgflow.write_stream_async("s", i)
            await pgflow.close_stream_async("s")
            return n

        try:
            with anyio.fail_after(PING_WAIT):
                async with writer.worker(concurrency=2):
                    h = await gated.start_async(10)
                    theirs = reader_app.handle(h.id)
                    got: list[Any] = []
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(consume, kind, theirs, "s", got)
                        await wait_until(lambda: len(got) == 5, "the chunks before the gate")
                        release.set()  # the reader now waits for chunk 5
                    assert await theirs.result_async(timeout=PING_WAIT) == 10
            assert got == list(range(10))
        finally:
            release.set()


async def _listen(dsn: str, channel: str) -> psycopg.AsyncConnection[Any]:
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    await conn.execute(f'LISTEN "{channel}"')
    return conn


async def _received(app: pgflow.App, conn: psycopg.AsyncConnection[Any], timeout: float) -> list[str]:
    """Keys of every notification that arrives within ``timeout`` seconds, opened with ``app``'s keys."""
    keys: list[str] = []
    async for note in conn.notifies(timeout=timeout):
        news = opened(app, note.payload)
        assert news is not None
        keys.extend(named(news))
    return keys


@contextlib.asynccontextmanager
async def notifier_on_pool(app: pgflow.App, dsn: str, schema: str,
                           interval: float) -> AsyncIterator[tuple[Notifier, Any]]:
    """The runtime's notifier component, sending through a real pool of one connection and sealing
    with ``app``'s keys."""
    await app.migrate_async()  # (and the keyring loaded)
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(dsn, min_size=1, max_size=1, open=False,
                                                         kwargs={"autocommit": True})
    await pool.open(wait=True)

    async def the_pool() -> AsyncConnectionPool[Any]:
        return pool

    notifier = Notifier(the_pool, f"pgflow_{schema}", interval, lambda news: seal(app, news), Refusals())
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(notifier.run)
            yield notifier, pool
            tg.cancel_scope.cancel()
    finally:
        await pool.close()


async def test_a_flush_without_a_connection_is_logged_and_dropped_and_the_next_one_goes_out(
    app: pgflow.App, dsn: str, schema: str, caplog: pytest.LogCaptureFixture,
) -> None:
    # The pool holds one connection, which the test keeps busy in a real query (no mocks), so the
    # notifier's flush cannot get a connection within its timeout.
    listener = await _listen(dsn, f"pgflow_{schema}")

    async def flushed(counts: tuple[int, int]) -> None:
        with anyio.fail_after(WAIT):
            while (notifier.flushes, notifier.failed_flushes) != counts:
                await anyio.sleep(0.02)

    try:
        async with notifier_on_pool(app, dsn, schema, 0.005) as (notifier, pool):
            held, release = anyio.Event(), anyio.Event()

            async def hold() -> None:
                async with pool.connection() as conn:
                    await conn.execute("SELECT 1")
                    held.set()
                    await release.wait()

            async with anyio.create_task_group() as tg:
                tg.start_soon(hold)
                await held.wait()
                with caplog.at_level(logging.WARNING, logger="pgflow.signals"):
                    notifier.add(News(["s:lost:a", "s:lost:b"]))
                    await flushed((0, 1))  # the notifier's own flush failed, and it goes on
                release.set()
            assert (notifier.flushes, notifier.failed_flushes) == (0, 1)
            assert any("dropped 2 pings" in r.getMessage() for r in caplog.records), caplog.text

            # The connection is free again; the dropped pings are gone, the new ones go out.
            notifier.add(News(["s:kept:c"]))
            await flushed((1, 1))
            assert (notifier.flushes, notifier.failed_flushes) == (1, 1)
            assert await _received(app, listener, timeout=1.0) == ["s:kept:c"]
    finally:
        await listener.close()


async def test_one_overlong_key_does_not_drop_the_other_pings_of_its_flush(app: pgflow.App, dsn: str,
                                                                            schema: str) -> None:
    listener = await _listen(dsn, f"pgflow_{schema}")
    try:
        async with notifier_on_pool(app, dsn, schema, 3600) as (notifier, _):
            notifier.add(News([signal_keys.ended("x" * 8000), "s:ordinary:k"]))
            await notifier.flush()
            assert "s:ordinary:k" in await _received(app, listener, timeout=1.0)
    finally:
        await listener.close()


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
    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as tg:
            got: list[Any] = []

            async def reader() -> None:
                got.extend(await read(kind, h, "s"))

            tg.start_soon(reader)
            async with app.worker(concurrency=2):
                # In the body, stream_offset is how many chunks the stream holds.
                assert await h.result_async(timeout=WAIT) == [6, 7]
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
    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as tg:
            got: list[Any] = []

            async def reader() -> None:
                got.extend(await read(kind, h, "s"))

            tg.start_soon(reader)
            async with app.worker(concurrency=2):
                assert await h.result_async(timeout=WAIT) == 2
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
                                               limiter=_readers, abandon_on_cancel=True)
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


# -- 7. limits ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_chunk_and_key_limits_refuse_before_anything_is_written(
    app: pgflow.App, dsn: str, schema: str, kind: str,
) -> None:
    # msgpack frames bytes of this length with a 5-byte header: exactly MAX_CHUNK_BYTES encoded.
    biggest = b"x" * (MAX_CHUNK_BYTES - 5)
    assert len(codec.encode(biggest, "t")) == MAX_CHUNK_BYTES
    too_big = biggest + b"y"
    longest_key = "é" * (MAX_KEY_BYTES // 2)  # 256 bytes in UTF-8, 128 characters
    bad_keys: list[Any] = ["", "é" * (MAX_KEY_BYTES // 2 + 1), "k" * (MAX_KEY_BYTES + 1), None, 7]

    def attempts(write: Callable[[Any, Any], Any], close: Callable[[Any], Any]) -> list[Any]:
        return [lambda: write("s", too_big), *(lambda k=k: write(k, 1) for k in bad_keys),
                *(lambda k=k: close(k) for k in bad_keys), lambda: pgflow.stream_offset("")]

    @app.workflow
    async def limits_async() -> list[str]:
        await pgflow.write_stream_async("s", biggest)
        errors = []
        for attempt in attempts(pgflow.write_stream_async, pgflow.close_stream_async):
            try:
                result = attempt()
                if result is not None:
                    await result
            except ValueError as exc:
                errors.append(str(exc))
        await pgflow.write_stream_async("s", "after")
        await pgflow.write_stream_async(longest_key, "longest key")
        await pgflow.close_stream_async("s")
        return errors

    @app.workflow
    def limits_sync() -> list[str]:
        pgflow.write_stream("s", biggest)
        errors = []
        for attempt in attempts(pgflow.write_stream, pgflow.close_stream):
            try:
                attempt()
            except ValueError as exc:
                errors.append(str(exc))
        pgflow.write_stream("s", "after")
        pgflow.write_stream(longest_key, "longest key")
        pgflow.close_stream("s")
        return errors

    flow = limits_async if kind == "async" else limits_sync
    async with app.worker(concurrency=2):
        h = await flow.start_async()
        errors = await h.result_async(timeout=WAIT)
        with anyio.fail_after(WAIT):
            assert await read(kind, h, "s") == [biggest, "after"]
            assert await read(kind, h, longest_key) == ["longest key"]
    assert len(errors) == 1 + 2 * len(bad_keys) + 1
    assert f"the limit is {MAX_CHUNK_BYTES}" in errors[0]
    assert f"at most {MAX_KEY_BYTES} bytes" in errors[2]
    # Nothing was written for a refused chunk: the next one took the next position, with no gap.
    assert [p for p, _ in await stored(dsn, schema, h.id, "s")] == [0, 1, 2]
    rows = await query(dsn, f'SELECT DISTINCT key FROM "{schema}".streams WHERE workflow_id = %s', h.id)
    assert sorted(k for (k,) in rows) == sorted(["s", longest_key])

    # Readers check keys and offsets the same way, before touching the database.
    for key in ["", "k" * (MAX_KEY_BYTES + 1)]:
        with pytest.raises(ValueError):
            await read_async(h, key)
        with pytest.raises(ValueError):
            await read_sync(h, key)


async def test_three_thousand_keys_in_one_batch_reach_readers_in_two_apps(dsn: str, schema: str) -> None:
    # One batch of 3000 chunks: 3000 stream keys to ping at once, beyond both the 8000-byte NOTIFY
    # payload and the number of keys above which the notifier pings "wake all". Both Apps poll every
    # 60 s, so only pings deliver in time: the writing App's readers are woken directly, the second
    # App's through its listener. (tests/test_stream_faults.py does the same across processes.)
    keys = [f"key-{i:04d}" for i in range(3000)]
    sample = keys[::10]
    release = threading.Event()
    async with other_app(dsn, schema, poll_interval=SLOW_POLL) as app, \
            other_app(dsn, schema, poll_interval=SLOW_POLL) as second:

        @app.workflow
        async def fan_out(keys: list[str]) -> int:
            async def each(*args: Any) -> None:
                async with anyio.create_task_group() as tg:
                    for key in keys:
                        tg.start_soon(*args[:1], key, *args[1:])

            await each(pgflow.write_stream_async, 0)
            await gate_async(release)
            await each(pgflow.write_stream_async, 1)
            await each(pgflow.close_stream_async)
            return len(keys)

        h = await fan_out.start_async(keys)
        theirs = second.handle(h.id)
        got: dict[tuple[str, str], list[Any]] = {}

        async def reader(label: str, handle: pgflow.WorkflowHandle[Any], key: str) -> None:
            values = got[label, key] = []
            async for value in handle.stream_async(key):
                values.append(value)

        expected = len(keys) + len(sample)
        try:
            with anyio.fail_after(WAIT):
                async with anyio.create_task_group() as tg:
                    for key in keys:
                        tg.start_soon(reader, "same", h, key)
                    for key in sample:
                        tg.start_soon(reader, "second", theirs, key)
                    async with app.worker(concurrency=2):
                        await wait_until(lambda: len(got) == expected and all(got.values()),
                                         "chunk 0 of every key")
                        with anyio.fail_after(PING_WAIT):  # well within the polls
                            release.set()  # the readers all wait for chunk 1 now
                            assert await h.result_async(timeout=PING_WAIT) == len(keys)
                            await wait_until(lambda: sum(len(v) for v in got.values()) == 2 * expected,
                                             "chunk 1 of every key")
        finally:
            release.set()
    assert len(got) == expected
    assert all(values == [0, 1] for values in got.values())
    rows = await query(dsn, f'SELECT count(*), count(DISTINCT key), count(value) FROM "{schema}".streams'
                            " WHERE workflow_id = %s", h.id)
    assert rows == [(3 * len(keys), len(keys), 2 * len(keys))]


# -- 8. misuse ------------------------------------------------------------------------------------------


async def test_stream_functions_outside_a_workflow_raise_a_clear_error(app: pgflow.App) -> None:
    calls: list[Callable[[], Any]] = [
        lambda: pgflow.write_stream("s", 1), lambda: pgflow.close_stream("s"),
        lambda: pgflow.stream_offset("s"),
    ]
    for call in calls:
        with pytest.raises(RuntimeError, match="can only be called inside a workflow or step"):
            call()
    with pytest.raises(RuntimeError, match="can only be called inside a workflow or step"):
        await pgflow.write_stream_async("s", 1)
    with pytest.raises(RuntimeError, match="can only be called inside a workflow or step"):
        await pgflow.close_stream_async("s")

    @app.step
    def writes(n: int) -> int:
        pgflow.write_stream("s", n)
        return n

    # A step called outside any workflow is a plain call: it is not run by a worker either.
    with pytest.raises(RuntimeError, match="pgflow.write_stream can only be called inside a workflow"):
        writes(1)
    with pytest.raises(RuntimeError, match="can only be called inside a workflow or step"):
        await anyio.to_thread.run_sync(lambda: pgflow.write_stream("s", 1))


@pytest.mark.parametrize("where", ["workflow", "step"])
@pytest.mark.parametrize("what", ["write_stream", "close_stream"])
async def test_the_sync_twin_in_async_code_says_to_await_the_async_one(
    app: pgflow.App, dsn: str, schema: str, where: str, what: str,
) -> None:
    call = (lambda: pgflow.write_stream("s", 1)) if what == "write_stream" else (lambda: pgflow.close_stream("s"))

    @app.step
    async def async_step() -> None:
        call()

    @app.step
    def sync_step() -> str:
        # A def step runs in a thread, where the sync twin is the right one, even in an async workflow.
        pgflow.write_stream("t", "from a thread")
        return "ok"

    @app.workflow
    async def misuse() -> None:
        assert await sync_step() == "ok"
        if where == "workflow":
            call()
        else:
            await async_step()

    async with app.worker(concurrency=2):
        h = await misuse.start_async()
        with pytest.raises(pgflow.WorkflowFailed) as failed:
            await h.result_async(timeout=WAIT)
        with anyio.fail_after(WAIT):
            assert await read_async(h, "t") == ["from a thread"]
            assert await read_async(h, "s") == []
    assert failed.value.error_type == "RuntimeError"
    assert f"pgflow.{what} blocks" in failed.value.message
    assert f"await pgflow.{what}_async(...)" in failed.value.message
    assert await stored(dsn, schema, h.id, "s") == []


async def test_a_sync_reader_lets_go_of_its_stream_when_it_is_done(dsn: str, schema: str) -> None:
    """A sync reader, done or stopped early, leaves nothing waiting: its loop's listener closes."""
    async with pgflow.App(dsn, schema=schema, listen_idle=0.3) as app:
        @app.workflow(name="streams.three")
        async def three() -> None:
            for i in range(3):
                await pgflow.write_stream_async("s", i)
            await pgflow.close_stream_async("s")

        h = await three.start_async()
        async with app.worker():
            assert await h.result_async(timeout=WAIT) is None
        assert await anyio.to_thread.run_sync(lambda: list(h.stream("s"))) == [0, 1, 2]
        assert await anyio.to_thread.run_sync(lambda: next(iter(h.stream("s")))) == 0  # stopped early
        await wait_until(lambda: app.stats().listeners_connected == 0, "every listener to close")
