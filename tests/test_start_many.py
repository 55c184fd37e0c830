"""Bulk start: many workflows in one statement, checked first, idempotent with ids, sync and async."""

from __future__ import annotations

from typing import Any

import anyio
import psycopg
import pytest

import pgflow

pytestmark = pytest.mark.anyio

WAIT = 60.0


def count(dsn: str, schema: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(f'SELECT count(*) FROM "{schema}".workflows').fetchone()
        return int(row[0]) if row else 0


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_start_many_starts_every_call_in_order_and_each_runs(app: pgflow.App, kind: str) -> None:
    @app.workflow
    async def double(x: int) -> int:
        return 2 * x

    calls = [(i,) for i in range(500)]
    if kind == "sync":
        handles = await anyio.to_thread.run_sync(double.start_many, calls)
    else:
        handles = await double.start_many_async(calls)
    assert len({h.id for h in handles}) == 500
    async with app.worker(concurrency=32):
        with anyio.fail_after(WAIT):
            assert [await h.result_async() for h in handles] == [2 * i for i in range(500)]


async def test_start_many_with_ids_starts_each_id_once_and_returns_existing_ones(
    app: pgflow.App, dsn: str, schema: str,
) -> None:
    @app.workflow
    async def echo(x: int) -> int:
        return x

    first = await echo.start_many_async([(1,), (2,)], ids=["a", "b"])
    again = await echo.with_options(priority=3).start_many_async([(10,), (20,), (30,), (40,)],
                                                                 ids=["b", "c", "c", "a"])
    assert [h.id for h in first] == ["a", "b"] and [h.id for h in again] == ["b", "c", "c", "a"]
    assert count(dsn, schema) == 3  # a, b and one c
    async with app.worker(concurrency=4):
        with anyio.fail_after(WAIT):
            # The first arguments win, as with start().
            assert [await h.result_async() for h in again] == [2, 20, 20, 1]


async def test_start_many_checks_every_argument_before_writing_anything(
    app: pgflow.App, dsn: str, schema: str,
) -> None:
    @app.workflow
    async def takes_int(x: int) -> None: ...

    await app.migrate_async()
    calls: list[Any] = [(i,) for i in range(100)]
    calls[57] = ("not a number",)
    with pytest.raises(pgflow.SerializationError, match="argument 'x'"):
        await takes_int.start_many_async(calls)
    with pytest.raises(TypeError, match="one tuple of arguments per workflow"):
        await takes_int.start_many_async([1, 2])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="one id per call"):
        await takes_int.start_many_async([(1,), (2,)], ids=["only-one"])
    with pytest.raises(ValueError, match="workflow id must not contain NUL"):
        await takes_int.start_many_async([(1,)], ids=["a\x00"])
    assert count(dsn, schema) == 0


async def test_start_many_refuses_ids_of_another_workflow_and_starts_the_rest(
    app: pgflow.App, dsn: str, schema: str,
) -> None:
    @app.workflow
    async def one(x: int) -> None: ...

    @app.workflow
    async def other(x: int) -> None: ...

    await other.with_options(id="taken").start_async(0)
    with pytest.raises(pgflow.WorkflowConflict, match="'taken'"):
        await one.start_many_async([(1,), (2,)], ids=["free", "taken"])
    assert count(dsn, schema) == 2
    assert await app.handle("free").status_async() == "queued"
