"""Safe deploys: ``patched`` across a real replay by new code in another process, ``deprecate_patch``,
and ``pgflow check-replay`` finding the journals that new code would not replay."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest

import pgflow

from .helpers import ONE_SERVER
from .processes import Processes, lines, result_of, wait_until

TARGET = "tests.apps.deploys:app"
ROOT = Path(__file__).resolve().parent.parent


def code(env: dict[str, str], version: str) -> dict[str, str]:
    return {**env, "PGFLOW_TEST_CODE": version}


def check_replay(env: dict[str, str], version: str, *more: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pgflow", "check-replay", "--app", TARGET, *more],
                          env=code(env, version), cwd=ROOT, capture_output=True, text=True, timeout=120)


def asleep(handle: pgflow.WorkflowHandle[Any]) -> bool:
    """Given its slot back in a durable sleep (so no worker holds it)."""
    return handle.status() == "queued" and any(s.name == "pgflow.sleep" for s in handle.steps())


def counted(notes: Path) -> Counter[str]:
    return Counter(line.rsplit(":", 1)[0] for line in lines(notes))


@pytest.mark.parametrize("kind", ["flow", "flow_sync"])
def test_patched_across_a_real_replay_and_check_replay_before_each_deploy(
        app: pgflow.App, worker_env: dict[str, str], procs: Processes, tmp_path: Path, kind: str) -> None:
    name = f"deploys.{kind}"
    notes = str(tmp_path / "notes.txt")
    # v1 starts a workflow, which sleeps with its slot given back; then v1's worker dies.
    v1 = procs.worker("v1", TARGET, code(worker_env, "v1"), concurrency=2)
    old = app.start_by_name(name, notes, 1, 4.0)
    wait_until(lambda: asleep(old), "the v1 workflow asleep", procs, v1)
    v1.signal(signal.SIGKILL)
    v1.wait_exit()

    # Before deploying: the reordering alone would break it; behind patched() it replays.
    bad = check_replay(worker_env, "v2bad")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert f"workflow {old.id!r} ({name!r}): at position 1 the code calls 'deploys.c', the journal recorded " \
           "'pgflow.sleep'" in bad.stdout, bad.stdout
    good = check_replay(worker_env, "v2")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "check-replay ok: 1 replay, 0 would not" in good.stdout

    # v2 finishes the old workflow on the old path, and runs new ones on the new.
    v2 = procs.worker("v2", TARGET, code(worker_env, "v2"), concurrency=2)
    new = app.start_by_name(name, notes, 2, 4.0)
    assert result_of(old, procs) == 20  # (1 + 1) * 10: no c
    assert [s.name for s in old.steps()] == ["deploys.a", "pgflow.sleep", "deploys.b"]
    wait_until(lambda: asleep(new), "the v2 workflow asleep", procs, v2)
    assert [s.name for s in new.steps()] == ["deploys.a", "pgflow.patch:c-first", "deploys.c", "pgflow.sleep"]
    v2.signal(signal.SIGKILL)
    v2.wait_exit()

    # Its journal holds the patch: v1 would not replay it, v3 (the old path gone) does.
    back = check_replay(worker_env, "v1", "--json")
    assert back.returncode == 1
    found = json.loads(back.stdout)
    assert [(m["workflow_id"], m["position"], m["called"], m["recorded"]) for m in found["mismatches"]] == \
        [(new.id, 1, "pgflow.sleep", "pgflow.patch:c-first")]
    assert check_replay(worker_env, "v3").returncode == 0

    procs.worker("v3", TARGET, code(worker_env, "v3"), concurrency=2)
    newest = app.start_by_name(name, notes, 3, 0.0)
    assert result_of(new, procs) == 1030  # ((2 + 1) + 100) * 10, c run once, before the deploy
    assert result_of(newest, procs) == 1040
    assert [s.name for s in newest.steps()] == ["deploys.a", "deploys.c", "pgflow.sleep", "deploys.b"]
    ran = counted(tmp_path / "notes.txt")
    assert ran == Counter({"a:1": 1, "b:2": 1, "a:2": 1, "c:3": 1, "b:103": 1, "a:3": 1, "c:4": 1, "b:104": 1})
    ends = check_replay(worker_env, "v3")
    assert ends.returncode == 0 and "0 replay, 0 would not" in ends.stdout


@pytest.mark.anyio
async def test_patched_answers_and_refusals_in_process(app: pgflow.App, tmp_path: Path) -> None:
    """In one process: a fresh run takes the patch and journals it before the steps gathered after it;
    a patch id is checked before anything is written; outside a body the calls refuse."""
    calls: list[str] = []

    @app.step(name="p.s")
    async def s(x: int) -> int:
        calls.append(f"s{x}")
        return x

    @app.workflow(name="p.flow")
    async def flow() -> list[bool]:
        import asyncio

        first = pgflow.patched("one")
        await asyncio.gather(s(1), s(2))
        second = await pgflow.patched_async("two")
        pgflow.deprecate_patch("gone")  # never recorded: no position
        return [first, second]

    @app.workflow(name="p.bad")
    async def bad(change: Any) -> None:
        pgflow.patched(change)

    @app.step(name="p.inner")
    async def inner() -> None:
        pgflow.patched("x")

    @app.workflow(name="p.in_step")
    async def in_step() -> None:
        await inner()

    with pytest.raises(RuntimeError, match="inside a workflow"):
        pgflow.patched("x")
    async with app.worker(concurrency=4):
        h = await flow.start_async()
        assert await h.result_async(timeout=30) == [True, True]
        assert [st.name for st in await h.steps_async()] == ["pgflow.patch:one", "p.s", "p.s", "pgflow.patch:two"]
        for change in ("", "a\x00b", 7, "x" * 201):
            failed = await bad.start_async(change)
            with pytest.raises(pgflow.WorkflowFailed) as info:
                await failed.result_async(timeout=30)
            assert info.value.error_type in ("TypeError", "ValueError")
            assert await failed.steps_async() == []
        stepped = await in_step.start_async()
        with pytest.raises(pgflow.WorkflowFailed, match="not for the inside of a step"):
            await stepped.result_async(timeout=30)
    assert sorted(calls) == ["s1", "s2"]


@ONE_SERVER  # arguments refused and text escaped in Python (the journal reads are tested on both servers above)
def test_check_replay_refuses_bad_input_and_escapes_what_it_prints(
        app: pgflow.App, dsn: str, schema: str, worker_env: dict[str, str]) -> None:
    app.migrate()
    for args in (["--status", "failed"], ["--status", ""], ["--limit", "0"], ["--within", "-1"]):
        out = check_replay(worker_env, "v1", *args)
        assert out.returncode == 2 and "pgflow: error:" in out.stderr, (args, out.stderr)
    no_app = subprocess.run([sys.executable, "-m", "pgflow", "check-replay"], env=worker_env, cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert no_app.returncode == 2 and "--app module:app" in no_app.stderr
    # Rows are data: garbage arguments, a hostile id, a journal entry of another name, a name unknown here.
    hostile = "evil\x1b[2J\u202e"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'INSERT INTO "{schema}".workflows (id, name, queue, inputs) VALUES'
                     " (%s, 'deploys.flow', 'default', '\\xc1'::bytea),"
                     " ('other', 'elsewhere.flow', 'default', '\\x90'::bytea),"
                     " ('mixed', 'deploys.flow', 'default', %s)",
                     (hostile, _arguments("n", 1, 0.0)))
        conn.execute(f'INSERT INTO "{schema}".steps (workflow_id, position, name, attempts, attempt)'
                     " VALUES ('mixed', 0, 'deploys.zzz', 1, 1)")
        before = conn.execute(f'SELECT count(*), sum(length(name)) FROM "{schema}".steps').fetchone()
    out = check_replay(worker_env, "v1")
    assert out.returncode == 1
    assert "\x1b" not in out.stdout and "\u202e" not in out.stdout
    assert repr(hostile) in out.stdout and "raises" in out.stdout
    assert "workflow 'mixed' ('deploys.flow'): at position 0 the code calls 'deploys.a', the journal recorded " \
           "'deploys.zzz'" in out.stdout
    assert "skipped 'other': no workflow named 'elsewhere.flow' is registered by this App" in out.stdout
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute(f'SELECT count(*), sum(length(name)) FROM "{schema}".steps').fetchone() == before
        assert conn.execute(f'SELECT count(*) FROM "{schema}".workflows WHERE status <> %s',
                            ("queued",)).fetchone() == (0,)


def _arguments(*args: Any) -> bytes:
    import msgspec

    return msgspec.msgpack.encode([list(args), {}])



def test_every_exception_the_readme_names_is_exported() -> None:
    import inspect
    import re

    from pgflow import errors

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    public = {name for name, value in vars(errors).items() if inspect.isclass(value)
              and issubclass(value, Exception) and not name.startswith("_")}
    named = set(re.findall(r"\b([A-Z][A-Za-z]+)\b", readme)) & public
    assert {"WorkflowTimeout", "MaxAttemptsExceeded", "StepTimeout", "WorkflowFailed"} <= named
    missing = sorted(name for name in named | public if name not in pgflow.__all__)
    assert missing == [], f"exceptions named in the README or public in pgflow.errors, not exported: {missing}"


@pytest.mark.anyio
async def test_patched_is_false_where_an_old_run_started_a_child_without_a_record(
        app: pgflow.App, second_app: pgflow.App) -> None:
    """A child start journals no step, but its id names its position: a patch placed before it must
    not take that position from a parent replayed on new code (which would start a second child)."""
    import anyio

    ran: list[str] = []

    def build(target: pgflow.App, patched: bool) -> Any:
        @target.step(name="h.a")
        async def a() -> None:
            ran.append("a")

        @target.step(name="h.extra")
        async def extra() -> None:
            ran.append("extra")

        @target.workflow(name="h.kid")
        async def kid() -> str:
            return str(await pgflow.recv_async("go", timeout=600))

        @target.workflow(name="h.parent")
        async def parent() -> str:
            await a()
            if patched and pgflow.patched("extra"):
                await extra()
            child = await kid.start_async()
            return str(await child.result_async())

        return parent

    old, new = build(app, False), build(second_app, True)
    async with app.worker(concurrency=4, grace=0.0):
        handle = await old.start_async()
        kid = app.handle(f"{handle.id}.1")
        while True:
            try:
                if (await kid.info_async()).record.waiting_for == "go":
                    break
            except pgflow.UnknownWorkflow:
                pass
            await anyio.sleep(0.05)
    assert await handle.status_async() == "queued"  # given back, its journal: a at 0, the child at 1
    report = await pgflow.check_replay_async(second_app)
    assert report.ok and handle.id in report.passed
    async with second_app.worker(concurrency=4):
        assert new is not None
        await second_app.handle(kid.id).send_async("go", "went")
        assert await second_app.handle(handle.id).result_async(timeout=60) == "went"
    assert [s.name for s in await handle.steps_async()] == ["h.a"]
    assert ran == ["a"]
    assert {r.id for r in await app.list_workflows_async(name="h.kid")} == {kid.id}


@pytest.mark.anyio
async def test_check_replay_reads_a_schema_from_before_the_clock_migration(app: pgflow.App, dsn: str,
                                                                            schema: str) -> None:
    """Run before a deploy, the check meets the schema the old code migrated: it needs no function a
    later migration adds (here the schema's clock, dropped), and reads every recorded sleep as over."""
    import anyio

    @app.step(name="old.a")
    async def a() -> int:
        return 1

    @app.workflow(name="old.flow")
    async def flow() -> int:
        await a()
        await pgflow.sleep_async(600)
        return await a()

    async with app.worker(concurrency=2):
        handle = await flow.start_async()
        while [s.name for s in await handle.steps_async()] != ["old.a", "pgflow.sleep"] \
                or await handle.status_async() != "queued":
            await anyio.sleep(0.05)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(f'DROP FUNCTION "{schema}".clock_now() CASCADE')
    report = await pgflow.check_replay_async(app)
    assert report.ok and report.passed == [handle.id]
