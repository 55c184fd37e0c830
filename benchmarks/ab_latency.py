"""A/B of no-op start-to-result latency between two checkouts, on a machine too noisy for absolute figures.

    python benchmarks/ab_latency.py DIR_A DIR_B [--rounds 10] [--runs 150] [--dsn postgresql://...]

Each checkout gets a database of its own (``ab_a``, ``ab_b``, dropped and created again) and a pgflow
worker of its own (``benchmarks.peers.pgflow_peer``, concurrency 16), both kept running; then client
rounds of ``--runs`` sequential start-to-result runs (after 30 warm-up) alternate between the two,
A first in even rounds, B first in odd ones. Printed: each side's p50 per round and their median, the
median p99, and in how many rounds B was faster, with the median of B's p50 over A's.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import psycopg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--runs", type=int, default=150)
    p.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/test")
    args = p.parse_args()
    py = sys.executable
    sides: dict[str, tuple[str, dict[str, str], subprocess.Popen[bytes]]] = {}
    try:
        for tag, checkout in (("A", args.a), ("B", args.b)):
            db = f"ab_{tag.lower()}"
            with psycopg.connect(args.dsn, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
                conn.execute(f"CREATE DATABASE {db}")
            dsn = psycopg.conninfo.make_conninfo(args.dsn, dbname=db)
            env = {**os.environ, "BENCH_DSN": dsn, "PGFLOW_DSN": dsn, "PYTHONPATH": checkout, "BENCH_POOL": "20"}
            setup = ("import asyncio; from benchmarks.peers import pgflow_peer as p;"
                     " asyncio.run(p.setup()); asyncio.run(p.close())")
            subprocess.run([py, "-c", setup], env=env, cwd=checkout, check=True)
            worker = subprocess.Popen([py, "-m", "pgflow", "--log-level", "WARNING", "worker",
                                       "benchmarks.peers.pgflow_peer:app", "--concurrency", "16", "--grace", "0"],
                                      env=env, cwd=checkout)
            sides[tag] = (checkout, env, worker)
        time.sleep(3)  # both workers listening
        results: dict[str, list[tuple[float, float]]] = {"A": [], "B": []}
        for r in range(args.rounds):
            for tag in ("A", "B") if r % 2 == 0 else ("B", "A"):
                checkout, env, _ = sides[tag]
                out = subprocess.run([py, "-m", "benchmarks.client", "pgflow", "latency", "--runs", str(args.runs),
                                      "--warmup", "30"], env=env, cwd=checkout, capture_output=True, text=True,
                                     timeout=300, check=True)
                lat = sorted(json.loads(out.stdout.strip().splitlines()[-1])["latencies_ms"])
                results[tag].append((lat[len(lat) // 2], lat[int(len(lat) * 0.99)]))
    finally:
        for _, _, worker in sides.values():
            worker.terminate()
        for _, _, worker in sides.values():
            worker.wait()
    for tag in ("A", "B"):
        p50s = [x[0] for x in results[tag]]
        p99 = statistics.median(x[1] for x in results[tag])
        print(f"{tag} {sides[tag][0]}: p50 median {statistics.median(p50s):.2f} ms "
              f"[{' '.join(f'{x:.2f}' for x in p50s)}], p99 median {p99:.2f} ms")
    pairs = list(zip(results["A"], results["B"], strict=True))
    print(f"B faster in {sum(b[0] < a[0] for a, b in pairs)}/{len(pairs)} rounds; "
          f"median of B's p50 / A's: {statistics.median(b[0] / a[0] for a, b in pairs):.3f}")


if __name__ == "__main__":
    main()
