"""A periodic job: a cron schedule starts it, a durable sleep spaces its two halves.

    python examples/periodic.py              # runs until Ctrl-C
    python examples/periodic.py --runs 2     # exits once two runs have finished

``periodic.report`` is registered with ``schedule=``: one of the workers that serve its queue (another
takes over when it dies) starts it at each tick of the cron expression (UTC; six fields put seconds
first) under the id ``periodic.report@<tick>``, so a tick runs once however many workers there are. Each run collects a
figure (a step), sleeps durably while late data comes in, then publishes (another step). The sleep's
wake-up time is journaled: a worker that dies meanwhile costs nothing, the next one wakes the run on
time, and a sleep longer than the App's ``suspend_after`` (5 s) gives its worker slot back meanwhile.

``PERIODIC_SCHEDULE`` (default every 10 seconds: ``*/10 * * * * *``; a real job would say something
like ``0 3 * * *``, 03:00 every day) and ``PERIODIC_SLEEP`` (seconds, default 6) change the timing.
The database is $PGFLOW_DSN, or the embedded PostgreSQL in ./.pgflow.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from datetime import UTC, datetime
from typing import Any

import pgflow

app = pgflow.App()  # $PGFLOW_DSN (and $PGFLOW_SCHEMA), or the embedded PostgreSQL under ./.pgflow

SCHEDULE = os.environ.get("PERIODIC_SCHEDULE", "*/10 * * * * *")
SLEEP = float(os.environ.get("PERIODIC_SLEEP", "6"))


@app.step(name="periodic.collect")
async def collect(tick: datetime) -> dict[str, Any]:
    """Stands for the real work (query a metric, fetch a feed); its output is journaled."""
    return {"tick": tick.isoformat(), "collected_at": time.time()}


@app.step(name="periodic.publish")
async def publish(collected: dict[str, Any]) -> float:
    return time.time()


@app.workflow(name="periodic.report", schedule=SCHEDULE)
async def report(tick: datetime) -> dict[str, Any]:
    collected = await collect(tick)
    await pgflow.sleep_async(SLEEP)  # durable: a replay after a crash sleeps only what is left
    published_at = await publish(collected)
    return {**collected, "published_at": published_at}


async def main(runs: int | None) -> int:
    """Serve the schedule and print each run as it finishes, until ``runs`` have (or forever)."""
    since, seen = datetime.now(UTC), set[str]()
    try:
        async with app.worker(concurrency=4):
            print(f"serving {report.name!r} on schedule {SCHEDULE!r}, sleeping {SLEEP}s in each run", flush=True)
            while runs is None or len(seen) < runs:
                for record in await app.list_workflows_async(name=report.name, status="succeeded",
                                                              created_after=since, order="asc"):
                    if record.id in seen or len(seen) == runs:
                        continue
                    seen.add(record.id)
                    result = await app.handle(record.id).result_async()
                    print(f"{record.id}: collected, slept {result['published_at'] - result['collected_at']:.1f}s, "
                          "published", flush=True)
                await asyncio.sleep(0.5)  # a console's refresh, not synchronisation
        return 0
    finally:
        await app.close_async()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="serve a scheduled workflow and print its runs")
    parser.add_argument("--runs", type=int, help="exit after this many runs have finished")
    try:
        sys.exit(asyncio.run(main(parser.parse_args().runs)))
    except KeyboardInterrupt:
        sys.exit(130)
