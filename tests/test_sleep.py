"""Durable sleep: the wake-up time is journaled, a replay sleeps only what is left, a long sleep
gives the worker slot back and is taken up again when due, by any worker, across a SIGKILL of the
worker that started it and a restart of the server."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

import pgflow

from .apps import prims
from .helpers import KINDS, query, query_sync, wait_for
from .processes import Processes, result_of, wait_until
from .servers import EmbeddedServer

TARGET = "tests.apps.prims:app"


def marks(path: Path, what: str) -> list[tuple[int, float]]:
    """(pid, time) of each ``what`` line the steps wrote."""
    found = []
    for line in path.read_text().splitlines() if path.exists() else []:
        word, *rest = line.split()
        if word == what:
            found.append((int(rest[0]), float(rest[1])))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_suspended_sleep_survives_a_sigkill_and_ends_on_time_on_another_worker(
    app: pgflow.App, dsn: str, schema: str, worker_env: dict[str, str], procs: Processes, tmp_path: Path,
    kind: str,
) -> None:
    """A 3 s sleep, suspended after 0.5 s (the workers' suspend_after): worker A's only slot runs
    another workflow meanwhile, then A is SIGKILLed mid-sleep, and worker B, started and registered
    before the wake-up time, ends the sleep on time. The other workflow goes to a queue only A serves,
    so B can start up while A still sleeps without taking it."""
    effects = tmp_path / "effects"
    flows = prims.build(app)
    env = {**worker_env, "PRIMS_SUSPEND_AFTER": "0.5"}
    a = procs.worker("a", TARGET, env, queues="default,only-a", concurrency=1)
    sleeper = (flows.sleeper if kind == "async" else flows.sleeper_sync).start(str(effects), 3.0)
    [(pid_a, before)] = wait_until(lambda: marks(effects, "before"), "the sleeper's first step", procs, a)
    assert pid_a == a.pid
    b = procs.worker("b", TARGET, env, concurrency=1)

    def suspended() -> Any:
        rows = query_sync(dsn, 'SELECT w.status, w.lease_owner, extract(epoch FROM w.due_at),'
                               f' extract(epoch FROM s.wake_at) FROM "{schema}".workflows w'
                               f' JOIN "{schema}".steps s ON s.workflow_id = w.id'
                               f" AND s.name = 'pgflow.sleep' WHERE w.id = %s", (sleeper.id,))
        return rows and rows[0][0] == "queued" and rows[0]
    _, owner, due, wake = wait_until(suspended, "the sleeper to give its slot back", procs, a)
    assert owner is None and float(due) == float(wake)
    assert 2.5 < float(wake) - before < 3.5
    # The only slot of worker A is free: it runs another workflow while the first one sleeps.
    other = flows.quick.with_options(queue="only-a").start(str(effects))
    assert result_of(other, procs) == a.pid

    def registered() -> bool:
        return {pid for (pid,) in query_sync(dsn, f'SELECT pid FROM "{schema}".workers')} >= {a.pid, b.pid}
    wait_until(registered, "worker B to register", procs, a, b)
    a.signal(signal.SIGKILL)
    a.wait_exit()
    assert time.time() < float(wake)  # A died mid-sleep, with B already serving the queue
    first, last = result_of(sleeper, procs)
    [(pid_b, after)] = marks(effects, "after")
    assert pid_b == b.pid and marks(effects, "before") == [(pid_a, before)] and abs(first - before) < 0.01
    late = after - float(wake)
    print(f"\n[sleep] {kind}: woke {late:.3f}s after its due time on another worker process")
    assert 0 <= late < 1.0, late
    assert abs(last - after) < 0.01


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
async def test_replay_sleeps_only_what_is_left(app: pgflow.App, dsn: str, schema: str, kind: str,
                                              tmp_path: Path) -> None:
    """A sleep held in its slot (shorter than suspend_after) whose worker stops halfway: the next
    run sleeps until the journaled wake-up time, not the whole sleep again."""
    flows = prims.build(app)
    effects = tmp_path / "effects"
    handle = await (flows.sleeper if kind == "async" else flows.sleeper_sync).start_async(str(effects), 2.0)
    async with app.worker(concurrency=2):
        await wait_for(lambda: query(dsn, f'SELECT 1 FROM "{schema}".steps WHERE workflow_id = %s'
                                           " AND name = 'pgflow.sleep'", handle.id))
        [(status,)] = await query(dsn, f'SELECT status FROM "{schema}".workflows WHERE id = %s', handle.id)
        assert status == "running"  # 2 s is below suspend_after: the sleep holds its slot
    # The worker stopped with the workflow mid-sleep; it went back to the queue.
    await anyio.sleep(1.0)
    restarted = time.time()
    async with app.worker(concurrency=2):
        await handle.result_async(timeout=30)
    [(late, attempt)] = await query(
        dsn, f'SELECT extract(epoch FROM w.finished_at - s.wake_at)::float8, w.attempt FROM "{schema}".workflows w'
             f' JOIN "{schema}".steps s ON s.workflow_id = w.id AND s.name = %s WHERE w.id = %s',
        "pgflow.sleep", handle.id)
    assert attempt == 2
    assert 0 <= late < 1.0, late
    assert time.time() - restarted < 1.9  # not a fresh 2 s sleep
    assert len(marks(effects, "before")) == 1


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
async def test_a_long_sleep_frees_the_slot_and_costs_no_attempt(dsn: str, schema: str, kind: str) -> None:
    """With suspend_after=0.5, a concurrency-1 worker runs other workflows while one sleeps; the
    sleeper, taken up again twice, is still on its first attempt, even with max_attempts=1."""
    async with pgflow.App(dsn, schema=schema, poll_interval=0.5, suspend_after=0.5) as app:
        if kind == "async":
            @app.workflow(name="sleep.twice", max_attempts=1)
            async def twice() -> list[int]:
                await pgflow.sleep_async(1.5)
                await pgflow.sleep_async(1.5)
                return [pgflow.attempt()]
        else:
            @app.workflow(name="sleep.twice", max_attempts=1)
            def twice() -> list[int]:
                pgflow.sleep(1.5)
                pgflow.sleep(1.5)
                return [pgflow.attempt()]

        @app.workflow(name="sleep.other")
        async def other(i: int) -> int:
            return i

        sleeper = await twice.start_async()
        async with app.worker(concurrency=1):
            await wait_for(lambda: query(dsn, f'SELECT 1 FROM "{schema}".workflows WHERE id = %s AND'
                                               " status = 'queued' AND lease_owner IS NULL AND due_at > now()",
                                          sleeper.id))
            assert [await (await other.start_async(i)).result_async(timeout=10) for i in range(3)] == [0, 1, 2]
            assert await sleeper.status_async() == "queued"
            assert await sleeper.result_async(timeout=30) == [1]
        [(attempt, base)] = await query(dsn, f'SELECT attempt, attempt_base FROM "{schema}".workflows'
                                              " WHERE id = %s", sleeper.id)
        assert (attempt, base) == (3, 2)


@pytest.mark.anyio
async def test_cancelling_a_sleeping_workflow_ends_it_now(dsn: str, schema: str) -> None:
    async with pgflow.App(dsn, schema=schema, poll_interval=0.5, suspend_after=0.5) as app:
        @app.workflow(name="sleep.long")
        async def long() -> None:
            await pgflow.sleep_async(3600)

        handle = await long.start_async()
        async with app.worker(concurrency=1):
            # Queued again after it ran (started_at): its slot given back while it sleeps, not yet claimed.
            await wait_for(lambda: query(dsn, f'SELECT 1 FROM "{schema}".workflows WHERE id = %s AND'
                                               " status = 'queued' AND started_at IS NOT NULL", handle.id))
            await handle.cancel_async()
            with pytest.raises(pgflow.WorkflowCancelled):
                await handle.result_async(timeout=10)


@pytest.mark.anyio
async def test_sleep_survives_a_server_restart(dsn: str, schema: str, restartable: EmbeddedServer) -> None:
    async with pgflow.App(dsn, schema=schema, poll_interval=0.5, suspend_after=0.5) as app:
        @app.workflow(name="sleep.restart")
        async def napping() -> str:
            await pgflow.sleep_async(3.0)
            return "awake"

        handle = await napping.start_async()
        async with app.worker(concurrency=1):
            # Queued again after it ran (started_at): its slot given back while it sleeps, not yet claimed.
            await wait_for(lambda: query(dsn, f'SELECT 1 FROM "{schema}".workflows WHERE id = %s AND'
                                               " status = 'queued' AND started_at IS NOT NULL", handle.id))
            await anyio.to_thread.run_sync(restartable.restart)
            assert await handle.result_async(timeout=60) == "awake"


@pytest.mark.anyio
async def test_sleep_outside_a_workflow_inside_a_step_and_bad_seconds(app: pgflow.App) -> None:
    with pytest.raises(RuntimeError, match="can only be called inside a workflow or step"):
        await pgflow.sleep_async(1)
    with pytest.raises(RuntimeError, match="can only be called inside a workflow or step"):
        await anyio.to_thread.run_sync(pgflow.sleep, 1)
    for bad, error in ((-1, ValueError), (float("nan"), ValueError), ("1", TypeError), (True, TypeError)):
        with pytest.raises(error, match="a sleep"):
            await pgflow.sleep_async(bad)  # type: ignore[arg-type]

    @app.step(name="sleep.in_step")
    async def napper() -> None:
        await pgflow.sleep_async(0.1)

    @app.workflow(name="sleep.step_flow")
    async def flow() -> None:
        await napper()

    @app.workflow(name="sleep.blocking")
    async def blocking() -> None:
        pgflow.sleep(0.1)

    one, two = await flow.start_async(), await blocking.start_async()
    async with app.worker(concurrency=2):
        with pytest.raises(pgflow.WorkflowFailed, match="for the workflow body, not for the inside of a step"):
            await one.result_async(timeout=30)
        with pytest.raises(pgflow.WorkflowFailed, match="blocks; in async code use `await pgflow.sleep_async"):
            await two.result_async(timeout=30)


@pytest.mark.anyio
async def test_a_workflow_timeout_ends_a_long_sleep_at_its_deadline(dsn: str, schema: str) -> None:
    async with pgflow.App(dsn, schema=schema, poll_interval=0.5, suspend_after=0.5) as app:
        @app.workflow(name="sleep.timed", timeout=2.0)
        async def timed() -> None:
            await pgflow.sleep_async(3600)

        handle = await timed.start_async()
        began = time.monotonic()
        async with app.worker(concurrency=1):
            with pytest.raises(pgflow.WorkflowFailed, match="ran out of time"):
                await handle.result_async(timeout=30)
        assert time.monotonic() - began < 15
