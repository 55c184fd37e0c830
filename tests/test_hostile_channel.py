"""A role that may only connect (LOGIN, CONNECT, no right on pgflow's schema) can LISTEN and NOTIFY on
pgflow's channel, since PostgreSQL checks no privilege there. It must neither forge news (ends, chunks,
close markers, wake-alls, garbage, replays of what it heard) nor learn anything from what it hears: no
result, chunk value, error text or workflow id in readable form."""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

import anyio
import msgspec
import psycopg
import pytest
from psycopg.conninfo import make_conninfo

import pgflow
from pgflow._core.signals import Chunk, End, News
from pgflow._core.signals import keys as signal_keys
from pgflow._core.signals.sealing import VERSION
from tests.channel import channels

pytestmark = pytest.mark.anyio

WAIT = 60.0
SECRETS = ["real-result", "secret-token-0", "secret-token-1", "secret-error-text"]


@pytest.fixture
def intruder(dsn: str) -> Iterator[str]:
    """The DSN of a fresh role with LOGIN and nothing else (PUBLIC's CONNECT on the database)."""
    name = f"intruder_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{name}" LOGIN')
    try:
        yield make_conninfo(dsn, user=name)
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (name,))
            conn.execute(f'DROP ROLE IF EXISTS "{name}"')


def forgeries(workflow_id: str, heard: list[str]) -> list[str]:
    """Payloads a role without the schema's key can make: the old, readable formats (an end, a
    chunk, a close marker and a wake-all), news of the new format that is not sealed, a sealed-looking
    header on random bytes, garbage, and replays of what it heard."""
    forged_value = base64.b64encode(msgspec.msgpack.encode("forged")).decode()
    evil = base64.b64encode(msgspec.msgpack.encode("evil")).decode()
    stream = f"s:{workflow_id}:tokens"
    old = [
        ["x", ["o:" + json.dumps([workflow_id, "hostile.real", "succeeded", 99, forged_value, None])]],
        ["x", [f"c:1:{evil}:{len(workflow_id)}:{stream}"]],
        ["x", [f"c:1:-:{len(workflow_id)}:{stream}"]],
        ["x", ["*"]],
    ]
    unsealed = msgspec.msgpack.encode(News(
        ["*"], [End(workflow_id, 0, 99, "hostile.real", "succeeded", msgspec.msgpack.encode("forged"), None)]))
    # News naming the reader's stream as the channel names it, carrying a chunk of it, not sealed.
    chunk = msgspec.msgpack.encode(News(chunks=[Chunk(signal_keys.stream(workflow_id, "tokens"), 1, 1,
                                                      msgspec.msgpack.encode("forged"))]))
    header = (1).to_bytes(2, "big") + os.urandom(16) + (7).to_bytes(8, "big")
    return [
        *(json.dumps(p) for p in old),
        VERSION + binascii.b2a_base64(unsealed, newline=False).decode(),
        VERSION + binascii.b2a_base64(chunk, newline=False).decode(),
        VERSION + binascii.b2a_base64(header + os.urandom(64), newline=False).decode(),
        VERSION + binascii.b2a_base64(header + unsealed + os.urandom(16), newline=False).decode(),
        "", VERSION, "not a payload", VERSION + "A" * 7000,
        *heard,  # replays: they open, and can only make somebody look
    ]


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_role_with_connect_alone_can_neither_forge_nor_hear(
    app: pgflow.App, second_app: pgflow.App, schema: str, intruder: str, kind: str,
) -> None:
    at_one = asyncio.Event()  # the reader has chunk 0 and waits at position 1
    gate = asyncio.Event()

    async def real(fail: bool) -> str:
        await pgflow.write_stream_async("tokens", "secret-token-0")
        await gate.wait()
        await pgflow.write_stream_async("tokens", "secret-token-1")
        await pgflow.close_stream_async("tokens")
        if fail:
            raise ValueError("secret-error-text")
        return "real-result"

    caller = app.workflow(name="hostile.real")(real)
    second_app.workflow(name="hostile.real")(real)
    await second_app.migrate_async()
    heard: list[str] = []
    async with await psycopg.AsyncConnection.connect(intruder, autocommit=True) as spy, \
            await psycopg.AsyncConnection.connect(intruder, autocommit=True) as sender:
        # It has no right on the schema: no key, no row.
        for table in ("signal_keys", "workflows", "chunks"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                await sender.execute(f'SELECT * FROM "{schema}".{table}')
        for channel in channels(schema):  # (the main channel and the stream channel)
            await spy.execute(f'LISTEN "{channel}"')

        async def listen() -> None:
            async for note in spy.notifies():
                heard.append(note.payload)

        listening = asyncio.create_task(listen())
        ok, bad = await caller.start_async(False), await caller.start_async(True)
        async with second_app.worker(concurrency=4):
            if kind == "async":
                async def read() -> list[str]:
                    got = []
                    async for value in ok.stream_async("tokens"):
                        got.append(value)
                        at_one.set()
                    return got

                reader = asyncio.create_task(read())
                results = [asyncio.create_task(h.result_async(timeout=WAIT)) for h in (ok, bad)]
            else:
                loop = asyncio.get_running_loop()

                def read_sync() -> list[str]:
                    got = []
                    for value in ok.stream("tokens"):
                        got.append(value)
                        loop.call_soon_threadsafe(at_one.set)
                    return got

                def result_sync(h: pgflow.WorkflowHandle[str]) -> Any:
                    try:
                        return h.result(timeout=WAIT)
                    except pgflow.WorkflowFailed as exc:
                        return exc

                reader = asyncio.create_task(asyncio.to_thread(read_sync))
                results = [asyncio.create_task(asyncio.to_thread(result_sync, h)) for h in (ok, bad)]
            await asyncio.wait_for(at_one.wait(), WAIT)
            while app.stats().listeners_connected == 0:  # (the readers' loop's: the sync API has its own)
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)  # (the sync reader's thread is back in its wait at position 1)

            payloads = forgeries(ok.id, list(heard))
            for channel in channels(schema):
                for text in payloads:
                    await sender.execute("SELECT pg_notify(%s, %s)", (channel, text))
            replays = len(heard)
            # Every forgery reached the listeners, on both channels, and was dropped there (the readers'
            # loop listens on both: it waits for a stream). A replay opens on the channel it was heard
            # on (test_signals_unit: only there), and can only make somebody look.
            with anyio.fail_after(WAIT):
                while app.stats().pings_rejected < 2 * (len(payloads) - replays):
                    await asyncio.sleep(0.02)
            assert not reader.done() and not any(r.done() for r in results)

            gate.set()
            assert await asyncio.wait_for(reader, WAIT) == ["secret-token-0", "secret-token-1"]
            done = [await asyncio.wait_for(r, WAIT) if kind == "sync" else await _outcome(r) for r in results]
        assert done[0] == "real-result"
        assert isinstance(done[1], pgflow.WorkflowFailed) and done[1].message == "secret-error-text"
        assert second_app.stats().pings_rejected >= len(payloads) - replays
        await asyncio.sleep(0.2)
        listening.cancel()

    # What it heard of the real work: sealed payloads, of which nothing reads.
    genuine = [text for text in heard if text not in payloads]
    assert genuine, "the role heard nothing at all: the test proves nothing"
    for text in genuine:
        readable = [text, binascii.a2b_base64(text[1:])]
        for secret in [*SECRETS, ok.id, bad.id, signal_keys.ended(ok.id)]:
            assert all(secret.encode() not in (r.encode() if isinstance(r, str) else r) for r in readable), secret


async def _outcome(task: asyncio.Task[Any]) -> Any:
    try:
        return await asyncio.wait_for(task, WAIT)
    except pgflow.WorkflowFailed as exc:
        return exc


async def test_pgflows_statements_call_no_function_another_role_created(dsn: str, schema: str) -> None:
    """A function in a schema on the session's search path (here set by the DSN itself) that matches
    a call better than the built-in (``unnest(text[])`` against ``unnest(anyarray)``) would run inside
    pgflow's statements, as pgflow's role. pgflow pins its connections' search path to the catalog."""
    evil = f"{schema}_evil"
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(f'CREATE SCHEMA "{evil}"')
        await conn.execute(f'CREATE TABLE "{evil}".calls (n int)')
        await conn.execute(
            f'CREATE FUNCTION "{evil}".unnest(a text[]) RETURNS SETOF text LANGUAGE sql AS'
            f' $$ INSERT INTO "{evil}".calls VALUES (1); SELECT pg_catalog.unnest(a) $$')
    try:
        hostile = make_conninfo(dsn, options=f"-c search_path={evil},public")
        async with pgflow.App(hostile, schema=schema) as app:

            @app.workflow(name="hostile.path")
            async def path(n: int) -> int:
                return n

            async with app.worker():
                handles = await path.start_many_async([(1,), (2,)])
                assert [await h.result_async(timeout=WAIT) for h in handles] == [1, 2]
            assert app.stats().pings_refused == 0
        async with await psycopg.AsyncConnection.connect(hostile, autocommit=True) as conn:
            cur = await conn.execute(f'SELECT count(*) FROM "{evil}".calls')
            assert await cur.fetchone() == (0,), "a statement of pgflow's called the other role's function"
            # The DSN's path does reach the function (the test would prove nothing otherwise).
            await conn.execute("SELECT unnest(ARRAY['x'])")
            cur = await conn.execute(f'SELECT count(*) FROM "{evil}".calls')
            assert await cur.fetchone() == (1,)
    finally:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute(f'DROP SCHEMA "{evil}" CASCADE')
