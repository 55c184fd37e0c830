"""A workflow's end rides on its ping: the caller waiting for the result takes it from the ping, with
no read of the row, and a ping that arrives late cannot pass for a later run's end."""

from __future__ import annotations

import asyncio
import threading
import time

import psycopg
import pytest

import pgflow
from pgflow._core.engine import WorkflowRow
from pgflow._core.signals import End, News
from pgflow._core.signals import keys as signal_keys
from pgflow._core.signals.ends import EndNews
from pgflow._core.signals.payload import CARRY_END_AT_MOST

pytestmark = pytest.mark.anyio


async def test_results_come_with_their_end_pings(app: pgflow.App, second_app: pgflow.App) -> None:
    gate = asyncio.Event()
    sizes = [0, 10, -1, CARRY_END_AT_MOST * 2]  # -1 fails; the last is too big to ride on a ping: it is read

    async def echo(n: int, size: int) -> dict[str, object]:
        await gate.wait()
        if size < 0:
            raise ValueError("no good")
        return {"n": n, "text": "x" * size, "quote": '"\n\\'}

    second_app.workflow(name="carried.echo")(echo)
    caller = app.workflow(name="carried.echo")(echo)
    await second_app.migrate_async()
    handles = [await caller.start_async(n, size) for n, size in enumerate(sizes)]
    async with second_app.worker(concurrency=len(sizes)):
        while [await h.status_async() for h in handles] != ["running"] * len(sizes):
            await asyncio.sleep(0.02)
        waiting = [asyncio.create_task(h.result_async(timeout=60)) for h in handles]
        while app.stats().listeners_connected == 0:  # the callers' pings can reach them now
            await asyncio.sleep(0.02)
        # Every wait has begun before any ends (on a loaded machine a wait not begun yet when its end was
        # heard read the row instead, and no result came from a ping).
        ends = app._runtimes.current().signals.waiters.ends  # noqa: SLF001
        while any(h.id not in ends._watched for h in handles):  # noqa: SLF001
            await asyncio.sleep(0.01)
        gate.set()
        results = await asyncio.gather(*waiting, return_exceptions=True)
    failure = results.pop(2)
    assert isinstance(failure, pgflow.WorkflowFailed) and failure.message == "no good"
    assert results == [{"n": n, "text": "x" * size, "quote": '"\n\\'} for n, size in enumerate(sizes) if size >= 0]
    # The small ends came with their pings (unless a first look already found one ended); the big
    # one never does.
    assert 1 <= app.stats().results_from_pings <= len(sizes) - 1


async def test_a_wait_needs_no_read_for_a_workflow_started_while_listening(app: pgflow.App,
                                                                           second_app: pgflow.App) -> None:
    gate, quick_gate = asyncio.Event(), asyncio.Event()

    async def gated(n: int) -> int:
        await (gate if n == 0 else quick_gate).wait()
        return n

    second_app.workflow(name="carried.gated")(gated)
    caller = app.workflow(name="carried.gated")(gated)
    await second_app.migrate_async()
    async with second_app.worker():
        first = await caller.start_async(0)  # started before anything listened: its wait reads
        waiting = asyncio.create_task(first.result_async(timeout=60))
        while app.stats().listeners_connected == 0:
            await asyncio.sleep(0.02)
        before = app.stats().results_from_pings
        quick = await caller.start_async(1)  # its end pings a listener that already listened
        quick_waiting = asyncio.create_task(quick.result_async(timeout=60))
        # It ends once its wait has begun. (An end heard before its start was answered may be that start's
        # workflow, so that wait reads the row, rightly: on a loaded machine the worker beside the caller
        # could run it to its end before the caller had the start's answer.)
        ends = app._runtimes.current().signals.waiters.ends  # noqa: SLF001
        while quick.id not in ends._watched:  # noqa: SLF001
            await asyncio.sleep(0.01)
        quick_gate.set()
        assert await quick_waiting == 1
        assert app.stats().results_from_pings == before + 1
        gate.set()
        assert await waiting == 0


def test_a_late_ping_does_not_answer_for_a_later_run() -> None:
    news = EndNews()
    end = End("w1", 111, 3, "wf.name", "failed", None, {"type": "ValueError", "message": "old"})
    news.watch("w1")
    # The end of attempt 3 arrives after the workflow was resumed: its row, read meanwhile, is queued
    # again at attempt 3. That end is not the resumed run's.
    news.hear(News(ends=[end]))
    assert news.take_end(WorkflowRow("w1", "wf.name", "queued", 3, None, None, 111)) is None
    # Read while attempt 3 ran, the same end is the answer.
    news.hear(News(ends=[end]))
    taken = news.take_end(WorkflowRow("w1", "wf.name", "running", 3, None, None, 111))
    assert taken is not None and taken.status == "failed" and taken.error == {"type": "ValueError", "message": "old"}
    # The end of a workflow of the same id that was pruned (born at another time) is not this one's.
    news.hear(News(ends=[end]))
    assert news.take_end(WorkflowRow("w1", "wf.name", "running", 1, None, None, 222)) is None
    # Nobody waits any more: nothing is kept.
    news.unwatch("w1")
    news.hear(News(ends=[end]))
    assert news.take_end(WorkflowRow("w1", "wf.name", "running", 3, None, None, 111)) is None


def test_only_a_start_heard_of_throughout_skips_its_first_read() -> None:
    news = EndNews()
    end = End("quiet-end", 5, 1, "wf.name", "succeeded", b"\xc0", None)
    news.started([(id, 5) for id in ["quiet", "quiet-end", "pinged", "deaf", "resumed"]], news.epoch)
    news.started([("unheard", 5)], None)  # the listener did not listen when it was started
    news.hear(News([signal_keys.ended("pinged")], [end]))  # "pinged": cancelled, say; its end carried nothing
    quiet = news.quiet_since_start("quiet")  # nothing heard: it has not ended
    assert quiet is not None and (quiet.status, quiet.born) == ("queued", 5)
    assert news.quiet_since_start("quiet-end") is None  # heard to end before the wait: read (it may have been resumed)
    assert news.quiet_since_start("pinged") is None
    assert news.quiet_since_start("unheard") is None
    news.heard_of("resumed")  # this loop resumed it
    assert news.quiet_since_start("resumed") is None
    epoch = news.epoch
    news.forget()  # the listener stopped: pings may have passed this loop by
    assert news.quiet_since_start("deaf") is None
    news.started([("late", 5)], epoch)  # sent before the listener stopped, created after
    assert news.quiet_since_start("late") is None


def test_a_start_whose_end_was_heard_before_it_was_answered_is_not_quiet() -> None:
    """A worker may run a workflow and tell its end before its start is answered (the row is visible
    from the start's commit on, the answer waits for the disk): that start must not pass for quiet,
    or its wait would sleep until the poll for news that came already."""
    news = EndNews()
    sent = news.epoch  # the start is sent...
    news.hear(News(ends=[End("fast", 5, 1, "wf.name", "succeeded", b"\xc0", None)]))  # ...its end is heard...
    news.started([("fast", 5)], sent)  # ...and then it is answered
    assert news.quiet_since_start("fast") is None
    sent = news.epoch
    news.hear(News([signal_keys.ended("fast-key")]))  # (an end too big to carry: its key alone)
    news.started([("fast-key", 5)], sent)
    assert news.quiet_since_start("fast-key") is None
    sent = news.epoch
    news.hear(News([signal_keys.queue("default")]))  # other news changes nothing
    news.started([("slow", 5)], sent)
    assert news.quiet_since_start("slow") is not None


async def test_a_timeout_is_told_only_after_a_look_at_the_row(app: pgflow.App, second_app: pgflow.App, dsn: str,
                                                              schema: str) -> None:
    async def quick(n: int) -> int:
        return n

    second_app.workflow(name="carried.quick")(quick)
    caller = app.workflow(name="carried.quick")(quick)
    await second_app.migrate_async()
    stop, serving = threading.Event(), threading.Event()

    async def serve() -> None:  # on a thread and loop of its own, like another process
        async with second_app.worker():
            serving.set()
            while not stop.is_set():
                await asyncio.sleep(0.02)

    thread = threading.Thread(target=asyncio.run, args=(serve(),))
    thread.start()
    try:
        serving.wait(30)
        parked = await caller.with_options(queue="nobody.serves").start_async(0)
        waiting = asyncio.create_task(parked.result_async(timeout=60))  # keeps the listener listening
        while app.stats().listeners_connected == 0:
            await asyncio.sleep(0.02)
        handle = await caller.start_async(1)  # started while the listener listens
        # This loop is blocked until the worker ended it: the end's ping cannot be heard meanwhile.
        with psycopg.connect(dsn, autocommit=True) as conn:
            while conn.execute(f'SELECT status FROM "{schema}".workflows WHERE id = %s',
                               (handle.id,)).fetchone() != ("succeeded",):
                time.sleep(0.01)
        # Its ping not heard yet, "look once" still finds it ended.
        assert await handle.result_async(timeout=0) == 1
        waiting.cancel()
    finally:
        stop.set()
        thread.join(30)


async def test_a_resumed_workflow_is_not_answered_by_its_earlier_end(app: pgflow.App, second_app: pgflow.App) -> None:
    runs: list[int] = []

    async def fails_once() -> int:
        runs.append(1)
        if len(runs) == 1:
            raise ValueError("the first run fails")
        return len(runs)

    second_app.workflow(name="carried.fails_once")(fails_once)
    caller = app.workflow(name="carried.fails_once")(fails_once)
    await second_app.migrate_async()
    parked = await caller.with_options(queue="nobody.serves").start_async()
    waiting = asyncio.create_task(parked.result_async(timeout=60))  # keeps the listener listening
    while app.stats().listeners_connected == 0:
        await asyncio.sleep(0.02)
    handle = await caller.start_async()  # started while listening: its end is heard here
    async with second_app.worker():
        while await handle.status_async() != "failed":  # nobody waits for it: its end is only heard
            await asyncio.sleep(0.02)
        await handle.resume_async()
        assert await handle.result_async(timeout=30) == 2  # the resumed run's, not the heard failure
    waiting.cancel()
