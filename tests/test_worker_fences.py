"""Chunk batches fenced by their worker's fence (migration 0026) rather than by each workflow's row:
the fence holds while nothing was taken from the worker; a takeover of any of its running workflows, by
this version's claim or the one before's, moves its epoch on in the claiming transaction, and a batch
under the old epoch is then decided by the rows, which refuse the one taken; a fence lost as an
unlogged table is lost in a crash or a failover leaves the rows to decide, and comes back."""

from __future__ import annotations

import os
import socket

import anyio
import psycopg
import pytest

import pgflow
from pgflow._core.current import current_execution
from pgflow._core.engine import NO_PINGS, Claimed, Engine
from pgflow._core.engine.chunks import Written
from pgflow._core.execution import Execution

from .helpers import query, wait_for

pytestmark = pytest.mark.anyio

LEASE = 10.0


async def _store(app: pgflow.App) -> Engine:
    return await app._client.runtime().store()


async def _register(store: Engine, worker: str) -> None:
    await store.workers.register_worker(worker, socket.gethostname(), os.getpid(), ["default"], "test", [], LEASE)


async def _chunks(dsn: str, schema: str, sid: int) -> list[tuple[int, bytes]]:
    return [(p, bytes(v)) for p, v in await query(
        dsn, f'SELECT position, value FROM "{schema}".chunks WHERE stream_id = %s ORDER BY position', sid)]


async def test_a_takeover_moves_the_fence_on_and_the_rows_refuse_the_late_batch(
        app: pgflow.App, second_app: pgflow.App, dsn: str, schema: str) -> None:
    workflow = app.workflow(name="fenced.w2")(_nothing)
    started = await workflow.start_async()
    a, b = await _store(app), await _store(second_app)
    await _register(a, "A")
    await _register(b, "B")
    [claimed], _ = await a.claims.claim("A", ["default"], ["fenced.w2"], 1, LEASE)
    assert claimed.id == started.id and claimed.fence is not None and claimed.fence[0] == "A"
    sid = (await a.chunks.stream_ids([started.id], ["s"]))[(started.id, "s")]
    owner = [(started.id, claimed.lease_token)]
    assert await a.chunks.write_chunks(owner, [1], [sid], [0], [b"a"], NO_PINGS, fence=claimed.fence) == \
        Written(set(), set(), True)

    # A's lease runs out and B takes the workflow over: A's batches under its old epoch are refused.
    # (B's full claim gives it back to the queue, and B's next claim takes it. A was heard from within
    # its lease, so A lives: the workflow is no suspect of a crash, taken once its lease ran out a
    # lease ago.)
    await query(dsn, f'UPDATE "{schema}".workflows SET lease_expires_at = now() - interval \'1 hour\' WHERE id = %s',
                started.id)
    assert await b.claims.claim("B", ["default"], ["fenced.w2"], 1, LEASE) == ([], None)
    [taken], _ = await b.claims.claim("B", ["default"], ["fenced.w2"], 1, LEASE)
    assert taken.id == started.id and not taken.suspect
    late = await a.chunks.write_chunks(owner, [1], [sid], [1], [b"late"], NO_PINGS, fence=claimed.fence)
    assert late == Written({owner[0]}, set(), False)
    assert await _chunks(dsn, schema, sid) == [(0, b"a")]


async def test_a_workers_two_batches_in_flight_take_its_fence_in_turn_not_together(
        app: pgflow.App, dsn: str, schema: str) -> None:
    """Two transactions that share-lock one row make a MultiXact; a worker keeps two batches in flight,
    so sharing its fence made one for every pair that overlapped. The second batch waits for the first."""
    workflow = app.workflow(name="fenced.pair")(_nothing)
    first, second = await workflow.start_async(), await workflow.start_async()
    store = await _store(app)
    await _register(store, "A")
    claimed, _ = await store.claims.claim("A", ["default"], ["fenced.pair"], 2, LEASE)
    by_id = {c.id: c for c in claimed}
    assert set(by_id) == {first.id, second.id}
    sids = await store.chunks.stream_ids([first.id, second.id], ["s", "s"])
    one, two = by_id[first.id], by_id[second.id]
    assert one.fence == two.fence is not None

    async def batch(claimed: Claimed, value: bytes) -> Written:
        return await store.chunks.write_chunks([(claimed.id, claimed.lease_token)], [1], [sids[(claimed.id, "s")]], [0],
                                        [value], NO_PINGS, fence=claimed.fence)

    answers: dict[str, Written] = {}

    async def send(claimed: Claimed, value: bytes) -> None:
        answers[claimed.id] = await batch(claimed, value)

    async with await psycopg.AsyncConnection.connect(dsn) as blocker, anyio.create_task_group() as tasks:
        # The first batch stays in flight, its fence locked: its chunk waits for an uncommitted one
        # of the same position.
        await blocker.execute(f'INSERT INTO "{schema}".chunks (stream_id, position, value) VALUES (%s, 0, %s)',
                              (sids[(first.id, "s")], b"blocker"))
        tasks.start_soon(send, one, b"one")
        [(in_flight,)] = await wait_for(lambda: _blocked_by(dsn, blocker.info.backend_pid))
        tasks.start_soon(send, two, b"two")

        async def waiting_or_done() -> bool:
            return second.id in answers or bool(await _blocked_by(dsn, in_flight))

        await wait_for(waiting_or_done)
        assert second.id not in answers  # it waits for the fence the first batch holds
        await blocker.rollback()
    assert answers == {first.id: Written(set(), set(), True), second.id: Written(set(), set(), True)}
    assert await _chunks(dsn, schema, sids[(second.id, "s")]) == [(0, b"two")]


async def test_a_claim_by_the_version_before_moves_the_fence_on_too(app: pgflow.App, dsn: str, schema: str) -> None:
    workflow = app.workflow(name="fenced.w3")(_nothing)
    started = await workflow.start_async()
    store = await _store(app)
    await _register(store, "A")
    [claimed], _ = await store.claims.claim("A", ["default"], ["fenced.w3"], 1, LEASE)
    assert claimed.fence is not None
    # The older version's claim of an expired lease: the attempt goes up, its owner is its own.
    await query(dsn, f"UPDATE \"{schema}\".workflows SET attempt = attempt + 1, lease_owner = 'old' WHERE id = %s",
                started.id)
    [(epoch,)] = await query(dsn, f"SELECT epoch FROM \"{schema}\".worker_fences WHERE worker = 'A'")
    assert epoch == claimed.fence[1] + 1


async def test_a_fence_lost_as_in_a_crash_leaves_the_rows_to_decide_and_comes_back(
        app: pgflow.App, dsn: str, schema: str) -> None:
    workflow = app.workflow(name="fenced.w4")(_nothing)
    started = await workflow.start_async()
    store = await _store(app)
    await _register(store, "A")
    [claimed], _ = await store.claims.claim("A", ["default"], ["fenced.w4"], 1, LEASE)
    assert claimed.fence is not None
    sid = (await store.chunks.stream_ids([started.id], ["s"]))[(started.id, "s")]
    owner = [(started.id, claimed.lease_token)]
    # What a crash or a failover does to an unlogged table: it is empty.
    await query(dsn, f'TRUNCATE "{schema}".worker_fences')
    assert await store.chunks.write_chunks(owner, [1], [sid], [0], [b"a"], NO_PINGS, fence=claimed.fence) == \
        Written(set(), set(), False)  # the row still holds: written
    assert await _chunks(dsn, schema, sid) == [(0, b"a")]
    await store.workers.heartbeat("A", LEASE, socket.gethostname(), os.getpid(), ["default"], "test", ["fenced.w4"],
                          [started.id], within=LEASE)
    [(epoch,)] = await query(dsn, f"SELECT epoch FROM \"{schema}\".worker_fences WHERE worker = 'A'")
    assert epoch != claimed.fence[1]  # a new epoch: the executions of before stay on their rows


async def _nothing() -> None:
    return None


async def _stream_forever() -> None:
    n = 0
    while True:
        await pgflow.write_stream_async("s", n)
        n += 1
        await anyio.sleep(0.005)


async def _blocked_by(dsn: str, pid: int) -> list[tuple[int]]:
    """The backends that wait for a lock the backend ``pid`` holds."""
    return await query(dsn, "SELECT pid FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))", pid)


async def _status(dsn: str, schema: str, workflow_id: str) -> str:
    [(status,)] = await query(dsn, f'SELECT status FROM "{schema}".workflows WHERE id = %s', workflow_id)
    return str(status)


async def test_a_workflow_that_only_streams_stops_soon_after_its_cancel(app: pgflow.App) -> None:
    """Its chunks read no row, so the cancel's ping is what stops it: with a lease of a minute, the
    heartbeat would tell its worker only 20 s later."""
    @app.workflow(name="fenced.endless")
    async def endless() -> None:
        await _stream_forever()

    async with app.worker(concurrency=2, lease=60.0):
        handle = await endless.start_async()
        async for n in handle.stream_async("s"):
            if n == 10:
                break
        await handle.cancel_async()
        with pytest.raises(pgflow.WorkflowCancelled):
            await handle.result_async(timeout=10)


async def test_a_run_ends_only_after_its_batch_in_flight(app: pgflow.App, dsn: str, schema: str) -> None:
    """A batch fenced by its worker does not read the workflow's row, so a run that ended (or gave its
    workflow back) while one was in flight would see it land afterwards: behind the end its readers
    saw, or in the stream of the workflow's next owner. The run's end waits for it."""
    runs: list[Execution] = []

    @app.workflow(name="fenced.held")
    async def held() -> None:
        execution = current_execution.get()
        assert execution is not None
        runs.append(execution)
        await pgflow.write_stream_async("s", "one")  # its batch waits for the test's lock on the fence
        await pgflow.write_stream_async("s", "never")

    async with app.worker(concurrency=2, lease=60.0) as worker, \
            await psycopg.AsyncConnection.connect(dsn) as locker:
        try:
            locker_pid = locker.info.backend_pid
            await locker.execute(f'SELECT FROM "{schema}".worker_fences WHERE worker = %s FOR UPDATE', (worker.id,))
            handle = await held.start_async()
            await wait_for(lambda: _blocked_by(dsn, locker_pid))
            await handle.cancel_async()

            async def settling_or_ended() -> bool:
                return await _status(dsn, schema, handle.id) != "running" or runs[0].streams.settled is not None

            await wait_for(settling_or_ended)
            assert await _status(dsn, schema, handle.id) == "running"  # its end waits for the chunk in flight
        finally:
            await locker.rollback()
        with pytest.raises(pgflow.WorkflowCancelled):
            await handle.result_async(timeout=30)
        assert [v async for v in handle.stream_async("s")] == ["one"]


async def test_a_cancel_asked_for_before_the_first_chunk_stops_the_stream(app: pgflow.App) -> None:
    """The cancel's ping went out before the workflow was watched (its first chunk under its worker's
    fence), so nobody heard it: the first chunk looks for it, not the heartbeat a third of a lease on."""
    running, go = anyio.Event(), anyio.Event()

    @app.workflow(name="fenced.late")
    async def late() -> None:
        running.set()
        await go.wait()
        await _stream_forever()

    async with app.worker(concurrency=2, lease=60.0):
        handle = await late.start_async()
        await running.wait()
        await handle.cancel_async()
        go.set()
        with pytest.raises(pgflow.WorkflowCancelled):
            await handle.result_async(timeout=10)


async def test_a_workflow_given_back_after_a_batch_was_cut_off_waits_for_that_batch(
        dsn: str, schema: str) -> None:
    """A batch whose connection is cut off (here: no answer within ``query_timeout``, as it waits for a
    lock on its worker's fence) may still commit on the server after its run gave up and gave the
    workflow back; fenced by the worker, not the row, it would not hold the release up, and its chunk
    would collide with the next run's. The release moves the fence on, so it waits for the batch."""
    app = pgflow.App(dsn, schema=schema, poll_interval=0.5, query_timeout=1.0)

    @app.workflow(name="fenced.cut")
    async def cut() -> int:
        await pgflow.write_stream_async("s", "one")
        await pgflow.write_stream_async("s", "two")
        return 2

    # The test looks through a connection of its own, opened first: every cut batch leaves a backend
    # waiting for the lock until it is released, and a connection opened per look could find no slot.
    async def look(sql: str, *params: object) -> list[tuple[object, ...]]:
        return await (await watcher.execute(sql, params)).fetchall()

    try:
        async with app.worker(concurrency=2) as worker, await psycopg.AsyncConnection.connect(dsn) as locker, \
                await psycopg.AsyncConnection.connect(dsn, autocommit=True) as watcher:
            try:
                await locker.execute(f'SELECT FROM "{schema}".worker_fences WHERE worker = %s FOR UPDATE',
                                     (worker.id,))
                handle = await cut.start_async()
                # its first batch waits
                await wait_for(lambda: look("SELECT pid FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
                                            locker.info.backend_pid))

                async def status() -> object:
                    return (await look(f'SELECT status FROM "{schema}".workflows WHERE id = %s', handle.id))[0][0]

                async def releasing_or_released() -> bool:
                    # (the release waits queued behind the cut batches)
                    return await status() != "running" or bool(await look(
                        "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND position(%s IN query) > 0",
                        f'UPDATE "{schema}".workflows SET status = \'queued\', lease_owner = NULL'))

                await wait_for(releasing_or_released)  # (the batch's tries give up after 10 s)
                assert await status() == "running"  # its release waits for the cut batch
            finally:
                await locker.rollback()
            assert await handle.result_async(timeout=60) == 2  # run again, after the cut batch's chunk
            assert [v async for v in handle.stream_async("s")] == ["one", "two"]
    finally:
        await app.close_async()
