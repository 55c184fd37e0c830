"""A workflow that streams through a schema upgrade, run by the code of the version before (see
tests/test_chunk_partitions.py, which puts that code first on the path of the processes serving this).

Each workflow writes to its stream ``before`` without pause until the gate file exists, so its writes
go on while the test migrates the schema under it, then writes ``after``, a stream it begins once
the schema is migrated. ``python -m tests.apps.upgrading N`` starts N of them and prints their ids.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import anyio

import pgflow

app = pgflow.App()  # env-configured; connects lazily
AFTER = 50  # chunks of the stream begun after the upgrade
GATE_LIMIT = 120.0  # seconds a workflow writes before giving up (a test that died)


@app.workflow(name="upgrading.writer")
async def writer(gate: str) -> int:
    written, deadline = 0, time.monotonic() + GATE_LIMIT
    while not Path(gate).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no gate file {gate} after {GATE_LIMIT}s")
        await pgflow.write_stream_async("before", written)
        written += 1
        await anyio.sleep(0.002)
    await pgflow.close_stream_async("before")
    for i in range(AFTER):
        await pgflow.write_stream_async("after", i)
    await pgflow.close_stream_async("after")
    return written


if __name__ == "__main__":
    for _ in range(int(sys.argv[1])):
        print(writer.start(os.environ["PGFLOW_TEST_GATE"]).id, flush=True)
    app.close()
