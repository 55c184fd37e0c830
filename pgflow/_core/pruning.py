"""Deleting old finished workflows beside live work: in batches, each one short statement, paced.

A batch is cheap for the server on its own, but back to back the batches keep a backend busy and
fill the WAL that every live commit waits to flush behind, which on a small machine takes a large
share of the throughput of the streams running beside them. So after each batch the pruner waits
in proportion to the time the batch took: it is busy at most ``SHARE`` of the time, however fast or
loaded the server is, and a batch slowed down by load waits longer by itself.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from datetime import timedelta

import anyio
import psycopg

from .engine import Engine

log = logging.getLogger("pgflow.retention")

SHARE = 0.25  # of the wall time a prune spends in its statements (benchmarks/prune_under_load.py)
# Workflows per statement. Small, so a statement is short and the pauses come often (the same share
# in many short slices disturbs the streams beside it less than in a few long ones): with 100 chunks
# a workflow, a statement deletes 10,000 chunks in about 10 ms on a 2-core machine.
PRUNE_BATCH = 100
MAX_PRUNE_BATCH = 10_000  # a statement past this holds its locks and fills the WAL for long
# How often the partitions service makes the chunk partitions ahead and drops the emptied ones: a
# period is an hour at least and partitions are made periods ahead, so a minute is soon enough.
PARTITIONS_EVERY = 60.0


def check_older_than(older_than: object) -> float:
    """Seconds, finite and >= 0. NaN compares false with everything, so a check written as
    ``older_than < 0`` lets it through to the server, and infinity is no age a workflow can have."""
    seconds = older_than.total_seconds() if isinstance(older_than, timedelta) else older_than
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds) \
            or seconds < 0:
        raise ValueError(f"older_than is a finite duration >= 0 (seconds or a timedelta), got {older_than!r}")
    return float(seconds)


def check_batch(batch: object) -> int:
    """A batch of 0 never comes back short, so the loop in ``prune_paced`` would never end."""
    if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= MAX_PRUNE_BATCH:
        raise ValueError(f"batch is an int between 1 and {MAX_PRUNE_BATCH}, got {batch!r}")
    return batch


async def prune_paced(delete_batch: Callable[[], Awaitable[int]], batch: int,
                      progress: Callable[[int], None] | None = None) -> int:
    """Run ``delete_batch`` (which deletes up to ``batch`` workflows, returning how many) until a
    batch comes back short; ``progress(deleted so far)`` after each. Returns how many went."""
    check_batch(batch)
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


async def prune(store: Engine, older_than: float, batch: int = PRUNE_BATCH) -> int:
    """The retention service's pass: small batches, paced so the pruning never crowds out the work
    it runs beside. The chunk partitions it empties of streams go at the partitions service's next
    pass, the one place of the fleet that drops them."""
    deleted = await prune_paced(lambda: store.management.prune(older_than, batch), batch)
    if deleted:
        log.info("retention: deleted %d workflows finished over %.0f s ago", deleted, older_than)
    await prune_leftovers(store, batch)
    return deleted


async def prune_leftovers(store: Engine, batch: int = PRUNE_BATCH) -> None:
    """What no finished workflow holds but nobody needs any more: expired free-standing streams, the
    debounce keys whose run has begun, the per-key buckets that are full again. The retention service
    and ``App.prune`` both end with it."""
    await prune_expired_streams(store, batch)
    await prune_debounces(store, batch)
    await prune_key_buckets(store, batch)


async def prune_debounces(store: Engine, batch: int = PRUNE_BATCH) -> int:
    """The debounce keys whose run has left the queue (claimed, ended, pruned), paced as the
    workflows are: a key is only needed while its run waits, and a key's next start would replace
    its row anyway, so this only keeps the table from holding every key ever debounced."""
    gone = await prune_paced(lambda: store.debounces.prune_debounces(batch), batch)
    if gone:
        log.info("retention: forgot %d debounce keys whose run has begun", gone)
    return gone


async def prune_key_buckets(store: Engine, batch: int = PRUNE_BATCH) -> int:
    """The per-key token buckets that are full again (engine/key_limits.py): a key without a bucket
    has a full one, so this keeps the table to the keys that started work within the last period,
    rather than every key that ever did."""
    gone = await prune_paced(lambda: store.key_limits.prune_buckets(batch), batch)
    if gone:
        log.info("retention: forgot %d full per-key token buckets", gone)
    return gone


async def prune_expired_streams(store: Engine, batch: int = PRUNE_BATCH) -> int:
    """Free-standing Durable Streams whose Stream-TTL or Stream-Expires-At has passed, by their own
    clock (not ``older_than``), paced as the workflows are. A request that finds one expired deletes it
    too; this keeps streams nobody asks for again from staying forever."""
    try:
        gone = await prune_paced(lambda: store.free_streams.delete_expired(batch), batch)
    except psycopg.errors.UndefinedTable:  # a schema older than 0029 (held back on purpose): none to prune
        return 0
    if gone:
        log.info("retention: deleted %d expired free-standing streams", gone)
    return gone


async def tend_chunk_partitions(store: Engine) -> None:
    """The partitions service's pass: the partitions of the coming periods are made before a stream
    needs them, and those no stream is left in are dropped (whether or not this fleet prunes:
    ``App(retention=None)`` keeps every stream, and so every partition with a stream in it)."""
    await store.partitions.add_chunk_partitions()
    await store.partitions.drop_chunk_partitions()
