"""Start-to-result's floor in bare async psycopg, and what pgflow's own statements add to it.

    python -m benchmarks.latency_floor [--dsn postgresql://...] [--runs 600] [--rounds 3]

A caller (this process) inserts a workflow with its NOTIFY, durably, and waits on its LISTEN
connection for the end; a worker (a process of its own) LISTENs, claims the row without waiting for
the disk, and records the end with a NOTIFY to the caller, durably. Both on pgflow's own table, on
generic plans as pgflow's connections run them. The variants put pgflow's claim (``CLAIM``) and its
end batch (``FINISH``) in place of the bare statements, one at a time and together, so what each
costs on the path is measured with no framework around it; ``pgflow`` is then the real thing, a
``pgflow worker`` process and a caller's ``start_async`` / ``result_async``. Rounds alternate the
variants; printed: each variant's p50 per round and the median (ms).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout

import pgflow  # noqa: E402
from benchmarks import harness  # noqa: E402
from pgflow._core.engine import arrays, quote_identifier  # noqa: E402
from pgflow._core.engine.claims import CLAIM  # noqa: E402
from pgflow._core.engine.ends import FINISH  # noqa: E402

SCHEMA = "bench_floor"
QUEUE = "floor"
NAME = "floor.noop"
VARIANTS = {"bare": (False, False), "claim": (True, False), "end": (False, True), "both": (True, True)}
GENERIC = "-c plan_cache_mode=force_generic_plan -c jit=off"



async def _noop() -> None:
    return None


def workflows(dsn: str | None) -> tuple[pgflow.App, Any]:
    """The App of the floor's schema and its no-op workflow."""
    floor = pgflow.App(dsn, schema=SCHEMA)
    return floor, floor.workflow(name=NAME, queue=QUEUE)(_noop)


app, _ = workflows(os.environ.get("PGFLOW_DSN"))  # the ``pgflow worker`` variant's (``benchmarks.latency_floor:app``)


def statements() -> dict[str, str]:
    s = quote_identifier(SCHEMA)
    return {
        "start": f"WITH x AS (INSERT INTO {s}.workflows (id, name, queue, priority, inputs, due_at, max_attempts)"
                 f" VALUES (%s, '{NAME}', '{QUEUE}', 0, '\\x80', now(), 20)) SELECT pg_notify('floor_start', %s)",
        "claim": f"WITH l AS (SELECT set_config('synchronous_commit', 'off', true)) UPDATE {s}.workflows"
                 " SET status = 'running', lease_token = 1 WHERE id = (SELECT id FROM"
                 f" {s}.workflows WHERE status = 'queued' AND queue = '{QUEUE}' ORDER BY due_at LIMIT 1"
                 " FOR UPDATE SKIP LOCKED) AND EXISTS (SELECT FROM l) RETURNING id, lease_token",
        "end": f"WITH d AS (UPDATE {s}.workflows SET status = 'succeeded', lease_owner = NULL,"
               " lease_expires_at = NULL, finished_at = now() WHERE id = %s) SELECT pg_notify('floor_end', %s)",
        "pg_claim": CLAIM.replace("{s}", s),
        "pg_end": FINISH.replace("{s}", s),
    }


async def worker(dsn: str, variant: str) -> None:
    pg_claim, pg_end = VARIANTS[variant]
    sql = statements()
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as listen, \
            await psycopg.AsyncConnection.connect(dsn, autocommit=True, options=GENERIC) as db:
        await listen.execute("LISTEN floor_start")
        print("@@ready", flush=True)
        async for note in listen.notifies():
            if note.payload == "stop":
                return
            if pg_claim:
                cur = await db.execute(sql["pg_claim"], {
                    "queues": [QUEUE], "floors": [None], "names": [NAME], "limit": 16,
                    "owner": "floor", "lease": 10.0, "token": (token := secrets.randbits(63)), "commit": "off"})
                rows = [(row[0], token) for row in await cur.fetchall() if row[0] is not None]
            else:
                rows = list(await (await db.execute(sql["claim"])).fetchall())
            for id, token in rows:
                payload = "end:" + id
                if pg_end:
                    arrays.ready(db)
                    await db.execute(sql["pg_end"], {
                        "ids": arrays.texts([id]), "leases": arrays.int8s([token]),
                        "statuses": arrays.texts(["succeeded"]), "outputs": arrays.byteas([b"\xc0"]),
                        "errors": arrays.texts([None]), "n": 1, "pings_channels": arrays.texts(["floor_end"]),
                        "pings": arrays.texts([payload])})
                else:
                    await db.execute(sql["end"], (id, payload))


async def bare_caller(dsn: str, runs: int, warmup: int) -> list[float]:
    sql = statements()
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as listen, \
            await psycopg.AsyncConnection.connect(dsn, autocommit=True, options=GENERIC) as db:
        await listen.execute("LISTEN floor_end")
        heard = listen.notifies()
        out: list[float] = []
        try:
            for n in range(warmup + runs):
                id = str(uuid.uuid4())
                t0 = time.perf_counter()
                await db.execute(sql["start"], (id, "start"))
                async for note in heard:
                    if note.payload == "end:" + id:
                        break
                if n >= warmup:
                    out.append((time.perf_counter() - t0) * 1000)
        finally:
            await heard.aclose()  # (while its connection is open: closed after, it would wait for ever)
            await db.execute("SELECT pg_notify('floor_start', 'stop')")
        return out


async def pgflow_caller(dsn: str, pid: int, runs: int, warmup: int) -> list[float]:
    caller, noop = workflows(dsn)
    try:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            # (the worker's claim loop is up once it is in the workers table)
            while not await (await conn.execute(f"SELECT 1 FROM {quote_identifier(SCHEMA)}.workers"
                                                " WHERE pid = %s", (pid,))).fetchone():
                await asyncio.sleep(0.05)
        out: list[float] = []
        for n in range(warmup + runs):
            t0 = time.perf_counter()
            await (await noop.start_async()).result_async(timeout=30)
            if n >= warmup:
                out.append((time.perf_counter() - t0) * 1000)
        return out
    finally:
        await caller.close_async()


def one(dsn: str, variant: str, runs: int, warmup: int) -> float:
    """The p50 of one variant: its worker started, ready, then the caller's runs."""
    env = harness.child_env(PGFLOW_DSN=dsn)
    if variant == "pgflow":
        argv = [sys.executable, "-m", "pgflow", "worker", "benchmarks.latency_floor:app", "--concurrency", "16",
                "--queues", QUEUE, "--grace", "0"]
    else:
        argv = [sys.executable, str(Path(__file__).resolve()), "--role", "worker", "--variant", variant, "--dsn", dsn]
    # (the bare worker's only line is its ready line; the CLI worker's log, a line per start and end at
    # its default INFO, goes nowhere, so that no pipe fills up behind it)
    output = subprocess.PIPE if variant != "pgflow" else subprocess.DEVNULL
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT, text=True)
    try:
        if variant == "pgflow":
            latencies = asyncio.run(pgflow_caller(dsn, proc.pid, runs, warmup))
        else:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("@@ready"):
                    break
            latencies = asyncio.run(bare_caller(dsn, runs, warmup))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return statistics.median(latencies)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/test")
    p.add_argument("--runs", type=int, default=600)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--role", default=None, help=argparse.SUPPRESS)
    p.add_argument("--variant", default="bare", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.role == "worker":
        asyncio.run(worker(a.dsn, a.variant))
        return
    harness.drop_schema(a.dsn, SCHEMA)
    setup, _ = workflows(a.dsn)
    setup.migrate()
    setup.close()
    results: dict[str, list[float]] = {}
    try:
        for round in range(a.rounds):
            for variant in [*VARIANTS, "pgflow"]:
                results.setdefault(variant, []).append(one(a.dsn, variant, a.runs, a.warmup))
                print(f"round {round + 1}: {variant:7s} p50 {results[variant][-1]:.3f} ms", flush=True)
    finally:
        harness.drop_schema(a.dsn, SCHEMA)
    for variant, p50s in results.items():
        print(f"{variant:7s} median p50 {statistics.median(p50s):.3f} ms  (rounds: "
              + ", ".join(f"{x:.3f}" for x in p50s) + ")")


if __name__ == "__main__":
    main()
