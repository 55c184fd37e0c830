"""What noting every step attempt's start costs: workflows of ten trivial steps in one worker.

    python benchmarks/step_attempts.py [--dsn postgresql://postgres@127.0.0.1:5432/test] [--rounds 5]

Three ways, run side by side in rounds (each in a schema of its own, dropped after): ``none`` (the
notes replaced by a stub: what steps cost without them), ``direct`` (one statement per note), and
``batched`` (pgflow's: the notes of every step starting in the worker group-committed). 400 workflows
of 10 steps each, ``app.worker(concurrency=32)``; steps/s from the first claim to the last result.
"""

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import psycopg  # noqa: E402

import pgflow  # noqa: E402
from pgflow._core.engine import Engine  # noqa: E402
from pgflow._core.step_starts import StepStarts  # noqa: E402

real_steps, real_note = Engine.start_steps, StepStarts.note


async def noop(self: Engine, notes: list[tuple[str, int, int, int, int]]) -> list[tuple[bool, bool]]:
    return [(True, False)] * len(notes)


async def direct(self: StepStarts, *note: int | str) -> tuple[bool, bool]:
    [answer] = await self._store.journal.start_steps([note])  # type: ignore[list-item]
    return answer


async def run(dsn: str, mode: str) -> float:
    Engine.start_steps = noop if mode == "none" else real_steps  # type: ignore[method-assign]
    StepStarts.note = direct if mode == "direct" else real_note  # type: ignore[method-assign,assignment]
    schema = f"bench_steps_{uuid.uuid4().hex[:8]}"
    app = pgflow.App(dsn, schema=schema, retention=None)

    @app.step
    async def s(i: int) -> int:
        return i + 1

    @app.workflow(name="w")
    async def w(n: int) -> int:
        for _ in range(10):
            n = await s(n)
        return n

    try:
        await app.migrate_async()
        handles = await w.start_many_async([(i,) for i in range(400)])
        t = time.monotonic()
        async with app.worker(concurrency=32):
            for h in handles:
                await h.result_async(timeout=120)
        return 4000 / (time.monotonic() - t)
    finally:
        await app.close_async()
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(f'DROP SCHEMA "{schema}" CASCADE')


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    modes = ["none", "direct", "batched"]
    res: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for m in modes:
            res[m].append(await run(args.dsn, m))
    for m in modes:
        print(m, [round(x) for x in res[m]], "median", round(statistics.median(res[m])))
    for m in modes[1:]:
        print(m, "/ none per round", [round(a / b, 2) for a, b in zip(res[m], res["none"], strict=True)],
              "median", round(statistics.median(a / b for a, b in zip(res[m], res["none"], strict=True)), 2))


if __name__ == "__main__":
    asyncio.run(main())
