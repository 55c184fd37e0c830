"""Events: a workflow publishes durable values by key (the last one wins, a replay publishes nothing
again); ``handle.get_event`` waits for them from any process, woken by the ping."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

import pgflow

from .helpers import KINDS, query, requeue, run_to_end
from .processes import WAIT, Processes, result_of, wait_until

TARGET = "tests.apps.prims:app"


class Progress(msgspec.Struct):
    pct: int


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_events_across_processes(
    app: pgflow.App, worker_env: dict[str, str], procs: Processes, tmp_path: Path, kind: str,
) -> None:
    effects, gate = tmp_path / "effects", tmp_path / "gate"
    worker = procs.worker("worker", TARGET, worker_env)
    handle = app.start_by_name("prims.publisher" if kind == "async" else "prims.publisher_sync",
                               str(effects), str(gate))
    assert handle.get_event("stage", timeout=WAIT) == "started"
    # A reader already waiting when the value is set is woken by its ping (long before the timeout).
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(handle.get_event("progress", timeout=WAIT, type=Progress)))
    reader.start()
    wait_until(lambda: (tmp_path / "effects").exists(), "the publisher to run", procs, worker)
    gate.touch()
    began = time.monotonic()
    reader.join(WAIT)
    assert got == [Progress(100)], got
    print(f"\n[events] {kind}: a waiting reader in another process got the value {time.monotonic() - began:.3f}s "
          "after the gate opened")
    assert result_of(handle, procs) == "ok"
    assert handle.get_event("stage", timeout=0) == "done"  # the last value set wins


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
async def test_a_replay_does_not_publish_again(app: pgflow.App, dsn: str, schema: str, kind: str) -> None:
    runs: list[int] = []

    @app.step(name="events.work")
    def work() -> int:
        return 1

    if kind == "async":
        @app.workflow(name="events.flow")
        async def flow() -> int:
            runs.append(1)
            # Deliberately not deterministic, to show that the second run publishes nothing.
            await pgflow.set_event_async("run", len(runs))
            return await work()
    else:
        @app.workflow(name="events.flow")
        def flow() -> int:
            runs.append(1)
            pgflow.set_event("run", len(runs))
            return work()

    handle = await flow.start_async()
    assert await run_to_end(app, handle) == 1
    [(set_at,)] = await query(dsn, f'SELECT set_at FROM "{schema}".events WHERE workflow_id = %s', handle.id)
    await requeue(dsn, schema, handle.id)
    assert await run_to_end(app, handle) == 1
    assert len(runs) == 2
    assert await handle.get_event_async("run") == 1
    assert await query(dsn, f'SELECT set_at FROM "{schema}".events WHERE workflow_id = %s', handle.id) == [(set_at,)]


@pytest.mark.anyio
async def test_get_event_timeout_end_and_errors(app: pgflow.App) -> None:
    gate = anyio.Event()

    @app.step(name="events.wait")
    async def wait_gate() -> None:
        await gate.wait()

    @app.workflow(name="events.silent")
    async def silent() -> str:
        await pgflow.set_event_async("a", 1)
        await pgflow.set_event_async("a", 2)
        await wait_gate()
        return "done"

    handle = await silent.start_async()
    async with app.worker(concurrency=2):
        assert await handle.get_event_async("a", timeout=30) in (1, 2)
        began = time.monotonic()
        assert await handle.get_event_async("never", timeout=0.5) is None
        assert 0.5 <= time.monotonic() - began < 5
        gate.set()
        assert await handle.result_async(timeout=30) == "done"
    assert await handle.get_event_async("a") == 2
    # The workflow ended without setting it: None at once, even with no timeout.
    with anyio.fail_after(10):
        assert await handle.get_event_async("never") is None
    assert await anyio.to_thread.run_sync(lambda: handle.get_event("a", timeout=1)) == 2
    with pytest.raises(pgflow.UnknownWorkflow):
        await app.handle("nobody").get_event_async("a", timeout=1)
    with pytest.raises(ValueError, match="an event key"):
        await handle.get_event_async("")
    with pytest.raises(ValueError, match="timeout"):
        await handle.get_event_async("a", timeout=-1)


@pytest.mark.anyio
async def test_set_event_outside_a_workflow_in_a_step_and_bad_values(app: pgflow.App) -> None:
    with pytest.raises(RuntimeError, match="can only be called inside a workflow or step"):
        await pgflow.set_event_async("k", 1)
    with pytest.raises(RuntimeError, match="can only be called inside a workflow or step"):
        await anyio.to_thread.run_sync(pgflow.set_event, "k", 1)
    with pytest.raises(pgflow.SerializationError, match="event 'k'"):
        await pgflow.set_event_async("k", object())
    with pytest.raises(ValueError, match="an event key"):
        await pgflow.set_event_async("", 1)

    @app.step(name="events.in_step")
    def publish_in_step() -> None:
        pgflow.set_event("k", 1)

    @app.workflow(name="events.step_flow")
    async def flow() -> None:
        await publish_in_step()

    async with app.worker():
        with pytest.raises(pgflow.WorkflowFailed, match="for the workflow body, not for the inside of a step"):
            await (await flow.start_async()).result_async(timeout=30)


@pytest.mark.anyio
async def test_a_fork_has_the_events_of_its_copied_steps(app: pgflow.App) -> None:
    @app.workflow(name="events.forked")
    async def forked() -> None:
        await pgflow.set_event_async("stage", "one")
        await pgflow.set_event_async("stage", "two")
        await pgflow.set_event_async("other", "three")

    handle = await forked.start_async()
    assert await run_to_end(app, handle) is None
    fork = await handle.fork_async(from_step=2)
    # Before the fork runs, it holds what its first two entries had published.
    assert await fork.get_event_async("stage", timeout=0) == "two"
    assert await fork.get_event_async("other", timeout=0) is None
    assert await run_to_end(app, fork) is None
    assert await fork.get_event_async("other", timeout=0) == "three"


