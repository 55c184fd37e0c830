"""The role side of streams.py: what every writer and reader process shares, whatever its design.

A role process talks to the orchestrator in ``@@ {json}`` lines on stdout and hears "go" (or "stop") on
stdin. Every chunk is ``[time.time() just before its write, its number, "tok"]``, so the reader knows each
chunk's write-to-read latency and whether its stream came whole and in order.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from benchmarks.harness import latency_summary, self_cpu

STREAM_KEY = "tokens"

_lines: queue.Queue[str] = queue.Queue()


def emit(event: str, **data: Any) -> None:
    """One line to the orchestrator."""
    sys.stdout.write("@@ " + json.dumps({"event": event, **data}) + "\n")
    sys.stdout.flush()


def watch_orchestrator(deadline: float) -> None:
    """Read the orchestrator's lines, and exit at once if the orchestrator goes away (stdin closes) or
    the run overstays its deadline, so no process outlives a benchmark."""

    def read_stdin() -> None:
        for line in sys.stdin:
            _lines.put(line.strip())
        os._exit(2)

    def overstay() -> None:
        time.sleep(deadline)
        sys.stderr.write(f"role process still running after {deadline:.0f}s; exiting\n")
        os._exit(4)

    threading.Thread(target=read_stdin, daemon=True, name="bench-stdin").start()
    threading.Thread(target=overstay, daemon=True, name="bench-deadline").start()


async def next_line() -> str:
    return await asyncio.to_thread(_lines.get)


async def wait_for_go() -> None:
    line = await next_line()
    if line != "go":
        raise SystemExit(f"expected 'go' from the orchestrator, got {line!r}")


def stream_id(run: str, i: int) -> str:
    return f"bench-{run}-{i}"


async def gather_all(tasks: list[asyncio.Task[Any]]) -> None:
    """All of them, or none left running once one fails."""
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


class Tally:
    """What a writer process records: when the first write started and the last one returned."""

    def __init__(self) -> None:
        self.first_write = float("inf")
        self.last_write = 0.0
        self.last_close = 0.0
        self.started = 0
        self.finished = 0

    async def produce(self, chunks: int, write: Callable[[list[Any]], Awaitable[Any]],
                      close: Callable[[], Awaitable[Any]], go: asyncio.Event) -> None:
        """One producer, the same for every design so that only the design differs: counted as started,
        parked until the go, then ``chunks`` writes flat out and the stream's close."""
        self.started += 1
        await go.wait()
        for n in range(chunks):
            ts = time.time()
            self.first_write = min(self.first_write, ts)
            await write([ts, n, "tok"])
            self.last_write = max(self.last_write, time.time())
        await close()
        self.last_close = max(self.last_close, time.time())
        self.finished += 1

    async def released(self, streams: int, go: asyncio.Event,
                       done: Callable[[], Awaitable[Any]]) -> tuple[float, float]:
        """Once all ``streams`` producers are parked, say "ready", wait for the orchestrator's go, release
        them and await ``done``. Returns the CPU seconds this process spent from the go, and when it was."""
        while self.started < streams:  # for the frameworks: every workflow claimed and parked
            await asyncio.sleep(0.01)
        emit("ready")
        await wait_for_go()
        cpu0, t_go = self_cpu(), time.time()
        go.set()
        await done()
        return self_cpu() - cpu0, t_go

    async def all_finished(self, streams: int) -> None:
        """Counted in the bodies rather than by a result waiter per workflow, which would load the writer
        process (pgflow's result_async polls each one's row at its poll_interval)."""
        while self.finished < streams:
            await asyncio.sleep(0.005)

    def result(self, chunks: int, cpu: float, go: float, **extra: Any) -> dict[str, Any]:
        window = self.last_write - self.first_write
        return {
            "chunks": chunks, "first_write": self.first_write, "last_write": self.last_write,
            "last_close": self.last_close, "write_seconds": window,
            "chunks_per_s": chunks / window if window > 0 else float("nan"),
            "cpu_seconds": cpu, "cpu_share": cpu / max(1e-9, self.last_close - go), **extra,
        }


class Reads:
    """What a reader process records: every chunk's latency, and that each stream came whole and in order."""

    def __init__(self, streams: int, chunks: int) -> None:
        self.chunks = chunks
        self.latencies: list[float] = []
        self.counts = [0] * streams
        self.errors: list[str] = []
        self.last_end = 0.0

    def chunk(self, i: int, value: Any) -> None:
        now = time.time()
        ts, n = value[0], value[1]
        self.latencies.append(now - ts)
        if n != self.counts[i] and len(self.errors) < 20:
            self.errors.append(f"stream {i}: chunk {n} arrived at position {self.counts[i]}")
        self.counts[i] += 1

    def end(self, i: int) -> None:
        self.last_end = max(self.last_end, time.time())
        if self.counts[i] != self.chunks and len(self.errors) < 20:
            self.errors.append(f"stream {i}: {self.counts[i]} chunks read, {self.chunks} written")

    async def follow(self, readers: list[Coroutine[Any, Any, None]]) -> dict[str, Any]:
        """Run the readers; say "ready" a second in (every stream attached, before the writer's go); return
        the result once they have all read to the end, CPU counted from when they started."""
        ready_cpu, ready = self_cpu(), time.time()
        tasks = [asyncio.create_task(r) for r in readers]
        await asyncio.sleep(1.0)
        emit("ready")
        await gather_all(tasks)
        return self.result(self_cpu() - ready_cpu, ready)

    def result(self, cpu: float, ready: float) -> dict[str, Any]:
        return {
            "latency": latency_summary(self.latencies), "chunks_read": sum(self.counts),
            "last_end": self.last_end, "errors": self.errors, "cpu_seconds": cpu,
            "cpu_share": cpu / max(1e-9, self.last_end - ready),
        }
