"""The pgflow app of the flat-cost benchmark (``python -m benchmarks flat``): the no-op workflow its drain
runs, and the workflow whose finished row and chunks are the template copied a million times."""

from __future__ import annotations

import os

import pgflow


def make_app(dsn: str | None, schema: str | None = None) -> pgflow.App:
    app = pgflow.App(dsn, schema=schema)

    @app.workflow(name="bench.noop")
    async def noop() -> None:
        return None

    @app.workflow(name="bench.filler")
    async def filler(chunks: int) -> int:
        for n in range(chunks):
            await pgflow.write_stream_async("tokens", [n, "tok"])
        await pgflow.close_stream_async("tokens")
        return chunks

    return app


# The worker process's App: BENCH_DSN, and the schema from PGFLOW_SCHEMA.
app = make_app(os.environ.get("BENCH_DSN"))
