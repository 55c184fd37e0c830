"""Workflows for the canvas tests (chain, group, chord) served by worker processes. Each member notes
its side effect as a row of ``effects`` in the test's schema, from a step, and then sleeps durably,
so a test can kill the worker while members sleep with their effects recorded."""

from __future__ import annotations

import os

import psycopg
from psycopg import sql

import pgflow

app = pgflow.App(suspend_after=0.5, poll_interval=0.2)  # env-configured; connects lazily


@app.step(name="canvases.effect")
def effect(tag: str) -> None:
    with psycopg.connect(os.environ["PGFLOW_DSN"], autocommit=True) as conn:
        conn.execute(sql.SQL("INSERT INTO {}.effects (tag, pid) VALUES (%s, %s)").format(
            sql.Identifier(os.environ["PGFLOW_SCHEMA"])), (tag, os.getpid()))


@app.workflow(name="canvases.add")
async def add(x: int, y: int, nap: float = 0.0) -> int:
    await effect(f"add:{x}+{y}")
    await pgflow.sleep_async(nap)
    return x + y


@app.workflow(name="canvases.total")
def total(values: list[int], nap: float = 0.0) -> int:
    effect(f"total:{sorted(values)}")
    pgflow.sleep(nap)
    return sum(values)
