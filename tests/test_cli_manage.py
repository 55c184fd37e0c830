"""``pgflow workflows ls|show|cancel|resume|fork`` and ``pgflow tail``, run as real processes."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import anyio
import msgspec
import pytest

import pgflow

from .apps import ops_app

pytestmark = pytest.mark.anyio

WAIT = 60.0


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pgflow", *args], env=env, capture_output=True, text=True,
                          timeout=WAIT)


def as_json(result: subprocess.CompletedProcess[str]) -> Any:
    assert result.returncode == 0, result.stderr
    return msgspec.json.decode(result.stdout)


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
        assert shown["record"]["status"] == "succeeded"
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
