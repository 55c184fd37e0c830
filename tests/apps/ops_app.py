"""Workflows for the management command tests (tests/test_cli_manage.py)."""

from __future__ import annotations

import pgflow

app = pgflow.App()


def build(app: pgflow.App) -> tuple[pgflow.Workflow[[int], int], pgflow.Workflow[[], None]]:
    @app.step(name="ops.step")
    async def step(x: int) -> int:
        return x + 1

    @app.workflow(name="ops.counts")
    async def counts(n: int) -> int:
        for i in range(n):
            await pgflow.write_stream_async("numbers", i)
        await pgflow.close_stream_async("numbers")
        return await step(n)

    @app.workflow(name="ops.fails")
    async def fails() -> None:
        raise ValueError("as designed")

    return counts, fails


counts, fails = build(app)
