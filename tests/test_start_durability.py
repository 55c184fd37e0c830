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


async def found_after_a_crash(server: EmbeddedServer, schema: str) -> set[str]:
    """Crash the server at once (no shutdown checkpoint: crash recovery on start), then the ids of the
    workflows ``schema`` holds."""
    await anyio.to_thread.run_sync(lambda: server.restart("immediate"))
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        return {row[0] for row in conn.execute(f'SELECT id FROM "{schema}".workflows')}


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
        assert await found_after_a_crash(slow_wal_writer, schema) == set(ids)
    finally:
        await app.close_async()
        with psycopg.connect(slow_wal_writer.dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def test_a_role_that_may_not_send_the_message_starts_in_one_durable_commit(
    slow_wal_writer: EmbeddedServer,
) -> None:
    """A server may have revoked the logical decoding message from PUBLIC: its roles' starts then
    commit durably in one statement, and work and survive a crash as well."""
    role, schema = f"starter_{uuid.uuid4().hex[:8]}", f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(slow_wal_writer.dsn, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{role}" LOGIN')
        conn.execute(f'GRANT CREATE ON DATABASE postgres TO "{role}"')
        messages = [str(row[0]) for row in conn.execute(  # (PostgreSQL 17 gave it a fourth argument)
            "SELECT oid::regprocedure FROM pg_proc WHERE proname = 'pg_logical_emit_message'")]
        for message in messages:
            conn.execute(f"REVOKE EXECUTE ON FUNCTION {message} FROM PUBLIC")
    dsn = psycopg.conninfo.make_conninfo(slow_wal_writer.dsn, user=role)
    app = pgflow.App(dsn, schema=schema)
    noop = app.workflow(name="durable.noop")(_noop)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("SELECT pg_logical_emit_message(true, 'pgflow', '')")
        await app.migrate_async()
        ids = [(await noop.start_async()).id for _ in range(3)]
        assert await found_after_a_crash(slow_wal_writer, schema) == set(ids)
    finally:
        await app.close_async()
        with psycopg.connect(slow_wal_writer.dsn, autocommit=True) as conn:
            for message in messages:
                conn.execute(f"GRANT EXECUTE ON FUNCTION {message} TO PUBLIC")
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            conn.execute(f'REVOKE CREATE ON DATABASE postgres FROM "{role}"')
            conn.execute(f'DROP ROLE "{role}"')


async def _noop() -> None:
    return None
