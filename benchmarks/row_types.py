"""What a statement's row type costs per row (engine/statement.py): psycopg's tuple as it is, or a NamedTuple
made of it in psycopg's loop (``row=`` a NamedTuple: ``tuple.__new__`` bound to the class; ``_make``, its
classmethod, for comparison), on real binary results shaped as the hot statements' rows are.

    python -m benchmarks.row_types [--dsn postgresql://...] [--rounds 15]

Two shapes: a claim's rows (21 columns, 64 a claim) and a read of chunks (7 columns, 1,000 a read). Each
round times every maker on the same result, in turns (the order rotated every round), many loads each;
printed: the median over the rounds of each maker's ns per row, and what it adds to the tuple's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import psycopg
from psycopg import pq
from psycopg.adapt import Transformer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from benchmarks import harness  # noqa: E402

# (rows of one result, the statement's SELECT of as many columns of the same types as the real one's)
SHAPES: dict[str, tuple[int, str]] = {
    "claim (21 columns)": (64, "SELECT 'id-' || g, 'name', '\\x01'::bytea, 1, 3, 10.0::float8, 1, 'q', NULL::text,"
                               " 0.1::float8, g::int8, false, 0, true, true, false, NULL::int2, false, 5::int8,"
                               " NULL::float8, NULL::bool FROM generate_series(1, %s) g"),
    "chunk read (7 columns)": (1000, "SELECT g::int8, 7::int8, NULL::text, false, g::int4,"
                                    " '\\x0102030405060708090a0b0c0d0e0f'::bytea, NULL::bool"
                                    " FROM generate_series(1, %s) g"),
}


def _named(columns: int) -> type[tuple[Any, ...]]:
    return NamedTuple("Row", [(f"c{n}", Any) for n in range(columns)])  # type: ignore[misc, return-value]


def makers(columns: int) -> dict[str, Callable[[Any], Any]]:
    row = _named(columns)
    return {"tuple (as psycopg reads it)": tuple,
            "NamedTuple (tuple.__new__ bound)": types.MethodType(tuple.__new__, row), "NamedTuple._make": row._make}


def per_row(loader: Transformer, rows: int, maker: Callable[[Any], Any], loads: int) -> float:
    """ns per row of ``loads`` loads of the result with ``maker``."""
    started = time.perf_counter_ns()
    for _ in range(loads):
        loader.load_rows(0, rows, maker)
    return (time.perf_counter_ns() - started) / loads / rows


def measure(dsn: str, rounds: int) -> dict[str, dict[str, float]]:
    found: dict[str, dict[str, float]] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for shape, (rows, select) in SHAPES.items():
            result = conn.execute(select, (rows,), binary=True).pgresult
            assert result is not None and result.ntuples == rows
            loader = Transformer.from_context(conn)
            loader.set_pgresult(result, format=pq.Format.BINARY)
            made = makers(result.nfields)
            samples: dict[str, list[float]] = {name: [] for name in made}
            names = list(made)
            for n in range(rounds):
                for name in names[n % len(names):] + names[:n % len(names)]:
                    samples[name].append(min(per_row(loader, rows, made[name], 200_000 // rows) for _ in range(3)))
            found[shape] = {name: statistics.median(values) for name, values in samples.items()}
    return found


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.row_types", description=__doc__.split("\n\n")[0])
    p.add_argument("--dsn", default=None)
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args(argv)
    with harness.serving(a.dsn) as (dsn, _):
        found = measure(dsn, a.rounds)
    for shape, figures in found.items():
        base = figures["tuple (as psycopg reads it)"]
        print(f"{shape}, {SHAPES[shape][0]} rows a result: ns per row (median of {a.rounds} rounds)")
        for name, ns in figures.items():
            print(f"  {name:34s} {ns:7.0f}   {ns - base:+7.0f}")


if __name__ == "__main__":
    main()
