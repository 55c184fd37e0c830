"""Pausing a queue: its workflows are not claimed, running ones finish, starts still queue, and
``pgflow queues`` and ``status`` say it is paused and since when; resuming lets the fleet claim them
at once. Both APIs, and the command line, against real servers."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest

import pgflow

from .helpers import ONE_SERVER
from .test_dashboard_http import AUTH, TOKEN, csrf_of, form, page, serving

pytestmark = pytest.mark.anyio

WAIT = 60.0
ROOT = Path(__file__).resolve().parent.parent


async def _paused_rows(dsn: str, schema: str) -> list[str]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(f'SELECT name FROM "{schema}".paused_queues ORDER BY name')
        return [str(r[0]) for r in await cur.fetchall()]


async def test_a_paused_queue_is_not_claimed_and_runs_when_resumed(dsn: str, schema: str) -> None:
    release = asyncio.Event()

    async def hold() -> str:
        await release.wait()
        return "held"

    async def quick(n: int) -> int:
        return n

    async with pgflow.App(dsn, schema=schema) as app:
        held = app.workflow(name="pause.hold", queue="bulk")(hold)
        bulk = app.workflow(name="pause.bulk", queue="bulk")(quick)
        other = app.workflow(name="pause.other", queue="default")(quick)
        running = await held.start_async()
        async with app.worker(concurrency=4, queues=["bulk", "default"]):
            with anyio.fail_after(WAIT):
                while await running.status_async() != "running":
                    await asyncio.sleep(0.02)
            since = await app.pause_queue_async("bulk")
            assert await app.pause_queue_async("bulk") == since  # again: nothing changes
            waiting = await bulk.start_async(1)  # starts still queue
            # Queued after the paused one, on a queue the same claims read: it runs, the paused one does not.
            assert await (await other.start_async(2)).result_async(timeout=WAIT) == 2
            assert await waiting.status_async() == "queued"
            release.set()
            assert await running.result_async(timeout=WAIT) == "held"  # running ones finish
            assert await waiting.status_async() == "queued"
            info = {q.name: q for q in await app.queues_info_async()}
            assert info["bulk"].paused_since == since and "default" not in info  # (no work there now)
            health = await app.health_async()
            assert any("'bulk' is paused" in note for note in health.notes)
            assert not any("bulk" in problem for problem in health.problems)
            assert await app.resume_queue_async("bulk") is True
            assert await waiting.result_async(timeout=WAIT) == 1
            assert await app.resume_queue_async("bulk") is False


def test_pausing_from_the_sync_api_and_bad_input(dsn: str, schema: str) -> None:
    async def quick(n: int) -> int:
        return n

    with pgflow.App(dsn, schema=schema) as app:
        app.workflow(name="pause.sync", queue="reports")(quick)
        app.migrate()
        with pytest.raises(ValueError, match="no queue 'nope' is known"):
            app.pause_queue("nope")
        for bad in ("", 3, None):
            with pytest.raises((ValueError, TypeError)):
                app.pause_queue(bad)  # type: ignore[arg-type]
        assert asyncio.run(_paused_rows(dsn, schema)) == []  # nothing was written
        since = app.pause_queue("reports")  # this App's own queue: known though nothing ran yet
        assert [q.paused_since for q in app.queues_info() if q.name == "reports"] == [since]
        assert app.resume_queue("reports") is True


@ONE_SERVER  # the commands around pause and resume, which the API tests above run on both servers
def test_the_command_line_pauses_lists_and_resumes(dsn: str, schema: str) -> None:
    env = {"PGFLOW_DSN": dsn, "PGFLOW_SCHEMA": schema, "PATH": "/usr/bin:/bin"}

    def pgflow_cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pgflow", *args], capture_output=True, text=True,
                              timeout=120, cwd=ROOT, env=env)

    async def quick() -> None:
        return None

    with pgflow.App(dsn, schema=schema) as app:
        app.workflow(name="pause.cli", queue="mail")(quick).start()
    refused = pgflow_cli("queues", "pause", "nope")
    assert refused.returncode != 0 and "no queue 'nope' is known" in refused.stderr
    assert "Traceback" not in refused.stderr
    paused = pgflow_cli("queues", "pause", "mail", "--json")
    assert paused.returncode == 0, paused.stderr
    assert json.loads(paused.stdout)["queue"] == "mail"
    listed = {q["name"]: q for q in json.loads(pgflow_cli("queues", "--json").stdout)}
    assert listed["mail"]["paused_since"] is not None
    shown = pgflow_cli("queues")
    assert "PAUSED_SINCE" in shown.stdout and "mail" in shown.stdout
    status = pgflow_cli("status")
    assert "'mail' is paused since" in status.stdout
    missing = pgflow_cli("queues", "pause")
    assert missing.returncode != 0 and "needs the queue's name" in missing.stderr
    resumed = pgflow_cli("queues", "resume", "mail", "--json")
    assert resumed.returncode == 0 and json.loads(resumed.stdout) == {"queue": "mail", "resumed": True}


@pytest.fixture
def serve(dsn: str, schema: str, app: pgflow.App) -> Iterator[Any]:
    yield from serving(dsn, schema, app)


@ONE_SERVER  # the dashboard's forms around pause and resume, which the API tests run on both servers
def test_the_dashboard_pauses_and_resumes_with_actions_on(serve: Any, app: pgflow.App) -> None:
    """The overview's queue buttons: there only with actions on, forms of this browser, and a queue
    paused and resumed through them shows so on the page."""
    off = serve(actions=False, worker=False)
    handle = app.start_by_name("dash.child", 2, queue="mail")
    assert 'action="/queue-action"' not in page(off.base, "/").body
    assert form(off.base, "/queue-action", {"queue": "mail", "action": "pause", "csrf": "x"}).status == 403
    served = serve(token=TOKEN, actions=True, worker=False)
    shown = page(served.base, "/", **AUTH)
    assert 'id="pause-mail"' in shown.body
    cookies, csrf = shown.cookies(), csrf_of(shown)
    good = {"queue": "mail", "action": "pause", "csrf": csrf}
    assert form(served.base, "/queue-action", {**good, "csrf": "f" * 64}, cookies, **AUTH).status == 403
    assert form(served.base, "/queue-action", {**good, "action": "drop"}, cookies, **AUTH).status == 400
    assert form(served.base, "/queue-action", {**good, "queue": "nope"}, cookies, **AUTH).status == 400
    assert [q.paused_since for q in app.queues_info() if q.name == "mail"] == [None]  # nothing changed yet
    assert form(served.base, "/queue-action", good, cookies, **AUTH).status == 303
    shown = page(served.base, "/", **AUTH)
    assert "paused since" in shown.body and 'id="resume-mail"' in shown.body
    resumed = form(served.base, "/queue-action", {**good, "action": "resume"}, cookies, **AUTH)
    assert resumed.status == 303
    assert [q.paused_since for q in app.queues_info() if q.name == "mail"] == [None]
    assert handle.status() == "queued"
