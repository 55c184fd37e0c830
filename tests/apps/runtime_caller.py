"""An async caller process: starts workflows, reads their streams and waits for their results, all
on its own event loop, and reports every thread it saw meanwhile (``python -m tests.apps.runtime_caller
N``; prints one JSON line)."""

from __future__ import annotations

import asyncio
import sys
import threading

import msgspec

from .runtime_app import app, tokens


def threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate())


async def main(workflows: int) -> None:
    seen: set[str] = set(threads())
    handles = [await tokens.start_async(50) for _ in range(workflows)]
    seen.update(threads())
    chunks: list[list[str]] = []
    for handle in handles:
        got: list[str] = []
        async for token in handle.stream_async("tokens"):
            got.append(token)
            seen.update(threads())
        chunks.append(got)
    results = [await handle.result_async(timeout=60) for handle in handles]
    seen.update(threads())
    stats = app.stats()
    await app.close_async()
    seen.update(threads())
    print(msgspec.json.encode({"results": results, "chunks": chunks, "threads": sorted(seen),
                               "listeners": stats.listeners_connected, "runtimes": stats.runtimes}).decode())


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
