"""Messages: ``handle.send`` from anywhere, ``pgflow.recv`` in a workflow; each message consumed
exactly once (taken in the transaction that journals its receipt), across a SIGKILL between the
receive and the next step; a long wait gives the slot back and a send wakes it."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

import pgflow
from pgflow._core import codec

from .helpers import KINDS, query, query_sync, requeue, run_to_end, wait_for
from .processes import Processes, lines, result_of, wait_until
from .servers import EmbeddedServer

TARGET = "tests.apps.prims:app"


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_each_message_consumed_once_across_a_sigkill_between_receive_and_the_next_step(
    app: pgflow.App, dsn: str, schema: str, worker_env: dict[str, str], procs: Processes, tmp_path: Path,
    kind: str,
) -> None:
    effects, gate = tmp_path / "effects", tmp_path / "gate"
    a = procs.worker("a", TARGET, worker_env, concurrency=1)
    receiver = app.start_by_name("prims.receiver" if kind == "async" else "prims.receiver_sync",
                                 str(effects), str(gate), 3, 60.0)
    # With no message there, the 60 s wait gives the slot back (suspend_after is 5 s).
    wait_until(lambda: query_sync(dsn, f'SELECT 1 FROM "{schema}".workflows WHERE id = %s AND status = \'queued\''
                                  " AND waiting_for = 'inbox'", (receiver.id,)),
               "the receiver to give its slot back", procs, a)
    receiver.send("inbox", "m1")
    wait_until(lambda: f"got 'm1' {a.pid}" in lines(effects), "worker A to take m1 into the next step", procs, a)
    # The receipt of m1 is committed; the step after it is running. Kill the worker there.
    a.signal(signal.SIGKILL)
    a.wait_exit()
    receiver.send("inbox", "m2")
    gate.touch()
    b = procs.worker("b", TARGET, worker_env, concurrency=1)
    # The replay on B gets m1 again (from the journal), not m2; then m2; then waits for a third.
    wait_until(lambda: f"got 'm2' {b.pid}" in lines(effects), "worker B to receive m2", procs, b)
    wait_until(lambda: query_sync(dsn, f'SELECT 1 FROM "{schema}".workflows WHERE id = %s AND status = \'queued\''
                                  " AND waiting_for = 'inbox'", (receiver.id,)),
               "the receiver to wait again with its slot given back", procs, b)
    sent = time.monotonic()
    receiver.send("inbox", "m3", idempotency_key="third")
    receiver.send("inbox", "m3 again", idempotency_key="third")  # the same key: not stored twice
    assert result_of(receiver, procs) == ["m1", "m2", "m3"]
    woke = time.monotonic() - sent
    print(f"\n[messages] {kind}: a receiver that gave its slot back finished {woke:.3f}s after the send")
    assert woke < 30  # woken by the send, not at its 60 s deadline
    assert lines(effects) == [f"got 'm1' {a.pid}", f"got 'm1' {b.pid}", f"got 'm2' {b.pid}", f"got 'm3' {b.pid}"]
    rows = query_sync(dsn, f'SELECT value, consumed_position FROM "{schema}".messages WHERE workflow_id = %s'
                      " ORDER BY id", (receiver.id,))
    assert [(bytes(v), p) for v, p in rows] == [(codec.encode("m1", ""), 0), (codec.encode("m2", ""), 2),
                                                 (codec.encode("m3", ""), 4)]


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
async def test_a_timeout_is_journaled_and_replays_as_none(app: pgflow.App, dsn: str, schema: str, kind: str) -> None:
    if kind == "async":
        @app.workflow(name="msg.timing_out")
        async def flow() -> list[Any]:
            return [await pgflow.recv_async("t", timeout=0.3), await pgflow.recv_async("t", timeout=0)]
    else:
        @app.workflow(name="msg.timing_out")
        def flow() -> list[Any]:
            return [pgflow.recv("t", timeout=0.3), pgflow.recv("t", timeout=0)]

    handle = await flow.start_async()
    began = time.monotonic()
    assert await run_to_end(app, handle) == [None, None]
    assert time.monotonic() - began >= 0.3
    await handle.send_async("t", "late")
    await requeue(dsn, schema, handle.id)
    assert await run_to_end(app, handle) == [None, None]  # the replay times out again; "late" stays
    assert await query(dsn, f'SELECT consumed_at IS NULL FROM "{schema}".messages') == [(True,)]


@pytest.mark.anyio
async def test_a_short_wait_holds_its_slot_and_is_woken_by_the_send(app: pgflow.App, dsn: str, schema: str) -> None:
    @app.workflow(name="msg.short")
    async def short() -> Any:
        return await pgflow.recv_async("go", timeout=4.0)  # below suspend_after: waits in its slot

    handle = await short.start_async()
    async with app.worker(concurrency=1):
        await wait_for(lambda: query(dsn, f'SELECT 1 FROM "{schema}".steps WHERE waiting'))
        assert await handle.status_async() == "running"
        began = time.monotonic()
        await anyio.to_thread.run_sync(lambda: handle.send("go", {"ok": True}))
        assert await handle.result_async(timeout=30) == {"ok": True}
        assert time.monotonic() - began < 3.0  # the ping woke it, well before its 4 s deadline


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
async def test_a_long_wait_gives_the_slot_back_and_a_send_makes_it_due(dsn: str, schema: str, kind: str) -> None:
    async with pgflow.App(dsn, schema=schema, poll_interval=0.5, suspend_after=0.5) as app:
        if kind == "async":
            @app.workflow(name="msg.long", max_attempts=1)
            async def long() -> list[Any]:
                got = [await pgflow.recv_async("a", timeout=60), await pgflow.recv_async("b", timeout=60)]
                return [*got, pgflow.attempt()]
        else:
            @app.workflow(name="msg.long", max_attempts=1)
            def long() -> list[Any]:
                got = [pgflow.recv("a", timeout=60), pgflow.recv("b", timeout=60)]
                return [*got, pgflow.attempt()]

        @app.workflow(name="msg.other")
        async def other() -> str:
            return "ran"

        handle = await long.start_async()
        async with app.worker(concurrency=1):
            for topic in ("a", "b"):
                await wait_for(lambda topic=topic: query(  # type: ignore[misc]
                    dsn, f'SELECT 1 FROM "{schema}".workflows WHERE status = \'queued\' AND waiting_for = %s', topic))
                assert await (await other.start_async()).result_async(timeout=10) == "ran"  # the slot is free
                await handle.send_async("unrelated", 0)  # another topic: still due at its deadline
                assert await query(dsn, f'SELECT due_at > now() + interval \'30 seconds\' FROM "{schema}".workflows'
                                         " WHERE id = %s", handle.id) == [(True,)]
                began = time.monotonic()
                await handle.send_async(topic, topic.upper())
            assert await handle.result_async(timeout=30) == ["A", "B", 1]
            assert time.monotonic() - began < 10


@pytest.mark.anyio
async def test_messages_of_a_topic_come_in_order_and_idempotency_keys_dedupe(app: pgflow.App, dsn: str,
                                                                             schema: str) -> None:
    @app.workflow(name="msg.order")
    async def order(n: int) -> list[Any]:
        return [await pgflow.recv_async("q", timeout=30) for _ in range(n)]

    handle = await order.start_async(3)
    await handle.send_async("q", 1, idempotency_key="one")
    await handle.send_async("other", "elsewhere")
    await handle.send_async("q", 1, idempotency_key="one")
    await handle.send_async("q", 2)
    await handle.send_async("q", 3)
    assert await run_to_end(app, handle) == [1, 2, 3]
    assert await query(dsn, f'SELECT topic, consumed_at IS NULL FROM "{schema}".messages ORDER BY id') == [
        ("q", False), ("other", True), ("q", False), ("q", False)]


@pytest.mark.anyio
async def test_a_send_from_a_workflow_body_is_not_repeated_by_a_replay(app: pgflow.App, dsn: str, schema: str) -> None:
    target = await app.start_by_name_async("msg.nobody_runs_this")

    @app.workflow(name="msg.sender")
    async def sender() -> None:
        await app.handle(target.id).send_async("t", "hello")

    @app.workflow(name="msg.sender_sync")
    def sender_sync() -> None:
        app.handle(target.id).send("t", "hello sync")

    for flow in (sender, sender_sync):
        handle = await flow.start_async()
        await run_to_end(app, handle)
        await requeue(dsn, schema, handle.id)
        await run_to_end(app, handle)
    rows = await query(dsn, f'SELECT idempotency_key FROM "{schema}".messages ORDER BY id')
    assert len(rows) == 2 and all(key.endswith(".0") for (key,) in rows)


@pytest.mark.anyio
async def test_recv_and_send_errors(app: pgflow.App) -> None:
    with pytest.raises(RuntimeError, match="can only be called inside a workflow or step"):
        await pgflow.recv_async("t", timeout=1)
    with pytest.raises(RuntimeError, match="can only be called inside a workflow or step"):
        await anyio.to_thread.run_sync(pgflow.recv, "t")
    with pytest.raises(ValueError, match="a message topic"):
        await pgflow.recv_async("", timeout=1)
    with pytest.raises(ValueError, match="timeout"):
        await pgflow.recv_async("t", timeout=-1)
    with pytest.raises(pgflow.UnknownWorkflow):
        await app.handle("nobody").send_async("t", 1)
    handle = await app.start_by_name_async("msg.someone")
    with pytest.raises(pgflow.SerializationError, match="the message on 't'"):
        await handle.send_async("t", object())
    with pytest.raises(ValueError, match="a message topic"):
        handle.send("", 1)
    with pytest.raises(ValueError, match="an idempotency key"):
        handle.send("t", 1, idempotency_key="")

    @app.step(name="msg.in_step")
    def receive_in_step() -> Any:
        return pgflow.recv("t", timeout=1)

    @app.workflow(name="msg.step_flow")
    async def flow() -> Any:
        return await receive_in_step()

    with pytest.raises(pgflow.WorkflowFailed, match="for the workflow body, not for the inside of a step"):
        await run_to_end(app, await flow.start_async())


@pytest.mark.anyio
async def test_pruning_a_finished_workflow_deletes_its_messages_and_events(app: pgflow.App, dsn: str,
                                                                          schema: str) -> None:
    @app.workflow(name="msg.pruned")
    async def pruned() -> Any:
        await pgflow.set_event_async("e", 1)
        return await pgflow.recv_async("t", timeout=30)

    handle = await pruned.start_async()
    await handle.send_async("t", "taken")
    await handle.send_async("t", "left over")
    assert await run_to_end(app, handle) == "taken"
    assert await app.prune_async(0) == 1
    for table in ("messages", "events", "steps"):
        assert await query(dsn, f'SELECT count(*) FROM "{schema}".{table}') == [(0,)]


@pytest.mark.anyio
async def test_a_waiting_receiver_survives_a_server_restart(dsn: str, schema: str,
                                                             restartable: EmbeddedServer) -> None:
    async with pgflow.App(dsn, schema=schema, poll_interval=0.5, suspend_after=0.5) as app:
        @app.workflow(name="msg.restart")
        async def patient() -> Any:
            return await pgflow.recv_async("go", timeout=600)

        handle = await patient.start_async()
        async with app.worker(concurrency=1):
            await wait_for(lambda: query(dsn, f'SELECT 1 FROM "{schema}".workflows WHERE waiting_for = \'go\''
                                               " AND status = 'queued'"))
            await anyio.to_thread.run_sync(restartable.restart)
            await handle.send_async("go", "after the restart")
            assert await handle.result_async(timeout=60) == "after the restart"
