"""``pgflow workflows ls|show|cancel|resume|fork`` and ``pgflow tail``, run as real processes."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from typing import Any

import anyio
import msgspec
import psycopg
import pytest

import pgflow

from .apps import ops_app
from .helpers import ONE_SERVER

pytestmark = pytest.mark.anyio

WAIT = 60.0


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pgflow", *args], env=env, capture_output=True, text=True,
                          timeout=WAIT)


def as_json(result: subprocess.CompletedProcess[str]) -> Any:
    assert result.returncode == 0, result.stderr
    return msgspec.json.decode(result.stdout)


@ONE_SERVER  # the commands' arguments and output; the operations they run are the API's, tested on both servers
async def test_the_management_commands(app: pgflow.App, worker_env: dict[str, str]) -> None:
    counts, fails = ops_app.build(app)
    run = anyio.to_thread.run_sync
    async with app.worker(concurrency=4):
        good, bad = await counts.start_async(3), await fails.start_async()
        with anyio.fail_after(WAIT):
            assert await good.result_async() == 4
            with pytest.raises(pgflow.WorkflowFailed):
                await bad.result_async()

        listed = as_json(await run(cli, worker_env, "workflows", "ls", "--json"))
        assert [(r["id"], r["status"]) for r in listed] == [(bad.id, "failed"), (good.id, "succeeded")]
        text = (await run(cli, worker_env, "workflows", "ls", "--status", "failed")).stdout
        assert text.splitlines()[0].split()[:4] == ["ID", "NAME", "QUEUE", "STATUS"] and bad.id in text
        assert good.id not in text

        shown = as_json(await run(cli, worker_env, "workflows", "show", good.id, "--json"))
        assert shown["status"] == "succeeded" and shown["result"] == 4 and shown["arguments"] == {"n": 3}
        assert [s["name"] for s in shown["steps"]] == ["ops.step"]
        assert shown["streams"] == [{"key": "numbers", "length": 3, "closed": True}]
        assert "streams:" in (await run(cli, worker_env, "workflows", "show", good.id)).stdout

        tailed = (await run(cli, worker_env, "tail", good.id, "numbers", "--offset", "1", "--json")).stdout
        assert [msgspec.json.decode(line) for line in tailed.splitlines()] == [
            {"position": 1, "value": 1}, {"position": 2, "value": 2}]

        forked = as_json(await run(cli, worker_env, "workflows", "fork", good.id, "--from-step", "1", "--json"))
        with anyio.fail_after(WAIT):
            assert await app.handle(forked["id"]).result_async() == 4

        refused = await run(cli, worker_env, "workflows", "resume", good.id)
        assert refused.returncode == 1 and "only a failed or cancelled workflow resumes" in refused.stderr
        assert (await run(cli, worker_env, "workflows", "resume", bad.id)).returncode == 0
        with anyio.fail_after(WAIT), pytest.raises(pgflow.WorkflowFailed):
            await bad.result_async()  # it ran again, and failed again, as designed
        assert (await bad.info_async()).record.attempt == 1

        waiting = await counts.with_options(delay=3600).start_async(1)
        assert (await run(cli, worker_env, "workflows", "cancel", waiting.id)).returncode == 0
        assert await waiting.status_async() == "cancelled"

        unknown = await run(cli, worker_env, "workflows", "show", "nobody")
        assert unknown.returncode == 1 and "no workflow with id 'nobody'" in unknown.stderr

        printed = await run(cli, worker_env, "psql", "--print")
        assert printed.stdout.strip() == worker_env["PGFLOW_DSN"]
        if shutil.which("psql"):  # psql on the App's database, pgflow's schema first
            shown = await run(lambda: subprocess.run(
                [sys.executable, "-m", "pgflow", "psql"], env=worker_env, input="SHOW search_path;\n",
                capture_output=True, text=True, timeout=WAIT))
            assert f"{app.schema},public" in shown.stdout, shown.stderr


async def test_queues_workers_and_status(app: pgflow.App, dsn: str, worker_env: dict[str, str]) -> None:
    counts, _ = ops_app.build(app)
    run = anyio.to_thread.run_sync
    await counts.with_options(queue="later", delay=3600).start_async(1)
    app.queue("limited", concurrency=2)
    # No worker yet: unhealthy.
    down = await run(cli, worker_env, "status", "--json")
    assert down.returncode == 1 and msgspec.json.decode(down.stdout)["live_workers"] == 0
    async with app.worker(concurrency=3, queues=["default", "limited"]):
        with anyio.fail_after(WAIT):
            while not app.workers_info():
                await anyio.sleep(0.05)
        queues = {q["name"]: q for q in as_json(await run(cli, worker_env, "queues", "--json"))}
        assert (queues["later"]["queued"], queues["later"]["due"]) == (1, 0)
        assert queues["limited"]["concurrency"] == 2
        [worker] = as_json(await run(cli, worker_env, "workers", "--json"))
        assert worker["queues"] == ["default", "limited"] and "ops.counts" in worker["names"]
        assert (await run(cli, worker_env, "status")).returncode == 0

        # A queued workflow that no live worker can run: reported, exit code 1.
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute(f'INSERT INTO "{app.schema}".workflows (id, name, queue, inputs)'
                               " VALUES ('orphan', 'nobody.runs.this', 'default', '\\x80')")
        unserved = await run(cli, worker_env, "status")
        assert unserved.returncode == 1 and "'nobody.runs.this': no live worker runs that name" in unserved.stdout
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute(f'DELETE FROM "{app.schema}".workflows WHERE id = %s', ("orphan",))

        # A listener stuck in an open transaction: reported, exit code 1.
        async with await psycopg.AsyncConnection.connect(dsn) as stuck:
            await stuck.execute(f'LISTEN "pgflow_{app.schema}"')  # opens the transaction it stays in
            with anyio.fail_after(WAIT):
                while (report := await run(cli, worker_env, "status", "--stuck-after", "0.5")).returncode == 0:
                    await anyio.sleep(0.2)
            assert f"session {stuck.info.backend_pid} idle in a transaction" in report.stdout


CLIPBOARD = "\x1b]52;c;cGduZmxvdw==\x07"  # OSC 52: writes the operator's clipboard
CLEAR = "\x1b[2J"  # clears the screen
RAW = ("\x1b", "\x07", "\r", "\x7f", "\x9b")  # ESC, BEL, a bare CR, DEL, and CSI in one C1 character


@ONE_SERVER  # what reaches the terminal is escaped in Python: the same on any server
async def test_stored_text_reaches_the_terminal_with_its_control_characters_escaped(
    app: pgflow.App, worker_env: dict[str, str],
) -> None:
    """Ids, names, queues, stream keys and values, error types: text anyone who can start a workflow
    chose, printed on an operator's terminal, which would act on the sequences in it."""
    queue, key, bad_type = f"q{CLEAR}", f"out{CLEAR}", type(f"Bad{CLEAR}", (Exception,), {})

    @app.step(name=f"ops.step{CLEAR}")
    async def refuse() -> None:
        raise bad_type(CLIPBOARD)

    @app.workflow(name=f"ops.evil{CLIPBOARD}", queue=queue)
    async def evil() -> str:
        with contextlib.suppress(bad_type):
            await refuse()
        await pgflow.write_stream_async(key, f"chunk {CLIPBOARD}{CLEAR}\r\x9b31m\x7f")
        await pgflow.write_stream_async(key, {"nested": CLEAR, "more": [CLIPBOARD]})
        await pgflow.close_stream_async(key)
        return f"result {CLIPBOARD}{CLEAR}"

    run = anyio.to_thread.run_sync
    wid = f"wf{CLIPBOARD}{CLEAR}\r\x9b"
    async with app.worker(concurrency=2, queues=[queue]):
        handle = await evil.with_options(id=wid).start_async()
        with anyio.fail_after(WAIT):
            assert await handle.result_async() == f"result {CLIPBOARD}{CLEAR}"

        for args in (("workflows", "ls"), ("workflows", "show", wid), ("tail", wid, key), ("queues",),
                     ("workflows", "resume", wid), ("workflows", "cancel", wid)):
            shown = await run(cli, worker_env, *args)
            assert shown.stdout or shown.stderr, args
            for raw in RAW:
                assert raw not in shown.stdout and raw not in shown.stderr, (args, shown.stdout, shown.stderr)
            if args[0] not in ("queues", "tail"):  # the id, printed visibly escaped
                assert "wf\\x1b]52;c;cGduZmxvdw==\\x07\\x1b[2J\\r\\x9b" in shown.stdout + shown.stderr, args
        assert "ops.evil\\x1b]52;" in (await run(cli, worker_env, "workflows", "ls")).stdout
        text = (await run(cli, worker_env, "workflows", "show", wid)).stdout
        assert "Bad\\x1b[2J" in text and "ops.step\\x1b[2J" in text and "out\\x1b[2J" in text, text
        tailed = (await run(cli, worker_env, "tail", wid, key)).stdout.splitlines()
        assert tailed[0] == "0\tchunk \\x1b]52;c;cGduZmxvdw==\\x07\\x1b[2J\\r\\x9b31m\\x7f", tailed

        # --json: the same text, JSON-escaped (msgspec leaves DEL and C1 raw; they are escaped too).
        listed = await run(cli, worker_env, "workflows", "ls", "--json")
        shown_json = await run(cli, worker_env, "workflows", "show", wid, "--json")
        tailed_json = await run(cli, worker_env, "tail", wid, key, "--json")
        for result in (listed, shown_json, tailed_json):
            for raw in RAW:
                assert raw not in result.stdout, result.stdout
        assert as_json(listed)[0]["id"] == wid and as_json(shown_json)["name"] == f"ops.evil{CLIPBOARD}"
        assert [msgspec.json.decode(line) for line in tailed_json.stdout.splitlines()] == [
            {"position": 0, "value": f"chunk {CLIPBOARD}{CLEAR}\r\x9b31m\x7f"},
            {"position": 1, "value": {"nested": CLEAR, "more": [CLIPBOARD]}}]


async def test_status_names_who_holds_a_maintenance_lock(app: pgflow.App, dsn: str,
                                                         worker_env: dict[str, str]) -> None:
    """Any role can take an advisory lock: one taken by a session that is not a worker's stops its
    service (here the reaper) for good. ``pgflow status`` names the holder and is unhealthy."""
    ops_app.build(app)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True, application_name="squatter") as squat:
        await squat.execute("SELECT pg_advisory_lock(hashtext(%s))", (f"pgflow.{app.schema}.reaper",))
        async with app.worker(lease=1.0):
            with anyio.fail_after(WAIT):  # the worker leads the services it can take
                while not any(h.service == "names" and h.worker for h in (await app.health_async()).maintenance):
                    await anyio.sleep(0.1)
            health = await app.health_async()
            reaper = [h for h in health.maintenance if h.service == "reaper"]
            assert [(h.pid, h.application_name, h.worker) for h in reaper] == [
                (squat.info.backend_pid, "squatter", False)]
            assert not health.ok
            report = await anyio.to_thread.run_sync(cli, worker_env, "status")
            assert report.returncode == 1
            assert f"reaper: held by session {squat.info.backend_pid} (squatter" in report.stdout, report.stdout
