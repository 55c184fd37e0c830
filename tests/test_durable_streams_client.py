"""The official TypeScript client (@durable-streams/client, from npm) against ``pgflow streams serve``:
it follows a workflow's stream live over SSE and resumes exactly where it was after the server is
killed (SIGKILL) and started again; its IdempotentProducer writes a stream that a workflow reads.

The client runs as node scripts under conformance/ (``npm ci`` there installs it); without node or
those packages the tests are skipped, saying so.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import pytest

import pgflow
from pgflow.durable_streams import read_free_stream_async

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parent.parent
CONFORMANCE = ROOT / "conformance"
CLIENT = CONFORMANCE / "node_modules" / "@durable-streams" / "client"


@pytest.fixture
def node() -> str:
    found = shutil.which("node")
    if found is None:
        pytest.skip("node is not installed: the official TypeScript client cannot run")
    if not CLIENT.is_dir():
        pytest.skip("the npm packages are not installed: run `npm ci` in conformance/ (or make conformance)")
    return found


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_server(worker_env: dict[str, str], port: int) -> subprocess.Popen[bytes]:
    server = subprocess.Popen([sys.executable, "-m", "pgflow", "streams", "serve", "--port", str(port)],
                              env=worker_env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if server.poll() is not None:
            said = server.stderr.read().decode() if server.stderr else ""
            raise AssertionError(f"pgflow streams serve exited: {said}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return server
        except OSError:
            time.sleep(0.05)
    server.kill()
    raise AssertionError("pgflow streams serve did not listen within 30 s")


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def items(path: Path) -> list[Any]:
    return [item for line in lines(path) for item in line.get("items", [])]


async def until(predicate: Any, timeout: float, what: str, out: Path | None = None) -> None:
    with anyio.move_on_after(timeout):
        while not predicate():
            await anyio.sleep(0.05)
    assert predicate(), f"timed out waiting for {what}" + (f": {out.read_text()[-2000:]}" if out else "")


async def test_client_follows_a_workflow_stream_across_a_server_kill(
        app: pgflow.App, worker_env: dict[str, str], node: str, tmp_path: Path) -> None:
    first, second = anyio.Event(), anyio.Event()

    @app.workflow()
    async def tokens(n: int) -> None:
        for i in range(n):
            if i == 10:
                await first.wait()
            if i == 20:
                await second.wait()
            await pgflow.write_stream_async("tokens", {"i": i})
            await anyio.sleep(0.01)
        await pgflow.close_stream_async("tokens")

    port = free_port()
    server = start_server(worker_env, port)
    out = tmp_path / "follow.jsonl"
    follower: subprocess.Popen[bytes] | None = None
    try:
        async with app.worker(concurrency=2):
            handle = await tokens.start_async(30)
            with out.open("wb") as sink:
                follower = subprocess.Popen([node, "follow.mjs", f"http://127.0.0.1:{port}/workflows/{handle.id}/tokens"],
                                            cwd=CONFORMANCE, stdout=sink, stderr=subprocess.PIPE)
                await until(lambda: len(items(out)) == 10, 20, "the first ten tokens", out)
                server.send_signal(signal.SIGKILL)
                server.wait()
                first.set()  # tokens 10..19 are written while no server runs
                await until(lambda: len((await_info := handle.info()).streams) > 0
                            and await_info.streams[0].length >= 20, 20, "the workflow wrote on")
                server = start_server(worker_env, port)
                await until(lambda: len(items(out)) >= 20, 30, "the client came back for the tokens it missed", out)
                second.set()
                _ = await handle.result_async(timeout=30)
                await until(lambda: follower is not None and follower.poll() is not None, 30, "the client saw the end",
                            out)
        assert follower.returncode == 0, follower.stderr.read().decode() if follower.stderr else ""
        assert items(out) == [{"i": i} for i in range(30)]  # every token once, in order, across the kill
        assert lines(out)[-1]["end"] and lines(out)[-1]["closed"]
    finally:
        if follower is not None and follower.poll() is None:
            follower.kill()
        server.kill()
        server.wait()


async def test_idempotent_producer_writes_a_stream_a_workflow_reads(
        app: pgflow.App, worker_env: dict[str, str], node: str) -> None:
    @app.step()
    async def take(path: str) -> list[Any]:
        return [message async for _, message in read_free_stream_async(app, path, wait=1.0)]

    @app.workflow()
    async def consume(path: str) -> list[Any]:
        return await take(path)  # type: ignore[no-any-return]

    port = free_port()
    server = start_server(worker_env, port)
    try:
        async with app.worker(concurrency=2):
            count = 500
            url = f"http://127.0.0.1:{port}/orders/in"
            put = urllib.request.Request(url, method="PUT", headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(put, timeout=10) as created:  # noqa: S310 - our own server
                assert created.status == 201
            handle = await consume.start_async("/orders/in")  # it reads live, from before the first message
            done = await anyio.run_process([node, "produce.mjs", url, str(count)], cwd=CONFORMANCE, check=False)
            assert done.returncode == 0, done.stderr.decode()
            got: Any = await handle.result_async(timeout=60)
        assert got == [{"n": i} for i in range(count)]  # exactly once, in order
    finally:
        server.kill()
        server.wait()


def test_scripts_exist() -> None:
    for name in ("run.mjs", "suite.test.mjs", "follow.mjs", "produce.mjs", "reference-server.mjs", "package.json",
                 "package-lock.json"):
        assert (CONFORMANCE / name).is_file(), name
    assert "node_modules" in (CONFORMANCE / ".gitignore").read_text()
