"""A workflow served by a worker process for the runtime tests (tests/test_runtime.py): it streams
``n`` tokens and returns their count. ``runtime_caller`` is the process that starts and follows it."""

from __future__ import annotations

import pgflow

app = pgflow.App()


def build(app: pgflow.App) -> pgflow.Workflow[[int], int]:
    @app.workflow(name="runtime.tokens")
    async def tokens(n: int) -> int:
        for i in range(n):
            await pgflow.write_stream_async("tokens", f"t{i}")
        await pgflow.close_stream_async("tokens")
        return n

    return tokens


tokens = build(app)
