"""One meaning of attempt, the same wherever it is shown.

``pgflow.attempt()`` is the run's number against the workflow's ``max_attempts``: 1 on its first run,
one more after a run that its own crash (alone), a stop or a lost lease cut short; a wake-up, a retry
or a rerun after another workflow's crash begins no new attempt. ``pgflow.step_attempt()`` counts the
tries of a step over every run, each once, tries that a crash cut short included. The log, ``workflows
show`` (text and ``--json``), the dashboard, ``handle.info()``, ``list_workflows`` and the records all
give the same numbers, between runs as during them, and never one above the limit.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

import pgflow
from pgflow._core.engine.claims import CRASHES_ALONE
from pgflow.dashboard.data import Reader

from .apps import suspects
from .helpers import query
from .processes import LEASE, Processes, lines, result_of
from .test_crash_attribution import fleet

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.anyio


def show(env: dict[str, str], id: str, *options: str) -> str:
    """``pgflow workflows show ID`` as a user runs it."""
    done = subprocess.run([sys.executable, "-m", "pgflow", "workflows", "show", id, *options], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def shown_attempt(env: dict[str, str], id: str) -> tuple[str, Any]:
    """The attempt line of ``workflows show`` and the ``--json`` field."""
    [line] = [" ".join(line.split()) for line in show(env, id).splitlines() if line.strip().startswith("attempt")]
    return line, json.loads(show(env, id, "--json"))["attempt"]


async def everywhere(app: pgflow.App, id: str) -> dict[str, Any]:
    """The workflow's attempt as the API, the listing and the dashboard give it."""
    handle = app.handle(id)
    [listed] = [w for w in await app.list_workflows_async() if w.id == id]
    detail = await Reader(app).workflow(id)
    assert detail is not None
    return {"details": (await app.workflow_details_async(id)).attempt,
            "info": (await handle.info_async()).record.attempt, "listed": listed.attempt,
            "dashboard": detail.record["attempt"]}


def everywhere_sync(app: pgflow.App, id: str) -> dict[str, Any]:
    """``everywhere``, from a test that is not async (one that waits on other processes)."""
    [listed] = [w for w in app.list_workflows() if w.id == id]
    detail = anyio.run(Reader(app).workflow, id)
    assert detail is not None
    return {"details": app.workflow_details(id).attempt, "info": app.handle(id).info().record.attempt,
            "listed": listed.attempt, "dashboard": detail.record["attempt"]}


def the_same(found: dict[str, Any], value: int) -> None:
    assert found == dict.fromkeys(found, value), found


# -- after a crash --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_after_a_crash_every_place_gives_the_same_attempt_and_step_attempt(
    app: pgflow.App, worker_env: dict[str, str], procs: Processes, tmp_path: Path,
) -> None:
    """The step kills its worker process the first time (alone in it, so the crash is charged): the
    second run is attempt 2, and the step's second try is step attempt 2, everywhere."""
    wf = suspects.build(app)
    effects, marker = tmp_path / "effects.txt", tmp_path / "crashed"
    with fleet(procs, worker_env, processes=1, concurrency=4):
        handle = wf.crash_once.start(str(effects), str(marker))
        assert result_of(handle, procs) == [2, 2]  # pgflow.attempt(), pgflow.step_attempt() in the second run
    assert [line.split()[3] for line in lines(effects)] == ["1", "2"]  # the step ran twice, each try counted once

    the_same(everywhere_sync(app, handle.id), 2)
    assert shown_attempt(worker_env, handle.id) == (f"attempt: 2 (at most {suspects.LIMIT})", 2)
    assert [s.attempts for s in app.workflow_details(handle.id).steps] == [2]
    assert [s.attempts for s in handle.info().steps] == [2]
    detail = anyio.run(Reader(app).workflow, handle.id)
    assert detail is not None and [s.attempts for s in detail.steps] == [2]
    assert [s["attempts"] for s in json.loads(show(worker_env, handle.id, "--json"))["steps"]] == [2]
    ended = [line for line in procs.logs().splitlines() if handle.id in line and " succeeded in " in line]
    assert len(ended) == 1 and ended[0].endswith("(attempt 2)"), ended


# -- waiting, ending, cancelled -------------------------------------------------------------------------


@pytest.fixture
def waiting_app(dsn: str, schema: str) -> Any:
    """An App that gives the slot back for any wait longer than 0.1 s."""
    made = pgflow.App(dsn=dsn, schema=schema, suspend_after=0.1)
    yield made
    made.close()


async def test_a_waiting_workflow_shows_the_attempt_it_runs_before_and_after_it_ends(
    waiting_app: pgflow.App, caplog: pytest.LogCaptureFixture,
) -> None:
    app = waiting_app

    @app.workflow(name="attempts.waits")
    async def waits() -> list[int]:
        before = pgflow.attempt()
        await pgflow.recv_async("go", timeout=60)
        return [before, pgflow.attempt()]

    await app.migrate_async()
    handle = await waits.start_async()
    caplog.set_level(logging.INFO, logger="pgflow.workflows")
    async with app.worker(concurrency=2):
        await wait_for_status(app, handle.id, "queued", waiting=True)
        the_same(await everywhere(app, handle.id), 1)  # waiting, its slot given back: still attempt 1
        await handle.send_async("go", True)
        assert await handle.result_async(timeout=30) == [1, 1]
    the_same(await everywhere(app, handle.id), 1)
    ends = [m for m in (r.getMessage() for r in caplog.records) if handle.id in m and " succeeded in " in m]
    assert len(ends) == 1 and ends[0].endswith("(attempt 1)"), ends


async def test_a_workflow_cancelled_while_it_waits_keeps_its_attempt(waiting_app: pgflow.App) -> None:
    app = waiting_app

    @app.workflow(name="attempts.cancelled")
    async def waits_forever() -> None:
        await pgflow.recv_async("never", timeout=3600)

    await app.migrate_async()
    handle = await waits_forever.start_async()
    async with app.worker(concurrency=2):
        await wait_for_status(app, handle.id, "queued", waiting=True)
        await handle.cancel_async()
        with pytest.raises(pgflow.WorkflowCancelled):
            await handle.result_async(timeout=30)
    assert await handle.status_async() == "cancelled"
    the_same(await everywhere(app, handle.id), 1)


async def test_a_retried_workflow_keeps_its_attempt(app: pgflow.App) -> None:
    """A run of the body retried under the workflow's retry policy is no new attempt."""

    @app.workflow(name="attempts.retried", retry=pgflow.RetryPolicy(max_attempts=3, backoff=0.01))
    async def flaky() -> list[int]:
        if pgflow.attempt() == 1 and not seen:
            seen.append(1)
            raise ConnectionError("once")
        return [pgflow.attempt()]

    seen: list[int] = []
    await app.migrate_async()
    async with app.worker(concurrency=2):
        handle = await flaky.start_async()
        assert await handle.result_async(timeout=30) == [1]
    the_same(await everywhere(app, handle.id), 1)


async def wait_for_status(app: pgflow.App, id: str, status: str, waiting: bool = False) -> None:
    """Until the workflow has ``status`` (and, with ``waiting``, waits for a message with its slot given back)."""
    for _ in range(600):
        details = await app.workflow_details_async(id)
        if details.status == status and (not waiting or details.started_at is not None):
            return
        await anyio.sleep(0.05)
    pytest.fail(f"workflow {id} never {status}")


# -- the crash loop at its limit ------------------------------------------------------------------------


async def test_a_crash_loop_stops_at_its_limit_and_never_shows_an_attempt_above_it(
    app: pgflow.App, dsn: str, schema: str, worker_env: dict[str, str],
) -> None:
    """The worker dying under it alone, claim after claim (its lease made to run out, as a dead
    worker's does): attempt 1, 2, 3, then the claim that gives it up begins no attempt 4."""
    limit = 3
    assert limit <= CRASHES_ALONE

    @app.workflow(name="attempts.loop", max_attempts=limit)
    async def loop() -> None:
        pass

    await app.migrate_async()
    handle = await loop.start_async()
    store = await app._client.runtime().store()  # noqa: SLF001 - the claims, as a worker makes them
    names = [loop.name]
    [claimed], _ = await store.claims.claim("A", ["default"], names, 4, LEASE)  # held alone: its crash is charged
    runs = [claimed.run]
    for _ in range(limit):
        await query(dsn, f'UPDATE "{schema}".workflows SET lease_expires_at = now() - interval \'1 s\''
                         ' WHERE id = %s', handle.id)
        store.claims._full_claim_at.clear()  # noqa: SLF001 - the next claim is a full one, which rescues it
        assert await store.claims.claim("B", ["default"], names, 4, LEASE) == ([], None)
        the_same(await everywhere(app, handle.id), runs[-1])  # queued again: the attempt it had
        again = await store.claims.claim_suspect("B", ["default"], names, LEASE)
        assert again is not None
        runs.append(again.run)
    assert runs == [1, 2, 3, 3]
    assert again is not None and again.give_up and again.crashes == limit
    line, as_json = shown_attempt(worker_env, handle.id)
    assert (line, as_json) == (f"attempt: {limit} (at most {limit})", limit)
