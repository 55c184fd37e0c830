"""The worker's run tasks (pgflow/_core/runs.py), without a server: their scopes cancelled and the
runs awaited when their owner stops, their shielded sections honoured, nothing started once it has
stopped. (What a run does when its scope is cancelled is tests/test_basics.py's and the fault tests'.)"""

from __future__ import annotations

import logging
import warnings

import anyio
import pytest

from pgflow._core.runs import Runs

pytestmark = pytest.mark.anyio


async def test_stopping_cancels_every_run_and_waits_for_its_shielded_end() -> None:
    runs, serving, release = Runs(), anyio.CancelScope(), anyio.Event()
    started, giving_back, gave_back, served = [], [], [], anyio.Event()
    both_started, both_giving_back = anyio.Event(), anyio.Event()

    async def run(n: int, scope: anyio.CancelScope) -> None:
        try:
            with scope:
                started.append(n)
                if len(started) == 2:
                    both_started.set()
                await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):  # as a run gives its workflow back
                giving_back.append(n)
                if len(giving_back) == 2:
                    both_giving_back.set()
                await release.wait()
                gave_back.append(n)

    async def serve() -> None:
        with serving:
            await runs.serve()
        served.set()

    async with anyio.create_task_group() as group:
        group.start_soon(serve)
        await anyio.sleep(0)
        assert runs.start(run, 1, "one") and runs.start(run, 2, "two")
        await both_started.wait()
        serving.cancel()
        await both_giving_back.wait()
        assert not served.is_set() and len(runs) == 2  # serve waits for the shielded give-backs
        release.set()
        await served.wait()
    assert sorted(gave_back) == [1, 2] and len(runs) == 0


async def test_a_run_offered_after_the_stop_is_refused_and_closed() -> None:
    runs = Runs()
    async with anyio.create_task_group() as group:
        group.start_soon(runs.serve)
        await anyio.sleep(0)
        group.cancel_scope.cancel()

    ran = []

    async def run(n: int, scope: anyio.CancelScope) -> None:
        ran.append(n)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a coroutine made and never awaited would warn
        assert runs.start(run, 1, "late") is False
    assert ran == [] and len(runs) == 0


async def test_a_run_that_raises_is_logged_and_the_others_go_on(caplog: pytest.LogCaptureFixture) -> None:
    runs = Runs()
    done = anyio.Event()

    async def bad(n: int, scope: anyio.CancelScope) -> None:
        raise RuntimeError("a bug in the run")

    async def good(n: int, scope: anyio.CancelScope) -> None:
        done.set()

    with caplog.at_level(logging.ERROR, logger="pgflow.worker"):
        async with anyio.create_task_group() as group:
            group.start_soon(runs.serve)
            await anyio.sleep(0)
            runs.start(bad, 1, "bad")
            runs.start(good, 2, "good")
            await done.wait()
            await anyio.sleep(0)
            group.cancel_scope.cancel()
    assert any("the task of bad ended" in r.getMessage() and r.exc_info for r in caplog.records)
