"""Starting, running and reading workflows in one process, through the sync and async twins."""

from __future__ import annotations

import pytest

import pgflow

from .helpers import Point

pytestmark = pytest.mark.anyio


def build(app: pgflow.App) -> dict[str, pgflow.Workflow]:  # type: ignore[type-arg]
    @app.step
    async def add(a: int, b: int) -> int:
        return a + b

    @app.step
    def scale(p: Point, k: int) -> Point:
        return Point(p.x * k, p.y * k)

    @app.workflow
    async def async_flow(p: Point, k: int) -> Point:
        q = await scale(p, k)
        return Point(await add(q.x, 1), await add(q.y, 1))

    @app.workflow
    def sync_flow(p: Point, k: int) -> Point:
        q = scale(p, k)
        return Point(add(q.x, 1), add(q.y, 1))

    return {"async": async_flow, "sync": sync_flow}


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_async_api_runs_both_kinds(app: pgflow.App, kind: str) -> None:
    flows = build(app)
    async with app.worker(concurrency=4):
        handle = await flows[kind].start_async(Point(1, 2), 10)
        assert await handle.result_async(timeout=30) == Point(11, 21)
        assert await handle.status_async() == "succeeded"


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_sync_api_from_a_thread_matches(app: pgflow.App, kind: str) -> None:
    import anyio

    flows = build(app)
    async with app.worker(concurrency=4):
        def caller() -> tuple[Point, str]:
            handle = flows[kind].start(Point(3, 4), 2)
            return handle.result(timeout=30), handle.status()

        result, status = await anyio.to_thread.run_sync(caller)
        assert result == Point(7, 9)
        assert status == "succeeded"
