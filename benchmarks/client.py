"""The caller process of the tasks benchmark: ``python -m benchmarks.client SYSTEM ROLE ...``.

It imports only ``benchmarks.peers.<SYSTEM>``, so each system's client runs in a process of its own, as a
user's would, and prints one JSON line (its measurements) on stdout; everything else goes to stderr.

Roles:
  enqueue --plan 1:1000,16:4000   install the system's schema, then, for each pair, ``callers:n``: start n
                                  no-op tasks from that many concurrent callers, timed (enqueue/s each)
  latency --runs 200 --warmup 20  start a no-op task and wait for its result, one after another
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import sys
import threading
from typing import Any


def watchdog(seconds: float) -> None:
    """Every run has a deadline, also when the orchestrator that would kill this process is gone."""
    timer = threading.Timer(seconds, lambda: os._exit(3))
    timer.daemon = True
    timer.start()


async def run(a: argparse.Namespace) -> dict[str, Any]:
    peer: Any = importlib.import_module(f"benchmarks.peers.{a.system}_peer")
    try:
        if a.role == "enqueue":
            await peer.setup()
            rates = []
            for pair in a.plan.split(","):
                callers, n = (int(x) for x in pair.split(":"))
                seconds = await peer.enqueue(n, callers)
                rates.append({"callers": callers, "n": n, "seconds": seconds, "per_s": n / seconds})
            return {"enqueue": rates}
        latencies = await peer.latency(a.warmup + a.runs)
        return {"latencies_ms": latencies[a.warmup:]}
    finally:
        await peer.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("system")
    p.add_argument("role", choices=["enqueue", "latency"])
    p.add_argument("--plan", default="1:1000,16:4000")
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--deadline", type=float, default=600.0)
    a = p.parse_args(argv)
    watchdog(a.deadline)
    stdout = sys.stdout
    sys.stdout = sys.stderr  # libraries that print do not spoil the one line the orchestrator reads
    result = asyncio.run(run(a))
    stdout.write(json.dumps(result) + "\n")
    stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
