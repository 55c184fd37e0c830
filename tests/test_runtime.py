"""The runtime's shape: one runtime per event loop, sync twins on a private loop, a LISTEN connection
only while something waits, maintenance services on one elected worker, no import cycle, and the
step called without ``await``."""

from __future__ import annotations

import ast
import signal
import threading
import warnings
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import pytest

import pgflow

from .apps import runtime_app
from .helpers import ONE_SERVER, query
from .processes import Processes, wait_until

pytestmark = pytest.mark.anyio

PACKAGE = Path(pgflow.__file__).parent
WAIT = 60.0


# -- no thread, no hop --------------------------------------------------------------------------------------


@ONE_SERVER  # the caller's threads: the same on any server
@pytest.mark.slow
def test_an_async_caller_process_starts_reads_and_waits_with_no_thread_of_pgflows(
    worker_env: dict[str, str], procs: Processes,
) -> None:
    worker = procs.worker("worker", "tests.apps.runtime_app:app", worker_env)
    caller = procs.start("caller", ["-m", "tests.apps.runtime_caller", "3"], worker_env)
    assert caller.wait_exit(timeout=WAIT) == 0, procs.logs()
    assert worker.alive(), procs.logs()
    report = msgspec.json.decode(caller.output().strip().splitlines()[-1])
    assert report["results"] == [50, 50, 50]
    assert report["chunks"] == [[f"t{i}" for i in range(50)]] * 3
    # The caller's whole life, sampled at every chunk it read: the main thread alone.
    assert report["threads"] == ["MainThread"], report["threads"]
    assert (report["runtimes"], report["listeners"]) == (1, 1)


@ONE_SERVER  # the sync API's threads and loop: the same on any server
async def test_the_sync_api_works_from_plain_threads_and_from_an_event_loops_worker_threads(
    app: pgflow.App,
) -> None:
    tokens = runtime_app.build(app)
    outcomes: dict[str, Any] = {}

    def use_sync_api(who: str) -> None:
        handle = tokens.start(7)
        outcomes[who] = (handle.result(timeout=WAIT), list(handle.stream("tokens")), handle.status())

    async with app.worker(concurrency=4):
        await anyio.to_thread.run_sync(use_sync_api, "loop worker thread")
        plain = threading.Thread(target=use_sync_api, args=("plain thread",))
        plain.start()
        await anyio.to_thread.run_sync(plain.join)
        # An async call here runs on this loop's runtime, beside the sync callers' private one.
        outcomes["async"] = (await (await tokens.start_async(7)).result_async(timeout=WAIT),)
    expected = (7, [f"t{i}" for i in range(7)], "succeeded")
    assert outcomes == {"loop worker thread": expected, "plain thread": expected, "async": (7,)}
    assert app.stats().runtimes == 2  # this loop's and the private loop of the sync callers


@ONE_SERVER  # a signal to the caller's process: the same on any server
@pytest.mark.slow
@pytest.mark.parametrize("blocked_in", ["result", "stream"])
def test_ctrl_c_in_a_sync_caller_blocked_on_a_workflow_ends_the_process_at_once(
    worker_env: dict[str, str], procs: Processes, blocked_in: str,
) -> None:
    caller = procs.start("caller", ["-m", "tests.apps.blocked_caller", blocked_in], worker_env)
    wait_until(lambda: "blocking" in caller.output(), "the caller to block", procs, caller)
    caller.signal(signal.SIGINT)
    code = caller.wait_exit(timeout=15)
    assert code != 0 and "KeyboardInterrupt" in caller.output(), procs.logs()


# -- the LISTEN connection ----------------------------------------------------------------------------------


async def on_the_server(dsn: str, backend: int) -> bool:
    return bool(await query(dsn, "SELECT 1 FROM pg_stat_activity WHERE pid = %s", backend))


async def test_a_listen_connection_is_open_only_while_something_waits(dsn: str, schema: str) -> None:
    # The App's own listener is told apart by its server process id: other Apps of this process (earlier
    # tests') may have one of the same application name.
    async with pgflow.App(dsn, schema=schema, listen_idle=0.3) as app:
        tokens = runtime_app.build(app)
        handle = await tokens.start_async(3)  # starting workflows waits for nothing
        assert (app.stats().listeners_connected, app.stats().listener_backends) == (0, ())
        async with app.worker(concurrency=2):  # a worker waits for work: it listens
            await wait_until_async(lambda: app.stats().listeners_connected == 1, "the worker's listener")
            assert await handle.result_async(timeout=WAIT) == 3
            [backend] = app.stats().listener_backends
            assert await on_the_server(dsn, backend)
        # Nothing waits any more: the connection goes after listen_idle, on the server too.
        await wait_until_async(lambda: app.stats().listeners_connected == 0, "the listener to close")
        assert app.stats().listener_backends == ()
        with anyio.fail_after(WAIT):
            while await on_the_server(dsn, backend):  # its backend leaves a moment after the client closes
                await anyio.sleep(0.02)
        # ... and comes back for the next wait.
        async with app.worker(concurrency=2):
            assert await (await tokens.start_async(2)).result_async(timeout=WAIT) == 2
            assert app.stats().listeners_connected == 1


async def wait_until_async(condition: Any, what: str) -> None:
    with anyio.fail_after(WAIT, shield=False):
        while not condition():
            await anyio.sleep(0.02)


# -- maintenance services -----------------------------------------------------------------------------------


async def test_each_maintenance_service_runs_on_one_worker_and_moves_when_it_stops(
    dsn: str, schema: str,
) -> None:
    async with pgflow.App(dsn, schema=schema) as app:

        @app.workflow(schedule="0 0 1 1 *")
        async def yearly() -> None: ...

        every_service = {"reaper", "retention", "partitions", "names", "keys", f"cron:{yearly.name}"}
        first = app.worker(lease=0.5)
        async with first:
            await wait_until_async(lambda: first.leading == every_service,
                                   "the first worker to lead")
            async with app.worker(lease=0.5) as second:
                await anyio.sleep(1.5)  # three election rounds: the second worker wins nothing
                assert second.leading == set() and first.leading == every_service
                await first.stop(0)
                await wait_until_async(lambda: second.leading == every_service,
                                       "the second worker to take over")


# -- the step called without await ---------------------------------------------------------------------------


@ONE_SERVER  # a misuse found in Python: the same on any server
async def test_a_step_called_without_await_fails_its_workflow_clearly_and_takes_no_position(
    app: pgflow.App,
) -> None:
    ran: list[str] = []

    @app.step
    async def forgotten(x: int) -> int:
        ran.append("forgotten")
        return x

    @app.step
    def recorded(x: int) -> int:
        ran.append("recorded")
        return x

    @app.workflow
    async def careless() -> int:
        forgotten(1)  # no await
        return await recorded(2)

    with _no_warning():
        async with app.worker(concurrency=1):
            handle = await careless.start_async()
            with pytest.raises(pgflow.WorkflowFailed) as failed:
                await handle.result_async(timeout=WAIT)
    assert failed.value.error_type == "TypeError"
    assert f"called step {forgotten.name!r} without await" in failed.value.message
    assert ran == ["recorded"]
    assert [(s.position, s.name) for s in await handle.steps_async()] == [(0, recorded.name)]


class _no_warning:
    """No "coroutine was never awaited" RuntimeWarning on top of the error."""

    def __enter__(self) -> None:
        self._catcher = warnings.catch_warnings(record=True)
        self.caught = self._catcher.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc: object) -> None:
        self._catcher.__exit__(*exc)
        assert not [w for w in self.caught if "never awaited" in str(w.message)]


# -- the package's shape ------------------------------------------------------------------------------------


def module_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Every pgflow module ``path`` imports, anywhere in it (TYPE_CHECKING blocks and functions too)."""
    name = module_of(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("pgflow"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base.startswith("pgflow"):
                # `from .. import codec` imports the module pgflow.codec; `from ..app import App`, pgflow.app.
                for alias in node.names:
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return found


def test_the_package_has_no_import_cycle() -> None:
    modules = {module_of(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: {m for m in imports_of(path, set(modules)) if m in modules and m != name}
             for name, path in modules.items()}
    # The package's own __init__ re-exports everything; nothing inside may import it back.
    importers_of_root = sorted(name for name, deps in graph.items() if "pgflow" in deps and name != "pgflow")
    assert importers_of_root == [], importers_of_root

    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        stack.append(name)
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                pytest.fail("import cycle: " + " -> ".join([*stack[stack.index(dep):], dep]))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_no_module_is_over_about_400_lines() -> None:
    sizes = {module_of(p): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 400} == {}


def test_no_function_is_over_60_lines() -> None:
    """A function a newcomer reads in one screen: longer ones are split into named pieces."""
    long: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
                size = node.end_lineno - node.lineno + 1
                if size > 60:
                    long[f"{module_of(path)}.{node.name}"] = size
    assert long == {}


async def test_a_close_on_the_loop_leaves_a_closing_that_close_async_awaits(dsn: str, schema: str) -> None:
    """``App.close()`` called on a running loop cannot wait for that loop's runtime: its closing is a
    task the App holds, and ``close_async`` on the loop waits for it (no closing fired and forgotten)."""
    app = pgflow.App(dsn=dsn, schema=schema)
    await app.migrate_async()  # opens this loop's runtime and its pool
    pool = (await app._runtimes.current().store()).pool
    app.close()  # on the running loop: it cannot wait here
    assert not pool.closed
    await app.close_async()
    assert pool.closed
