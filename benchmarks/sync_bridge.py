"""What the sync API's bridge costs per call: pgflow's loop thread (``_core/sync.py``: a plain event loop in
a daemon thread, reached by ``asyncio.run_coroutine_threadsafe``) against anyio's blocking portal (the
library's public way: ``start_blocking_portal`` and ``start_task_soon``), each running a coroutine that
does nothing, so the figure is the bridge alone.

    python -m benchmarks.sync_bridge [--calls 5000] [--rounds 7]

Printed: the median over rounds of the microseconds per call, for each, rounds alternated.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import anyio.from_thread

from pgflow._core.sync import LoopThread


async def _nothing() -> int:
    return 1


async def _stop() -> None:
    pass


def _timed(call: Callable[[], object], calls: int) -> float:
    began = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - began) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    loop_thread = LoopThread("bench-loop-thread", _stop)
    results: dict[str, list[float]] = {"loop thread": [], "anyio portal": []}
    with anyio.from_thread.start_blocking_portal() as portal:
        ways: dict[str, Callable[[], object]] = {
            "loop thread": lambda: loop_thread.run(_nothing),
            "anyio portal": lambda: portal.start_task_soon(_nothing).result(),
        }
        for way in ways.values():  # warm up
            _timed(way, 500)
        for r in range(a.rounds):
            for name in (list(ways) if r % 2 == 0 else list(reversed(ways))):
                results[name].append(_timed(ways[name], a.calls))
    loop_thread.stop()
    for name, figures in results.items():
        print(f"{name}: {statistics.median(figures):.1f} us per call (rounds: {' '.join(f'{x:.0f}' for x in figures)})")


if __name__ == "__main__":
    main()
