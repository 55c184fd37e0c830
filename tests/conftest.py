"""Fixtures: every test runs against real PostgreSQL servers, each test in a schema of its own.

The suite runs once against an embedded PostgreSQL 18 started for the session in a temporary
directory, and once against the PostgreSQL 15 at 127.0.0.1:5432 when one answers there, in a database
made for the session (servers.session_database).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

import pgflow

from .processes import procs  # noqa: F401 - the fixture, for every multi-process test
from .servers import EmbeddedServer, external_pg15_dsn, session_database, started_embedded

_embedded: EmbeddedServer | None = None


def pytest_configure(config: pytest.Config) -> None:
    # Registered here, beside the fixtures, rather than in pyproject.toml's list of markers.
    config.addinivalue_line("markers", "chaos: a long fault-suite case, run by `make chaos` and left out of"
                                       " `make test` (which keeps a quick case of every fault)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``PGFLOW_TEST_SERVER=pg15`` keeps the tests on PostgreSQL 15 and those that use no server (pure Python,
    processes of their own), ``pg18`` the tests on the embedded server: ``make test`` runs the two halves side
    by side, as two sessions, since the suite mostly waits (on leases, sleeps, processes) rather than
    computes. The tests that use no server go with PostgreSQL 15's because the embedded server's half is the
    longer: it alone holds the tests that restart their server and those whose subject does not depend on
    the server's version (tests/helpers.py ONE_SERVER)."""
    half = os.environ.get("PGFLOW_TEST_SERVER")
    if not half:
        return
    if half not in ("pg15", "pg18"):
        raise pytest.UsageError(f"PGFLOW_TEST_SERVER is pg15 or pg18, not {half!r}")

    def in_the_pg15_half(item: pytest.Item) -> bool:
        callspec = getattr(item, "callspec", None)
        server = callspec.params.get("server") if callspec is not None else None
        return server != "pg18"

    kept = [item for item in items if in_the_pg15_half(item) == (half == "pg15")]
    config.hook.pytest_deselected(items=[item for item in items if in_the_pg15_half(item) != (half == "pg15")])
    items[:] = kept


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


@pytest.fixture
def schema(dsn: str) -> Iterator[str]:
    """A fresh schema name, dropped after the test."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield name
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


@pytest.fixture
def app(dsn: str, schema: str) -> Iterator[pgflow.App]:
    with pgflow.App(dsn, schema=schema, poll_interval=0.5) as app:  # closed after the test
        yield app


@pytest.fixture
def second_app(dsn: str, schema: str) -> Iterator[pgflow.App]:
    """Another App on the same schema: its runtime reaches ``app``'s through the server, as another
    process would (its pings are not this App's own)."""
    with pgflow.App(dsn, schema=schema, poll_interval=0.5) as other:
        yield other


@pytest.fixture
def worker_env(dsn: str, schema: str) -> dict[str, str]:
    """The environment a worker process needs to serve this test's schema."""
    root = Path(__file__).resolve().parent.parent
    return {**os.environ, "PGFLOW_DSN": dsn, "PGFLOW_SCHEMA": schema,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
