"""What the stream tests share: reading a stream through the async or the sync API (sync readers in
threads of their own), the rows a stream left in the table, and bounded waits."""

from __future__ import annotations

import functools
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import pytest

import pgflow
from pgflow._core import codec

from .helpers import KINDS as KINDS  # (for the stream tests, which take everything from here)
from .helpers import query

WAIT = 60.0  # seconds: the bound of every wait on something a worker does
GATE_POLL = 0.01  # seconds between looks at a gate inside a workflow body
SLOW_POLL = 60.0  # the poll of an App whose readers must be woken by pings, not by the poll
PING_WAIT = 25.0  # seconds within which only a ping, not such a poll, can deliver

Ending = TypeVar("Ending", bound=BaseException)


# -- helpers ------------------------------------------------------------------------------------------------

READER_THREADS = anyio.CapacityLimiter(64)  # threads for sync readers, apart from the worker's own


async def read_async(handle: pgflow.WorkflowHandle[Any], key: str, offset: int = 0, *,
                     type: Any = Any) -> list[Any]:
    return [value async for value in handle.stream_async(key, offset, type=type)]


async def read_sync(handle: pgflow.WorkflowHandle[Any], key: str, offset: int = 0, *,
                    type: Any = Any) -> list[Any]:
    """``list(handle.stream(...))`` in a thread; abandoned (not awaited) if the test times out."""
    return await anyio.to_thread.run_sync(lambda: list(handle.stream(key, offset, type=type)),
                                          limiter=READER_THREADS, abandon_on_cancel=True)


async def read(kind: str, handle: pgflow.WorkflowHandle[Any], key: str, offset: int = 0, *,
               type: Any = Any) -> list[Any]:
    return await (read_async if kind == "async" else read_sync)(handle, key, offset, type=type)


async def consume(kind: str, handle: pgflow.WorkflowHandle[Any], key: str, into: list[Any],
                  offset: int = 0, *, at: int | None = None, then: Callable[[], object] = lambda: None,
                  then_async: Callable[[], Awaitable[object]] | None = None) -> None:
    """Read a stream to its end, appending each chunk to ``into`` as it arrives (progress is visible).
    Once ``into`` holds ``at`` chunks, ``then()`` is called (in the reader's thread for a sync
    reader), or for an async reader ``then_async()`` awaited when it is given."""
    if kind == "async":
        async for value in handle.stream_async(key, offset):
            into.append(value)
            if len(into) == at:
                await then_async() if then_async is not None else then()
    else:
        def run() -> None:
            for value in handle.stream(key, offset):
                into.append(value)
                if len(into) == at:
                    then()

        await anyio.to_thread.run_sync(run, limiter=READER_THREADS, abandon_on_cancel=True)


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


async def read_while_run(app: pgflow.App, kind: str, handle: pgflow.WorkflowHandle[Any], key: str, *,
                         result: Any, timeout: float = WAIT) -> list[Any]:
    """A reader attached from the start, while an in-process worker runs the workflow to its end
    (which must return ``result``); everything the reader read."""
    got: list[Any] = []
    with anyio.fail_after(timeout):
        async with anyio.create_task_group() as tg:

            async def reader() -> None:
                got.extend(await read(kind, handle, key))

            tg.start_soon(reader)
            async with app.worker(concurrency=2):
                assert await handle.result_async(timeout=timeout) == result
    return got


async def read_while_it_ends(app: pgflow.App, kind: str, handle: pgflow.WorkflowHandle[Any], key: str,
                             ending: type[Ending], *, at: int, then: Callable[[], object],
                             then_async: Callable[[], Awaitable[object]] | None = None) -> tuple[list[Any], Ending]:
    """A reader attached from the start, while an in-process worker runs the workflow until its result
    raises ``ending`` (it failed, it was cancelled); once the reader holds ``at`` chunks it calls ``then``
    (or awaits ``then_async``), as ``consume`` does. Everything the reader read, and that exception."""
    got: list[Any] = []
    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(consume, kind, handle, key, got, at=at, then=then, then_async=then_async))
            async with app.worker(concurrency=2):
                with pytest.raises(ending) as ended:
                    await handle.result_async(timeout=WAIT)
    return got, ended.value
