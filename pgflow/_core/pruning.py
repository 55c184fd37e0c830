"""Deleting old finished workflows beside live work: in batches, each one short statement, paced.

A batch is cheap for the server on its own, but back to back the batches keep a backend busy and
fill the WAL that every live commit waits to flush behind, which on a small machine takes a large
share of the throughput of the streams running beside them. So after each batch the pruner waits
in proportion to the time the batch took: it is busy at most ``SHARE`` of the time, however fast or
loaded the server is, and a batch slowed down by load waits longer by itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio

SHARE = 0.25  # of the wall time a prune spends in its statements (benchmarks/prune_under_load.py)
# Workflows per statement. Small, so a statement is short and the pauses come often (the same share
# in many short slices disturbs the streams beside it less than in a few long ones): with 100 chunks
# a workflow, a statement deletes 10,000 chunks in about 10 ms on a 2-core machine.
PRUNE_BATCH = 100


async def prune_paced(delete_batch: Callable[[], Awaitable[int]], batch: int,
                      progress: Callable[[int], None] | None = None) -> int:
    """Run ``delete_batch`` (which deletes up to ``batch`` workflows, returning how many) until a
    batch comes back short; ``progress(deleted so far)`` after each. Returns how many went."""
    share = SHARE  # read here, so the benchmark can measure other shares
    deleted = 0
    while True:
        began = anyio.current_time()
        gone = await delete_batch()
        deleted += gone
        if progress is not None:
            progress(deleted)
        if gone < batch:
            return deleted
        await anyio.sleep((anyio.current_time() - began) * (1 - share) / share)
