"""What many test modules share: a look at the tables from outside pgflow, the common shapes of a value,
and the ways a test runs a workflow to its end. One copy each, so a change to how tests read the tables
is made once (the multi-process harness is tests/processes.py)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import msgspec
import psycopg
import pytest

import pgflow

TIMEOUT = 30.0  # seconds a test waits for a workflow an in-process worker runs
KINDS = ["async", "sync"]  # the twins: a workflow or step as an ``async def`` and as a ``def``

# The server of a test whose subject does not depend on the server's version (the command line's or the
# dashboard's text and HTTP answers, the docs, checks made in Python before any statement): the embedded
# PostgreSQL 18 only, where every other test runs on PostgreSQL 15 too. Each use says in a comment why; the
# statements such a test goes through are tested on both servers by the tests of the API they serve.
ONE_SERVER = pytest.mark.parametrize("server", ["pg18"], indirect=True)


class Point(msgspec.Struct):
    """A typed value, to check what goes through the codec comes back as the same type."""

    x: int
    y: int


# -- the tables, from outside pgflow ------------------------------------------------------------------------


async def query(dsn: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    """Run one statement on a connection of its own (autocommit); the rows, or [] for none."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(sql, params)
        return await cur.fetchall() if cur.description else []


def query_sync(dsn: str, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
    """``query`` for the tests that drive worker processes from plain functions. It rides out a server
    that has no connection slot free for a while (the PostgreSQL 15 may be shared)."""
    deadline = time.monotonic() + 30.0
    while True:
        try:
            conn = psycopg.connect(dsn, autocommit=True)
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            continue
        with conn:
            cur = conn.execute(sql, params)
            return cur.fetchall() if cur.description is not None else []


async def requeue(dsn: str, schema: str, workflow_id: str) -> None:
    """Make a finished workflow run again from its journal, as a worker crash would."""
    rows = await query(
        dsn,
        f"UPDATE {schema}.workflows SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL,"
        " output = NULL, error = NULL, finished_at = NULL WHERE id = %s RETURNING id",
        workflow_id,
    )
    assert rows == [(workflow_id,)]


async def step_rows(dsn: str, schema: str, workflow_id: str) -> list[tuple[Any, ...]]:
    """(position, name, attempts, error type, error message, has output) of each recorded step."""
    return await query(
        dsn,
        f"SELECT position, name, attempts, error->>'type', error->>'message', output IS NOT NULL"
        f" FROM {schema}.steps WHERE workflow_id = %s ORDER BY position",
        workflow_id,
    )


def registered(dsn: str, schema: str) -> list[tuple[str, str, int, list[str], str]]:
    """The rows of the worker registry: (id, host, pid, queues, version)."""
    return [(r[0], r[1], r[2], list(r[3]), r[4]) for r in query_sync(
        dsn, f'SELECT id, host, pid, queues, version FROM "{schema}".workers ORDER BY started_at')]


def registered_pids(dsn: str, schema: str) -> set[int]:
    """The pids of the workers in the registry."""
    return {row[2] for row in registered(dsn, schema)}


async def move_schema_clock(app: pgflow.App, seconds: float) -> None:
    """Set the schema's clock (``clock_now()``, migration 0019) ``seconds`` ahead of the server's, as
    ``pgflow.testing`` does: for what is decided by workflow time, such as which chunk partition a new
    stream goes to and when a partition's period is over."""
    store = await app._client.runtime().store()
    await store.testing.set_clock(seconds)


class CountedWaiter:
    """A waiter (``signals.Wakeable``) that only counts how often it was woken."""

    def __init__(self) -> None:
        self.times = 0

    def wake(self) -> None:
        self.times += 1

    def hand(self, stream_id: int, position: int, value: bytes | None) -> None:
        self.wake()


# -- running a workflow to its end --------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def running(app: pgflow.App) -> AsyncIterator[None]:
    """An in-process worker for the duration of the block."""
    async with app.worker(concurrency=4):
        yield


async def run_to_end(app: pgflow.App, handle: pgflow.WorkflowHandle[Any]) -> Any:
    """Run a worker until the workflow ends; return its result (or raise its failure)."""
    async with running(app):
        return await handle.result_async(timeout=TIMEOUT)


async def fail_to_end(app: pgflow.App, handle: pgflow.WorkflowHandle[Any]) -> pgflow.WorkflowFailed:
    """Run a worker until the workflow fails; the failure (the test fails if it succeeds)."""
    async with running(app):
        with pytest.raises(pgflow.WorkflowFailed) as failed:
            await handle.result_async(timeout=TIMEOUT)
    return failed.value


async def wait_for(check: Callable[[], Awaitable[Any]], timeout: float = 60.0) -> Any:
    """Until the async ``check`` returns something truthy (another task's doing), bounded; that value."""
    with anyio.fail_after(timeout):
        while not (found := await check()):
            await anyio.sleep(0.05)
        return found


class RecordingHandler(logging.Handler):
    """A handler without a level of its own that keeps every record it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
