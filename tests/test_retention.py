"""Retention: finished workflows go, with their steps and stream chunks, in small batches; by
``app.prune`` / ``pgflow prune`` on demand, and by the elected retention service of the workers."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta

import anyio
import msgspec
import pytest

import pgflow
from pgflow._core import pruning
from pgflow._core.pruning import prune_paced

from .helpers import query

pytestmark = pytest.mark.anyio

WAIT = 60.0


async def counts(app: pgflow.App) -> tuple[int, int, int]:
    s = f'"{app.schema}"'
    [(w, st, ch)] = await query(app.dsn, f"SELECT (SELECT count(*) FROM {s}.workflows),"
                                         f" (SELECT count(*) FROM {s}.steps), (SELECT count(*) FROM {s}.streams)")
    return int(w), int(st), int(ch)


async def age(app: pgflow.App, ids: list[str], by: timedelta) -> None:
    await query(app.dsn, f'UPDATE "{app.schema}".workflows SET finished_at = finished_at - %s WHERE id = ANY(%s)',
                by, ids)


def build(app: pgflow.App) -> pgflow.Workflow[[int], int]:
    @app.step
    async def twice(x: int) -> int:
        return 2 * x

    @app.workflow
    async def streamer(n: int) -> int:
        for i in range(n):
            await pgflow.write_stream_async("s", i)
        await pgflow.close_stream_async("s")
        return await twice(n)

    return streamer


async def test_prune_deletes_old_finished_workflows_with_their_steps_and_chunks(
    app: pgflow.App, worker_env: dict[str, str],
) -> None:
    streamer = build(app)
    async with app.worker(concurrency=8):
        handles = [await streamer.start_async(10) for _ in range(8)]
        with anyio.fail_after(WAIT):
            assert [await h.result_async() for h in handles] == [20] * 8
    waiting = await streamer.with_options(delay=3600).start_async(1)
    old, recent = [h.id for h in handles[:5]], [h.id for h in handles[5:]]
    await age(app, old, timedelta(days=2))
    assert await counts(app) == (9, 8, 88)
    seen: list[int] = []
    assert await app.prune_async(timedelta(days=1), batch=2, progress=seen.append) == 5
    assert seen == [2, 4, 5]
    assert await counts(app) == (4, 3, 33)
    assert {r.id for r in await app.list_workflows_async()} == {*recent, waiting.id}

    # The command line: the other three, aged too.
    await age(app, recent, timedelta(hours=2))
    done = await anyio.to_thread.run_sync(lambda: subprocess.run(
        [sys.executable, "-m", "pgflow", "prune", "--older-than", "1h", "--json"], env=worker_env,
        capture_output=True, text=True, timeout=WAIT))
    assert done.returncode == 0, done.stderr
    assert msgspec.json.decode(done.stdout) == {"deleted": 3}
    assert await counts(app) == (1, 0, 0)  # only the queued one is left
    with pytest.raises(ValueError, match="older_than"):
        await app.prune_async(-1)


async def test_the_retention_service_of_a_worker_deletes_what_is_past_retention(dsn: str, schema: str) -> None:
    async with pgflow.App(dsn, schema=schema, retention=timedelta(hours=1)) as app:
        streamer = build(app)
        async with app.worker(concurrency=4, lease=0.5) as worker:
            old, kept = await streamer.start_async(3), await streamer.start_async(3)
            with anyio.fail_after(WAIT):
                assert await old.result_async() == 6 and await kept.result_async() == 6
                await age(app, [old.id], timedelta(hours=2))
                while await counts(app) != (1, 1, 4):
                    await anyio.sleep(0.1)
                assert "retention" in worker.leading
        assert [r.id for r in await app.list_workflows_async()] == [kept.id]
    with pytest.raises(pgflow.ConfigurationError, match="retention"):
        pgflow.App(dsn, schema=schema, retention=0)


async def test_a_prune_waits_after_each_batch_in_proportion_to_the_time_it_took() -> None:
    """So that it is busy at most SHARE of the time beside live work (benchmarks/prune_under_load.py:
    without the pauses, a prune of a million chunks took half the throughput of the streams beside it)."""
    calls: list[tuple[float, float]] = []

    async def delete_batch() -> int:
        began = anyio.current_time()
        await anyio.sleep(0.05 * (len(calls) + 1))  # a batch's statement, slower each time
        calls.append((began, anyio.current_time()))
        return 10 if len(calls) < 3 else 4

    seen: list[int] = []
    assert await prune_paced(delete_batch, 10, seen.append) == 24
    assert seen == [10, 20, 24]
    factor = (1 - pruning.SHARE) / pruning.SHARE
    for (start, end), (next_start, _) in zip(calls, calls[1:], strict=False):
        assert next_start - end >= factor * (end - start)  # the pause grows with the batch's own time


async def test_a_prune_without_a_floor_is_refused_before_anything_is_deleted(
    app: pgflow.App, worker_env: dict[str, str],
) -> None:
    streamer = build(app)
    async with app.worker(concurrency=4):
        handles = [await streamer.start_async(2) for _ in range(3)]
        with anyio.fail_after(WAIT):
            assert [await h.result_async() for h in handles] == [4] * 3
    before = await counts(app)
    assert before[0] == 3

    # NaN compares false with everything, so it passed a check of "< 0"; infinity is no age.
    for older_than in (float("nan"), float("inf"), float("-inf"), -1, -0.5, timedelta(seconds=-1), "1h", None):
        with pytest.raises(ValueError, match="older_than"):
            await app.prune_async(older_than)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="older_than"):
        await anyio.to_thread.run_sync(app.prune, float("nan"))
    # A batch of 0 never comes back short: the prune would loop for ever (hence the deadline).
    for batch in (0, -1, 10_001, 2.5, True):
        with anyio.fail_after(10), pytest.raises(ValueError, match="batch"):
            await app.prune_async(0, batch=batch)  # type: ignore[arg-type]
    assert await counts(app) == before

    for retention in (float("nan"), float("inf"), "7d"):
        with pytest.raises(pgflow.ConfigurationError, match="retention"):
            pgflow.App(app.dsn, schema=app.schema, retention=retention)  # type: ignore[arg-type]

    def prune(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pgflow", "prune", *args], env=worker_env,
                              capture_output=True, text=True, timeout=WAIT)

    for bad in ("nan", "inf", "1e400s", "-1h"):
        refused = await anyio.to_thread.run_sync(prune, f"--older-than={bad}")
        assert refused.returncode == 2 and "duration" in refused.stderr, refused.stderr
    # Under an hour takes workflows whose callers may be about to read them: it asks for --yes.
    for recent in ("0", "30m"):
        refused = await anyio.to_thread.run_sync(prune, "--older-than", recent, "--json")
        assert refused.returncode == 2, refused.stderr
        assert "would delete every workflow that finished more than" in refused.stderr
        assert "pass --yes" in refused.stderr and refused.stdout == ""
    assert await counts(app) == before
    done = await anyio.to_thread.run_sync(prune, "--older-than", "0", "--yes", "--json")
    assert done.returncode == 0, done.stderr
    assert msgspec.json.decode(done.stdout) == {"deleted": 3}
    assert await counts(app) == (0, 0, 0)
