"""A start that is alone on its store commits without waiting for the disk, so that workers see it (and
hear its ping) a disk flush sooner, and a second commit in the same round trip waits for the disk before
the caller hears of the start. So a server that crashes the moment ``start`` has returned still has
the workflow, though an asynchronous commit on its own would have been lost."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import anyio
import psycopg
import pytest

import pgflow

from .servers import EmbeddedServer, started_embedded

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def slow_wal_writer() -> Iterator[EmbeddedServer]:
    # What an asynchronous commit leaves in the server's WAL buffers the WAL writer writes out every
    # wal_writer_delay (10 s at most); nothing else writes it out here, no other session committing.
    settings = "wal_writer_delay = 10000ms\nwal_writer_flush_after = 1GB"
    with started_embedded("pgflow-tests-durable-", settings) as server:
        yield server


def crashed_after_lazy_commit(server: EmbeddedServer) -> bool:
    """Commit a row without waiting for the disk, crash the server at once: whether the row was lost
    (what the test's crash does to a commit nothing flushed)."""
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS lazy (id text)")
        conn.execute("SET synchronous_commit = off")
        conn.execute("INSERT INTO lazy VALUES ('control')")
    server.restart("immediate")
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        lost = conn.execute("SELECT count(*) FROM lazy").fetchone() == (0,)
        conn.execute("DROP TABLE lazy")
    return lost


@pytest.mark.parametrize("api", ["sync", "async"])
async def test_a_started_workflow_survives_a_crash_right_after_its_start(
    slow_wal_writer: EmbeddedServer, api: str,
) -> None:
    # The crash loses an asynchronous commit that nothing flushed (three tries: the WAL writer may
    # wake within the moment between a commit and the crash, once in thousands).
    assert any(crashed_after_lazy_commit(slow_wal_writer) for _ in range(3))
    schema = f"t_{uuid.uuid4().hex[:12]}"
    app = pgflow.App(slow_wal_writer.dsn, schema=schema)
    noop = app.workflow(name="durable.noop")(_noop)
    try:
        await app.migrate_async()
        if api == "sync":
            ids = await anyio.to_thread.run_sync(lambda: [noop.start().id for _ in range(5)])
        else:
            ids = [(await noop.start_async()).id for _ in range(5)]
        await anyio.to_thread.run_sync(lambda: slow_wal_writer.restart("immediate"))
        with psycopg.connect(slow_wal_writer.dsn, autocommit=True) as conn:
            found = {row[0] for row in conn.execute(f'SELECT id FROM "{schema}".workflows')}
        assert found == set(ids)
    finally:
        await app.close_async()
        with psycopg.connect(slow_wal_writer.dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def _noop() -> None:
    return None
