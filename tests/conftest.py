"""Fixtures: every test runs against real PostgreSQL servers, each test in a schema of its own.

The suite runs once against an embedded PostgreSQL 18 started for the session in a temporary
directory, and once against the PostgreSQL 15 at 127.0.0.1:5432 when one answers there, in a database
made for the session (servers.session_database).
"""

from __future__ import annotations

import inspect
import os
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psycopg
import pytest

import pgflow

from .processes import procs  # noqa: F401 - the fixture, for every multi-process test
from .recycling import SchemaPool
from .servers import EmbeddedServer, external_pg15_dsn, session_database, started_embedded

_embedded: EmbeddedServer | None = None


def pytest_configure(config: pytest.Config) -> None:
    # Registered here, beside the fixtures, rather than in pyproject.toml's list of markers.
    config.addinivalue_line("markers", "chaos: a long fault-suite case, run by `make chaos` and left out of"
                                       " `make test` (which keeps a quick case of every fault)")
    config.addinivalue_line("markers", "new_schema: the schema fixture names a schema no one made yet, instead of"
                                       " a migrated one (tests/recycling.py)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``PGFLOW_TEST_SERVER=pg15`` keeps the tests on PostgreSQL 15, ``pg18`` the others: those on the embedded
    server and those that use no server (pure Python, processes of their own). ``make test`` runs them as
    sessions side by side, since the suite mostly waits (on leases, sleeps, processes) rather than computes:
    the PostgreSQL 15 one, and the rest cut into shards by ``PGFLOW_TEST_SHARD=k/n`` (shard k of n, from 1),
    each a session with an embedded server of its own. PostgreSQL 15 is one session only, its connections
    being few (max_connections 100). The tests that use no server go with the embedded server's, which
    can be cut into as many shards as the machine takes; it alone holds the tests that restart their
    server and those whose subject does not depend on the server's version (tests/helpers.py ONE_SERVER).

    A test's shard is its place among the session's tests, in the order of collection, modulo n: the
    variants of one test, which cost about the same, are dealt out in turn, and the shards together hold
    each test once."""
    half = os.environ.get("PGFLOW_TEST_SERVER")
    shard = os.environ.get("PGFLOW_TEST_SHARD")
    if not half:
        if shard:
            raise pytest.UsageError("PGFLOW_TEST_SHARD cuts the tests of PGFLOW_TEST_SERVER=pg18: set it too")
        return
    if half not in ("pg15", "pg18"):
        raise pytest.UsageError(f"PGFLOW_TEST_SERVER is pg15 or pg18, not {half!r}")

    def on_pg15(item: pytest.Item) -> bool:
        callspec = getattr(item, "callspec", None)
        return callspec is not None and callspec.params.get("server") == "pg15"

    kept = [item for item in items if on_pg15(item) == (half == "pg15")]
    if shard:
        index, count = _shard(shard, half)
        kept = [item for place, item in enumerate(kept) if place % count == index - 1]
    chosen = set(map(id, kept))
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in chosen])
    items[:] = kept


def _shard(text: str, half: str) -> tuple[int, int]:
    """``k/n`` as (k, n), 1 <= k <= n."""
    match = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if half != "pg18" or match is None or not 1 <= int(match[1]) <= int(match[2]):
        raise pytest.UsageError(f"PGFLOW_TEST_SHARD is k/n (1 <= k <= n) and cuts PGFLOW_TEST_SERVER=pg18's tests,"
                                f" not {text!r} of {half}'s")
    return int(match[1]), int(match[2])


def pytest_report_header(config: pytest.Config) -> list[str]:
    dsn = external_pg15_dsn()
    if dsn is None:
        return ["servers: embedded PostgreSQL 18 only (no PostgreSQL 15 answers at 127.0.0.1:5432; "
                "its tests are skipped)"]
    return [f"servers: embedded PostgreSQL 18 and PostgreSQL 15 at {dsn}"]


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def embedded_server() -> Iterator[EmbeddedServer]:
    # Not under pytest's temporary directory, which another session may reset to 0700 (started_embedded).
    with started_embedded("pgflow-tests-pg18-") as server:
        yield server


@pytest.fixture(scope="session")
def pg15_database() -> Iterator[str | None]:
    """The DSN of a database of this session's own on the machine's PostgreSQL 15 (servers.session_database
    says why), or None when no PostgreSQL 15 answers."""
    dsn = external_pg15_dsn()
    if dsn is None:
        yield None
        return
    with session_database(dsn) as own:
        yield own


@pytest.fixture(scope="session", params=["pg18", "pg15"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[str, EmbeddedServer | None]]:
    """(dsn, the EmbeddedServer when it is the embedded one, so fault tests can restart it)."""
    if request.param == "pg18":
        embedded: EmbeddedServer = request.getfixturevalue("embedded_server")
        yield embedded.dsn, embedded
    else:
        dsn = request.getfixturevalue("pg15_database")
        if dsn is None:
            pytest.skip("no PostgreSQL 15 answers at 127.0.0.1:5432")
        yield dsn, None


@pytest.fixture
def dsn(server: tuple[str, EmbeddedServer | None]) -> str:
    return server[0]


@pytest.fixture
def restartable(server: tuple[str, EmbeddedServer | None]) -> EmbeddedServer:
    """The server of a test that restarts it (``dsn`` is its address): the embedded one. The test is
    skipped on PostgreSQL 15, which the tests cannot restart."""
    if server[1] is None:
        pytest.skip("only the embedded server can be restarted by the tests")
    return server[1]


_pools: dict[str, SchemaPool] = {}  # the schema_pools fixture's, for the summary


@pytest.fixture(scope="session")
def schema_pools() -> Iterator[dict[str, SchemaPool]]:
    """The pools of migrated schemas (tests/recycling.py), one per server; what they hold is dropped at
    the end of the session."""
    yield _pools
    for pool in _pools.values():
        pool.drop_all()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for pool in _pools.values():
        terminalreporter.write_line(f"schema fixture: {pool.made} schemas migrated, {pool.reused} used again after"
                                    f" a reset, {pool.discarded} not used again")


@pytest.fixture
def schema(request: pytest.FixtureRequest, dsn: str, schema_pools: dict[str, SchemaPool]) -> Iterator[str]:
    """The name of a migrated schema of the test's own, with no rows but those the migration writes: one
    an earlier test used, reset to be as a fresh one (tests/recycling.py), or a new one. Marked
    ``new_schema``, a test gets a name no schema has yet instead (its subject is how one is made), and the
    schema is dropped after it."""
    if request.node.get_closest_marker("new_schema") is None:
        pool = schema_pools.setdefault(dsn, SchemaPool(dsn))
        name = pool.take()
        yield name
        pool.give_back(name)
        return
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield name
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def _on_a_loop(request: pytest.FixtureRequest) -> bool:
    """Whether the test is an ``async def`` that anyio runs on an event loop."""
    return inspect.iscoroutinefunction(request.function) and request.node.get_closest_marker("anyio") is not None


@pytest.fixture
def app(request: pytest.FixtureRequest, dsn: str, schema: str) -> Iterator[pgflow.App]:
    """An App on the test's schema, closed after the test: an async test's on the test's own event loop
    (``_app_on_the_loop``), where its pool, listener and tasks live, before that loop ends."""
    if _on_a_loop(request):
        yield request.getfixturevalue("_app_on_the_loop")
        return
    with pgflow.App(dsn, schema=schema, poll_interval=0.5) as app:
        yield app


@pytest.fixture
def second_app(request: pytest.FixtureRequest, dsn: str, schema: str) -> Iterator[pgflow.App]:
    """Another App on the same schema: its runtime reaches ``app``'s through the server, as another
    process would (its pings are not this App's own)."""
    if _on_a_loop(request):
        yield request.getfixturevalue("_second_app_on_the_loop")
        return
    with pgflow.App(dsn, schema=schema, poll_interval=0.5) as other:
        yield other


@pytest.fixture
async def _app_on_the_loop(dsn: str, schema: str) -> AsyncIterator[pgflow.App]:
    """``app`` of an async test: set up, used and closed on the test's event loop (anyio's runner lives
    from this fixture's setup to its teardown, the test's call in between)."""
    async with pgflow.App(dsn, schema=schema, poll_interval=0.5) as app:
        yield app


@pytest.fixture
async def _second_app_on_the_loop(dsn: str, schema: str) -> AsyncIterator[pgflow.App]:
    async with pgflow.App(dsn, schema=schema, poll_interval=0.5) as other:
        yield other


@pytest.fixture
def worker_env(dsn: str, schema: str) -> dict[str, str]:
    """The environment a worker process needs to serve this test's schema."""
    root = Path(__file__).resolve().parent.parent
    return {**os.environ, "PGFLOW_DSN": dsn, "PGFLOW_SCHEMA": schema,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
