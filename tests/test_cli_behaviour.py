"""The command line behaves: every command takes ``--app``; ``workflows show`` lists the children and so
every journal position; a stream name that is not there, an attribute that is no App, a port that is
taken are each one line on stderr and a non-zero exit; a reader that goes away (``| head``) ends the
command quietly; colour only on a terminal, and never under ``NO_COLOR``. Each run as a real process."""

from __future__ import annotations

import os
import pty
import signal
import socket
import subprocess
import sys
from pathlib import Path

import anyio
import msgspec
import pytest

import pgflow

from .helpers import ONE_SERVER
from .processes import Processes, wait_until

WAIT = 60.0
PROBED = "tests.apps.probed:app"
ROOT = Path(__file__).resolve().parent.parent


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pgflow", *args], env=env, capture_output=True, text=True,
                          timeout=WAIT)


async def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return await anyio.to_thread.run_sync(lambda: cli(env, *args))


def one_error_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The single line a refused command prints: no traceback, no usage text, nothing on stdout."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pgflow: error: "), result.stderr
    assert result.stdout == ""
    return lines[0]


# -- --app, everywhere ----------------------------------------------------------------------------------


@ONE_SERVER  # argument parsing: the same on any server
def test_every_command_takes_app_and_the_positional_forms_stay(procs: Processes, worker_env: dict[str, str]) -> None:
    for form in (["--app", PROBED], [PROBED]):
        migrated = cli(worker_env, "migrate", *form)
        assert migrated.returncode == 0 and "is at version" in migrated.stdout, migrated.stderr
    worker = procs.start("worker", ["-m", "pgflow", "worker", "--app", PROBED, "--lease", "2"], worker_env)

    def registered() -> bool:
        listed = cli(worker_env, "workers", "--json", "--app", PROBED)
        assert listed.returncode == 0, listed.stderr
        return len(msgspec.json.decode(listed.stdout)) == 1

    wait_until(registered, "the worker started with --app to register", procs, worker)
    for form in (["--app", PROBED], [PROBED]):
        status = cli(worker_env, "status", *form)
        assert status.returncode == 0 and status.stdout.startswith("healthy"), (status.stdout, status.stderr)
    for command in (["queues"], ["workflows", "ls"], ["psql", "--print"], ["prune", "--older-than", "7d"]):
        result = cli(worker_env, *command, "--app", PROBED)
        assert result.returncode == 0, (command, result.stderr)
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit() == 0, worker.describe()

    both = one_error_line(cli(worker_env, "worker", "--app", PROBED, "tests.apps.canvases:app"), 2)
    assert "two Apps named" in both
    assert "--app module:app" in one_error_line(cli(worker_env, "worker"), 2)


@ONE_SERVER  # refused before anything connects: the same on any server
@pytest.mark.parametrize(("target", "words"), [
    ("tests.apps.probed:nope", ["module 'tests.apps.probed' has no attribute 'nope'", PROBED]),
    ("tests.apps.probed:block", ["tests.apps.probed.block", "is a Workflow, not a pgflow.App", PROBED]),
    ("json:dumps", ["json.dumps", "is a function, not a pgflow.App", "holds no pgflow.App"]),
])
def test_a_target_that_is_no_app_is_one_line_naming_module_attribute_and_what_was_found(
        worker_env: dict[str, str], target: str, words: list[str]) -> None:
    for form in (["--app", target], [target]):
        line = one_error_line(cli(worker_env, "worker", *form), 2)
        assert all(w in line for w in words), line
        assert "NoneType" not in line


# -- workflows show: the children, and every position ------------------------------------------------------


@pytest.mark.anyio
async def test_show_lists_the_children_at_the_positions_they_took(app: pgflow.App,
                                                                  worker_env: dict[str, str]) -> None:
    @app.step(name="kin.note")
    async def note(x: int) -> int:
        return x

    @app.workflow(name="kin.leaf")
    async def leaf(x: int) -> int:
        return x * 10

    @app.workflow(name="kin.parent")
    async def parent() -> int:
        first = await note(1)
        many = await leaf.start_many_async([(1,), (2,)])
        one = await leaf.start_async(3)
        own = await leaf.with_options(id=f"{pgflow.workflow_id()}-own").start_async(4)
        results = [await h.result_async() for h in [*many, one, own]]
        return await note(first + sum(results))

    handle = await parent.start_async()
    async with app.worker(concurrency=8):
        with anyio.fail_after(WAIT):
            assert await handle.result_async() == 101

    shown = await run_cli(worker_env, "workflows", "show", handle.id, "--json")
    assert shown.returncode == 0, shown.stderr
    data = msgspec.json.decode(shown.stdout)
    children = data["children"]
    assert [(c["id"], c["position"], c["index"], c["name"], c["status"]) for c in children] == [
        (f"{handle.id}.1.0", 1, 0, "kin.leaf", "succeeded"), (f"{handle.id}.1.1", 1, 1, "kin.leaf", "succeeded"),
        (f"{handle.id}.2", 2, None, "kin.leaf", "succeeded"), (f"{handle.id}-own", None, None, "kin.leaf", "succeeded"),
    ]
    assert data["children_total"] == 4
    steps = {s["position"] for s in data["steps"]}
    positions = steps | {c["position"] for c in children if c["position"] is not None}
    assert 0 in steps and positions == set(range(data["journal_positions"]))  # no position unaccounted for
    assert not steps & {1, 2}  # (a child's start writes no step record)

    text = await run_cli(worker_env, "workflows", "show", handle.id)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    header = next(n for n, line in enumerate(lines) if line.startswith("POSITION"))
    rows = [line.split() for line in lines[header + 1:header + 1 + len(data["steps"]) + 4]]
    assert [r[0] for r in rows] == sorted([str(s) for s in steps] + ["1", "1", "2"], key=int) + ["-"]
    for child in children:
        assert f"child {child['id']}: succeeded" in text.stdout
    assert f"journal positions 0 to {data['journal_positions'] - 1}" in text.stdout

    fewer = await run_cli(worker_env, "workflows", "show", handle.id, "--children", "2", "--json")
    assert [c["index"] for c in msgspec.json.decode(fewer.stdout)["children"]] == [0, 1]
    cut = await run_cli(worker_env, "workflows", "show", handle.id, "--children", "2")
    assert "(the first 2 of 4 children: --children N shows more)" in cut.stdout


# -- tail: a stream that is not there ------------------------------------------------------------------------


@ONE_SERVER  # the command's error lines: the same on any server
@pytest.mark.anyio
async def test_tail_of_a_stream_that_is_not_there_is_one_line_and_a_failure(app: pgflow.App,
                                                                            worker_env: dict[str, str]) -> None:
    @app.workflow(name="tails.writer")
    async def writer() -> None:
        for n in range(3):
            await pgflow.write_stream_async("numbers", n)
        await pgflow.close_stream_async("numbers")

    @app.workflow(name="tails.silent")
    async def silent() -> None:
        return None

    wrote, quiet = await writer.start_async(), await silent.start_async()
    async with app.worker(concurrency=2):
        with anyio.fail_after(WAIT):
            await wrote.result_async()
            await quiet.result_async()

    line = one_error_line(await run_cli(worker_env, "tail", wrote.id, "numbrs"), 1)
    assert f"workflow {wrote.id!r} (succeeded) has no stream 'numbrs'; its streams: 'numbers'" in line
    line = one_error_line(await run_cli(worker_env, "tail", quiet.id, "numbers", "--json"), 1)
    assert "has no stream 'numbers'; it wrote no stream" in line
    assert "no workflow with id 'no-such-id'" in one_error_line(await run_cli(worker_env, "tail", "no-such-id", "k"), 1)

    right = await run_cli(worker_env, "tail", wrote.id, "numbers")
    assert (right.returncode, right.stdout, right.stderr) == (0, "0\t0\n1\t1\n2\t2\n", "")
    past = await run_cli(worker_env, "tail", wrote.id, "numbers", "--offset", "9")  # there, just nothing left
    assert (past.returncode, past.stdout, past.stderr) == (0, "", "")


# -- a reader that goes away ---------------------------------------------------------------------------------


@ONE_SERVER  # a closed pipe is the process's matter: the same on any server
@pytest.mark.anyio
async def test_output_into_a_closed_pipe_ends_quietly(app: pgflow.App, worker_env: dict[str, str]) -> None:
    @app.workflow(name="piped.many")
    async def many(n: int) -> None:
        for i in range(n):
            await pgflow.write_stream_async("lines", f"line {i}")

    done = await many.start_async(200)
    async with app.worker(concurrency=2):
        with anyio.fail_after(WAIT):
            await done.result_async()
    await many.start_many_async([(n,) for n in range(50)])  # queued: rows to list

    def into_closed_pipe(*args: str) -> tuple[int, str]:
        process = subprocess.Popen([sys.executable, "-m", "pgflow", *args], env=worker_env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert process.stdout is not None
        process.stdout.close()  # before it writes a byte: every write meets a pipe nobody reads
        _, errors = process.communicate(timeout=WAIT)
        return process.returncode, errors

    for command in (["workflows", "ls"], ["workflows", "ls", "--json"], ["workflows", "show", done.id],
                    ["tail", done.id, "lines"], ["queues"]):
        code, errors = await anyio.to_thread.run_sync(lambda c=command: into_closed_pipe(*c))  # type: ignore[misc]
        assert (code, errors) in ((0, ""), (141, "")), (command, code, errors)


# -- the dashboard on a port that is taken ---------------------------------------------------------------------


@ONE_SERVER  # a port already taken: the same on any server
def test_the_dashboard_on_a_busy_port_says_so_before_any_url(worker_env: dict[str, str]) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        line = one_error_line(cli(worker_env, "dashboard", "--port", str(port)), 2)
    assert f"cannot listen on 127.0.0.1:{port}" in line and "--port" in line


# -- colour -------------------------------------------------------------------------------------------------


def styled_output(env: dict[str, str], on_a_terminal: bool) -> str:
    """What ``styled`` gives in a process whose stdout is a terminal (a pty) or a pipe."""
    code = "from pgflow.terminal import styled; print(styled('[demo] hello', '2'))"
    if not on_a_terminal:
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=WAIT, check=True).stdout
    leader, follower = pty.openpty()
    try:
        subprocess.run([sys.executable, "-c", code], env=env, stdout=follower, timeout=WAIT, check=True)
        return os.read(leader, 4096).decode()
    finally:
        os.close(leader)
        os.close(follower)


def test_colour_only_on_a_terminal_and_never_under_no_color() -> None:
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    assert "\x1b[2m[demo] hello\x1b[0m" in styled_output(env, on_a_terminal=True)
    assert styled_output(env, on_a_terminal=False) == "[demo] hello\n"
    assert "\x1b" not in styled_output({**env, "NO_COLOR": "1"}, on_a_terminal=True)
    assert "\x1b" in styled_output({**env, "NO_COLOR": ""}, on_a_terminal=True)  # empty: not set (no-color.org)


@ONE_SERVER  # the demo's output to a pipe: the same on any server
@pytest.mark.slow
def test_the_demo_writes_no_colour_codes_into_a_pipe(worker_env: dict[str, str], tmp_path: Path) -> None:
    env = {k: v for k, v in worker_env.items() if k != "NO_COLOR"}
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py")], env=env, capture_output=True,
                            text=True, timeout=180, cwd=tmp_path)
    assert result.returncode == 0, (result.stdout, result.stderr)
    assert "[demo] schema at version" in result.stdout
    assert "\x1b" not in result.stdout, result.stdout
