"""The Python client of the Durable Streams protocol (``durable-streams`` on PyPI, ElectricSQL's, 0.1)
against ``pgflow streams serve``: it follows a workflow's stream live, over SSE and by long-poll, and
writes a free-standing stream (with ``Stream-Seq``) that a workflow reads.

That client speaks the protocol's core (create, append, HEAD, reads from an offset, live modes,
``Stream-Seq``, delete) but neither its idempotent producers nor closure: it sends no ``Producer-*``
header and reads no ``Stream-Closed``, so it ends a live read of a closed stream only when its caller
stops (the TypeScript client's tests cover those parts, tests/test_durable_streams_client.py).
"""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest
from durable_streams import DurableStream, SeqConflictError, stream

import pgflow
from pgflow.durable_streams import read_free_stream_async

from .helpers import ONE_SERVER
from .test_durable_streams_client import free_port, start_server

pytestmark = [pytest.mark.anyio, ONE_SERVER]  # (an HTTP client's interplay: the statements are the server's
# own, tested on both servers by tests/test_durable_streams.py)


def follow(url: str, mode: str, until: int, got: list[Any]) -> None:
    """Read ``url`` live from its start, keeping each message, until the one whose ``i`` is ``until``."""
    with stream(url, offset="-1", live=mode) as response:  # type: ignore[arg-type]
        for message in response.iter_json():
            got.append(message)
            if message["i"] == until:
                return


async def test_python_client_follows_a_workflow_stream_over_sse_and_long_poll(
        app: pgflow.App, worker_env: dict[str, str]) -> None:
    go = anyio.Event()

    @app.workflow()
    async def tokens(n: int) -> None:
        for i in range(n):
            if i == 5:
                await go.wait()  # the rest are written while both clients wait live
            await pgflow.write_stream_async("tokens", {"i": i})
        await pgflow.close_stream_async("tokens")

    port = free_port()
    server = start_server(worker_env, port)
    try:
        async with app.worker(concurrency=2):
            handle = await tokens.start_async(40)
            url = f"http://127.0.0.1:{port}/workflows/{handle.id}/tokens"
            got: dict[str, list[Any]] = {"sse": [], "long-poll": []}
            readers = [threading.Thread(target=follow, args=(url, mode, 39, got[mode]), daemon=True) for mode in got]
            for reader in readers:
                reader.start()
            with anyio.fail_after(30):
                while min(len(messages) for messages in got.values()) < 5:
                    await anyio.sleep(0.05)
            go.set()
            await handle.result_async(timeout=30)
            for reader in readers:
                await anyio.to_thread.run_sync(reader.join, 30.0)
                assert not reader.is_alive(), "a live read did not get the stream's last message"
        for mode, messages in got.items():
            assert messages == [{"i": i} for i in range(40)], mode  # every message once, in order
        with pytest.raises(Exception, match="405"):  # a workflow's stream is read-only
            DurableStream(url).append({"i": 40})
    finally:
        server.kill()
        server.wait()


async def test_python_client_writes_a_stream_a_workflow_reads(app: pgflow.App, worker_env: dict[str, str]) -> None:
    @app.step()
    async def take(path: str, count: int) -> list[Any]:
        taken = []
        async for _, message in read_free_stream_async(app, path, wait=1.0):
            taken.append(message)
            if len(taken) == count:
                break
        return taken

    @app.workflow()
    async def consume(path: str, count: int) -> list[Any]:
        return await take(path, count)  # type: ignore[no-any-return]

    port = free_port()
    server = start_server(worker_env, port)
    try:
        async with app.worker(concurrency=2):
            url = f"http://127.0.0.1:{port}/orders/in"
            writer = await anyio.to_thread.run_sync(
                lambda: DurableStream.create(url, content_type="application/json"))
            handle = await consume.start_async("/orders/in", 100)  # it reads live, from before the first message

            def write() -> None:
                for n in range(100):
                    writer.append({"n": n}, seq=f"{n:06d}")
                with pytest.raises(SeqConflictError):  # a sequence number that does not grow is refused
                    writer.append({"n": 99}, seq=f"{99:06d}")

            await anyio.to_thread.run_sync(write)
            got: Any = await handle.result_async(timeout=60)
            head = await anyio.to_thread.run_sync(writer.head)
        assert got == [{"n": n} for n in range(100)]  # once each, in order: the refused append wrote nothing
        assert head.exists and head.content_type == "application/json"
    finally:
        server.kill()
        server.wait()
