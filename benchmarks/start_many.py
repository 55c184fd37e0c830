"""Bulk starts from one caller: ``start_many_async`` of 1,000, 5,000 and 20,000 no-op workflows.

    python benchmarks/start_many.py [--dsn postgresql://postgres@127.0.0.1:5432/test] [--repeats 3]

Each size is started ``--repeats`` times into a database of its own (``bench_start_many``, dropped and
created again); workflows/s per call, the median printed. No worker runs: what is timed is the one
statement per call (arguments checked and encoded first, ids returned in order).
"""

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import pgflow  # noqa: E402
from benchmarks import harness  # noqa: E402


async def run(dsn: str, repeats: int) -> None:
    app = pgflow.App(harness.recreate_database(dsn, "bench_start_many"))

    @app.workflow(name="bench.noop")
    async def noop() -> None:
        return None

    try:
        await app.migrate_async()
        await noop.start_many_async([()] * 100)  # the connection and the statement's plan are ready
        for size in (1_000, 5_000, 20_000):
            rates = []
            for _ in range(repeats):
                began = time.perf_counter()
                await noop.start_many_async([()] * size)
                rates.append(size / (time.perf_counter() - began))
            print(f"start_many of {size:>6,}: median {statistics.median(rates):>8,.0f} workflows/s "
                  f"({' / '.join(f'{r:,.0f}' for r in rates)})")
    finally:
        await app.close_async()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/test")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    asyncio.run(run(a.dsn, a.repeats))


if __name__ == "__main__":
    main()
