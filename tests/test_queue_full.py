"""A full notification queue refuses the commit of every transaction that notified. A session anywhere
in the cluster that sits in an open transaction after LISTEN holds the queue back until it fills; on a
server with a tiny queue (``max_notify_queue_pages = 64``, PostgreSQL 17 and later) that takes moments.
No write of pgflow's may fail for it: every statement is sent again without its pings, the waiters
fall back to their poll, the episode is logged once, and ``pgflow status`` names the sessions that
may hold the queue."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest

import pgflow

from .servers import EmbeddedServer, started_embedded

pytestmark = pytest.mark.anyio

WAIT = 20.0  # each operation's bound: a few of the App's 0.5 s polls, on a loaded machine
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_queue() -> Iterator[EmbeddedServer]:
    with started_embedded("pgflow-tests-tinyq-", "max_notify_queue_pages = 64") as server:
        yield server


async def hold_the_queue(dsn: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """A session that listened and then sits in a transaction, with the queue filled behind it."""
    holder = await psycopg.AsyncConnection.connect(dsn, autocommit=True, application_name="queue-hog")
    await holder.execute("LISTEN hog")
    await holder.execute("BEGIN")
    await holder.execute("SELECT 1")
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as filler:
        for _ in range(10_000):
            try:
                await filler.execute("SELECT pg_notify('hog', repeat('x', 7000))")
            except psycopg.errors.ProgramLimitExceeded:
                break
        else:
            raise AssertionError("the notification queue never filled")
    try:
        yield holder
    finally:
        await holder.close()


async def test_a_full_queue_fails_no_write_and_status_names_the_holder(
    tiny_queue: EmbeddedServer, caplog: pytest.LogCaptureFixture,
) -> None:
    dsn, schema = tiny_queue.dsn, f"t_{uuid.uuid4().hex[:12]}"
    caplog.set_level(logging.WARNING, logger="pgflow.signals")
    async with pgflow.App(dsn, schema=schema, poll_interval=0.5, suspend_after=0.2) as app:

        @app.workflow(name="full.quick")
        async def quick(n: int) -> int:
            return n

        @app.workflow(name="full.streams")
        async def streams() -> int:
            for n in range(5):
                await pgflow.write_stream_async("tokens", n)
            await pgflow.close_stream_async("tokens")
            return 5

        @app.workflow(name="full.talks")
        async def talks() -> str:
            await pgflow.set_event_async("progress", 0.5)
            message = await pgflow.recv_async("go", timeout=60)
            await pgflow.sleep_async(1.0)  # durable: the slot is given back (suspend_after=0.2)
            return f"got {message}"

        await app.migrate_async()
        holding = hold_the_queue(dsn)
        holder = await anext(holding)
        try:
            with psycopg.connect(dsn) as conn:
                assert conn.execute("SELECT pg_notification_queue_usage()").fetchone()[0] > 0.9  # type: ignore[index]
            async with app.worker(concurrency=8):
                one = await quick.start_async(1)
                many = await quick.start_many_async([(n,) for n in range(5)])
                streamed = await streams.start_async()
                talking = await talks.start_async()
                assert await asyncio.wait_for(one.result_async(), WAIT) == 1
                assert [await asyncio.wait_for(h.result_async(), WAIT) for h in many] == list(range(5))
                assert [v async for v in streamed.stream_async("tokens")] == list(range(5))
                assert await asyncio.wait_for(streamed.result_async(), WAIT) == 5
                assert await talking.get_event_async("progress", timeout=WAIT) == 0.5
                await talking.send_async("go", "word")
                assert await asyncio.wait_for(talking.result_async(), WAIT) == "got word"
                assert app.stats().pings_refused >= 1
                # Once per episode, not per statement.
                assert sum("refuses notifications" in r.getMessage() for r in caplog.records) == 1, caplog.text

                status = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "pgflow", "status"],
                                                 capture_output=True, text=True, timeout=60, cwd=ROOT,
                                                 env={**os.environ, "PGFLOW_DSN": dsn, "PGFLOW_SCHEMA": schema})
                assert status.returncode == 1, status.stdout + status.stderr
                assert f"session {holder.info.backend_pid} (queue-hog" in status.stdout, status.stdout

                # The holder goes. (PostgreSQL 15 and later advance the queue's tail only in a commit
                # that adds notifications, which a full queue refuses: a queue that filled up may stay
                # full after its holder left, until the server restarts. Measured here: from under a
                # second to stuck for good.) Once the server takes notifications again, pings ride again.
                with pytest.raises(StopAsyncIteration):
                    await anext(holding)
                await asyncio.to_thread(tiny_queue.restart)
                with anyio.fail_after(WAIT * 3):
                    while not any("takes notifications again" in r.getMessage() for r in caplog.records):
                        again = await quick.start_async(7)
                        assert await again.result_async() == 7
        finally:
            await holding.aclose()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


async def test_free_stream_appends_into_a_full_queue_are_written_once(tiny_queue: EmbeddedServer) -> None:
    """The Durable Streams server's group commits ride their pings too: refused at commit by a full
    queue, each batch is judged and written again without them, once; a producer's appends are all
    200s, the stream holds each message once, and a long-poll waiting in another App (another
    process's server) is woken by its poll."""
    from pgflow.durable_streams import asgi_app
    from pgflow.durable_streams import protocol as p

    from .test_durable_streams import JSON, call

    dsn, schema = tiny_queue.dsn, f"t_{uuid.uuid4().hex[:12]}"
    async with pgflow.App(dsn, schema=schema, poll_interval=0.5) as app, \
            pgflow.App(dsn, schema=schema, poll_interval=0.5) as elsewhere:
        await app.migrate_async()
        writer, reader = asgi_app(app), asgi_app(elsewhere)
        assert (await call(writer, "PUT", "/full", JSON))[0] == 201
        holding = hold_the_queue(dsn)
        await anext(holding)
        try:
            waited: list[tuple[int, bytes]] = []

            async def long_poll() -> None:
                status, _, body = await call(reader, "GET", "/full", query="offset=-1&live=long-poll")
                waited.append((status, body))

            with anyio.fail_after(WAIT):  # (the group ends when the long-poll has had its answer)
                async with anyio.create_task_group() as group:
                    group.start_soon(long_poll)
                    for seq in range(5):
                        producing = [*JSON, ("producer-id", "w"), ("producer-epoch", "0"),
                                     ("producer-seq", str(seq))]
                        status, head, _ = await call(writer, "POST", "/full", producing, str(seq).encode())
                        assert status == 200 and head[p.NEXT_OFFSET] == p.offset_text(seq + 1), (status, head)
            assert app.stats().pings_refused >= 1  # (the batches did carry pings, and were refused)
            status, _, body = await call(writer, "GET", "/full", query="offset=-1")
            assert status == 200 and body == b"[0,1,2,3,4]"
            assert waited[0][0] == 200 and waited[0][1].startswith(b"[0")
        finally:
            await holding.aclose()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
