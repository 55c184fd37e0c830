"""Workflows for the dashboard's tests (tests/test_dashboard*.py): a stream written slowly, a failure
with a traceback, one that fails until a file exists (to resume), one that runs until cancelled, a
parent with children, events and messages. ``define`` registers them on any App; ``app`` is the one
a worker process serves (``pgflow worker tests.apps.dashboard:app``)."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pgflow


def define(app: pgflow.App) -> SimpleNamespace:
    @app.step(name="dash.write")
    async def write(n: int, delay: float) -> int:
        for i in range(pgflow.stream_offset("out"), n):
            await asyncio.sleep(delay)
            await pgflow.write_stream_async("out", f"line {i}")
        return n

    @app.workflow(name="dash.writer")
    async def writer(n: int, delay: float) -> int:
        await pgflow.set_event_async("stage", "writing")
        written = await write(n, delay)
        await pgflow.close_stream_async("out")
        return written

    @app.step(name="dash.explode")
    def explode(message: str) -> None:
        raise ValueError(message)

    @app.workflow(name="dash.fails")
    async def fails(message: str) -> None:
        await write(2, 0.0)
        await explode(message)

    @app.step(name="dash.check_file")
    def check_file(path: str) -> str:
        if not os.path.exists(path):
            raise FileNotFoundError(f"waiting for {path}")
        return "found"

    @app.workflow(name="dash.until_file")
    async def until_file(path: str) -> str:
        return await check_file(path)

    @app.step(name="dash.spin")
    async def spin(seconds: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while loop.time() < deadline:
            await asyncio.sleep(0.1)

    @app.workflow(name="dash.runs_long")
    async def runs_long(seconds: float) -> str:
        await spin(seconds)
        return "done"

    @app.workflow(name="dash.child")
    async def child(i: int) -> int:
        return i * i

    @app.workflow(name="dash.parent")
    async def parent(n: int) -> int:
        handles = [await child.start_async(i) for i in range(n)]
        await pgflow.set_event_async("children", n)
        await pgflow.sleep_async(0.1)
        total = sum([await h.result_async() for h in handles])
        await app.handle(handles[0].id).send_async("note", {"from": "parent"})
        return total

    return SimpleNamespace(writer=writer, fails=fails, until_file=until_file, runs_long=runs_long, parent=parent,
                           child=child)


app = pgflow.App(poll_interval=0.5)
workflows = define(app)
