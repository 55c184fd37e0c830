"""A worker process's App behind a pgbouncer (tests/test_pgbouncer.py): configured from PGFLOW_DSN
(the pooler), PGFLOW_LISTEN_DSN (the server) and PGFLOW_SCHEMA. The test starts the workflow by name."""

from __future__ import annotations

import pgflow

app = pgflow.App(poll_interval=0.5, suspend_after=0.5)


@app.step(name="pooled.square")
async def square(i: int) -> int:
    return i * i


@app.workflow(name="pooled.nap")
async def nap(i: int) -> int:
    before = await square(i)
    await pgflow.sleep_async(1.5)  # given back: the restart finds it queued, the worker holding nothing
    await pgflow.write_stream_async("done", i)
    return before + await square(i)
