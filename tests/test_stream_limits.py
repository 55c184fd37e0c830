"""Stream limits and misuse: chunk and key sizes refused before anything is written, thousands of keys in
one batch, stream calls outside a workflow or through the wrong twin, a sync reader letting go.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import anyio
import pytest

import pgflow
from pgflow._core import codec
from pgflow.streams import MAX_CHUNK_BYTES, MAX_KEY_BYTES

from .helpers import ONE_SERVER, query
from .streaming import (
    KINDS,
    PING_WAIT,
    SLOW_POLL,
    WAIT,
    gate_async,
    other_app,
    read,
    read_async,
    read_sync,
    stored,
    wait_until,
)

pytestmark = pytest.mark.anyio



# -- 7. limits ---------------------------------------------------------------------------------------------


@ONE_SERVER  # sizes are checked in Python before any statement: the same on any server
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


@ONE_SERVER  # a misuse refused in Python: the same on any server
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
