"""The sealed channel against parties with more than a connection: a role that may read every table of
pgflow's but write none, a role that records payloads and sends them again, a listener that measures
payload sizes; and the keyring's lifetime (rotation by itself, key ids past 2**16)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import anyio
import msgspec
import psycopg
import pytest
from psycopg.conninfo import make_conninfo

import pgflow
from pgflow._core.engine.channel import SignalKey
from pgflow._core.engine.claims import Claims
from pgflow._core.registry import Config
from pgflow._core.signals import Chunk, End, Keyring, News
from pgflow._core.signals import keys as signal_keys
from pgflow._core.signals.sealing import SIZES, sealed
from tests.channel import channels

pytestmark = pytest.mark.anyio

WAIT = 60.0
FLOOD_SECONDS = 5.0


def sealed_length(plaintext_size: int) -> int:
    """The length on the wire of a payload whose padded plaintext has ``plaintext_size`` bytes: the
    version, then base64 of the 26-byte header, the ciphertext and its 16-byte tag."""
    return 1 + 4 * ((26 + plaintext_size + 16 + 2) // 3)


def test_payloads_come_in_a_few_sizes_whatever_a_token_s_length() -> None:
    keyring = Keyring("pgflow_x")
    keyring.load([SignalKey(1, bytes(range(32)), 0, None)])
    stream = signal_keys.stream(str(uuid.uuid4()), "tokens")
    lengths = set()
    for token in ("a", "x" * 64, "y" * 150):
        news = News(chunks=[Chunk(stream, 7, 1234, msgspec.msgpack.encode(token))])
        pings = sealed(keyring, ("pgflow_x", "pgflows_x"), news)
        assert pings is not None and len(pings.payloads) == 1
        lengths.add(len(pings.payloads[0]))
    assert lengths == {sealed_length(SIZES[0])}, "a token's length shows in its payload's"
    big = News([signal_keys.queue(f"q{n}") for n in range(300)])
    pings = sealed(keyring, ("pgflow_x", "pgflows_x"), big)
    assert pings is not None
    assert {len(p) for p in pings.payloads} <= {sealed_length(size) for size in SIZES}


def test_key_ids_past_two_to_the_sixteen_seal_and_open() -> None:
    keys = [SignalKey(65535, bytes(32), 0, None), SignalKey(65536, bytes(range(32)), 0, None),
            SignalKey(131073, bytes(range(1, 33)), 3600, None)]  # the last not sealed with yet
    sender, receiver = Keyring("pgflow_x"), Keyring("pgflow_x")
    sender.load(keys)
    receiver.load(keys)
    text = sender.seal(b"news")
    assert text is not None
    opened = receiver.open(text)
    assert opened is not None and opened.plaintext == b"news" and opened.key_id == 65536 % 2**16
    only_old = Keyring("pgflow_x")
    only_old.load(keys[:1])
    assert only_old.open(text) is None  # sealed with the newest key, which it does not hold


# -- a role that may read everything and write nothing ---------------------------------------------------


@pytest.fixture
def reader(dsn: str, schema: str) -> Iterator[dict[str, str]]:
    """Two roles that may read every table of the schema and write none: one granted SELECT on all of
    them (and by default privileges), one a member of pg_read_all_data; and, for contrast, a role
    that may start workflows. Their DSNs by name."""
    names = {kind: f"{kind}_{uuid.uuid4().hex[:8]}" for kind in ("granted", "readall", "writer")}
    with pgflow.App(dsn, schema=schema) as app:
        app.migrate()
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name in names.values():
            conn.execute(f'CREATE ROLE "{name}" LOGIN')
            conn.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO "{name}"')
        conn.execute(f'GRANT SELECT ON ALL TABLES IN SCHEMA "{schema}" TO "{names["granted"]}"')
        conn.execute(f'GRANT pg_read_all_data TO "{names["readall"]}"')
        conn.execute(f'GRANT SELECT ON ALL TABLES IN SCHEMA "{schema}" TO "{names["writer"]}"')
        conn.execute(f'GRANT INSERT ON "{schema}".workflows TO "{names["writer"]}"')
    try:
        yield {kind: make_conninfo(dsn, user=name) for kind, name in names.items()}
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for name in names.values():
                conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (name,))
                conn.execute(f'DROP OWNED BY "{name}"')
                conn.execute(f'DROP ROLE "{name}"')


def _keys_seen(dsn: str, schema: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(f'SELECT count(*) FROM "{schema}".signal_keys').fetchone()
        return int(row[0]) if row else 0


def _every_secret_candidate(dsn: str, schema: str) -> list[bytes]:
    """Every 32-byte value a role can read in the schema: its best guess at a key."""
    found: set[bytes] = set()
    with psycopg.connect(dsn, autocommit=True) as conn:
        columns = conn.execute(
            "SELECT c.relname, a.attname FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid"
            " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relkind IN ('r', 'p')"
            " AND a.atttypid = 'bytea'::regtype AND a.attnum > 0 AND NOT a.attisdropped", (schema,)).fetchall()
        for table, column in columns:
            rows = conn.execute(f'SELECT "{column}" FROM "{schema}"."{table}"'
                                f' WHERE octet_length("{column}") = 32').fetchall()
            found.update(bytes(r[0]) for r in rows)
    return sorted(found)


async def test_a_role_that_reads_everything_cannot_forge_a_result(
    dsn: str, schema: str, reader: dict[str, str],
) -> None:
    # Only a role that may write workflows sees a key; the readers see the table, and no row of it.
    assert _keys_seen(reader["writer"], schema) >= 1
    assert _keys_seen(reader["granted"], schema) == 0
    assert _keys_seen(reader["readall"], schema) == 0
    gate = asyncio.Event()

    async def real() -> str:
        await gate.wait()
        return "real-result"

    async with pgflow.App(dsn, schema=schema, poll_interval=60.0) as app:
        wf = app.workflow(name="trust.real")(real)
        handle = await wf.start_async()
        async with app.worker(concurrency=2):
            result = asyncio.create_task(handle.result_async(timeout=WAIT))
            with anyio.fail_after(WAIT):
                while app.stats().listeners_connected == 0 or await handle.status_async() != "running":
                    await asyncio.sleep(0.02)
            rejected_before = app.stats().pings_rejected
            # The reader forges the end as the row would record it, sealed with every key it could find.
            sent = 0
            for who in ("granted", "readall"):
                async with await psycopg.AsyncConnection.connect(reader[who], autocommit=True) as conn:
                    cur = await conn.execute(
                        f'SELECT (extract(epoch FROM created_at) * 1000000)::bigint, attempt'
                        f' FROM "{schema}".workflows WHERE id = %s', (handle.id,))
                    born, attempt = await cur.fetchone() or (0, 0)
                    forged = News(ends=[End(handle.id, born, attempt, "trust.real", "succeeded",
                                            msgspec.msgpack.encode("forged"), None)])
                    for key_id in (1, 2):
                        for secret in [*_every_secret_candidate(reader[who], schema), bytes(32)]:
                            keyring = Keyring(Config.channel_of(schema))
                            keyring.load([SignalKey(key_id, secret, 0, None)])
                            pings = sealed(keyring, channels(schema), forged)
                            assert pings is not None
                            for channel, text in zip(pings.channels, pings.payloads, strict=True):
                                await conn.execute("SELECT pg_notify(%s, %s)", (channel, text))
                                sent += 1
            with anyio.fail_after(WAIT):  # every forgery reached the caller's listener and was dropped
                while app.stats().pings_rejected < rejected_before + sent:
                    await asyncio.sleep(0.02)
            assert not result.done(), f"a forged end was believed: {result.result()!r}"
            gate.set()
            assert await result == "real-result"


# -- replays ---------------------------------------------------------------------------------------------


async def test_a_replay_flood_costs_an_idle_worker_next_to_nothing(
    dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    claims = 0
    claim = Claims.claim

    async def counted(self: Claims, *args: Any, **kwargs: Any) -> Any:
        nonlocal claims
        claims += 1
        return await claim(self, *args, **kwargs)

    monkeypatch.setattr(Claims, "claim", counted)

    async def noop(n: int) -> int:
        return n

    heard: list[str] = []
    async with pgflow.App(dsn, schema=schema) as worker_app, pgflow.App(dsn, schema=schema) as caller:
        worker_app.workflow(name="trust.noop")(noop)
        wf = caller.workflow(name="trust.noop")(noop)
        await caller.migrate_async()
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as spy, \
                await psycopg.AsyncConnection.connect(dsn, autocommit=True) as sender, \
                worker_app.worker(concurrency=2):
            for channel in channels(schema):
                await spy.execute(f'LISTEN "{channel}"')

            async def record() -> None:
                async for note in spy.notifies():
                    heard.append(note.payload)

            recording = asyncio.create_task(record())
            for n in range(3):  # each start pings the worker's queue; each end pings the caller
                assert await (await wf.start_async(n)).result_async(timeout=WAIT) == n
            with anyio.fail_after(WAIT):
                while not heard:
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.5)  # (the last pings of the work, heard before the window opens)
            recording.cancel()
            recorded = list(heard)
            assert {len(text) for text in recorded} <= {sealed_length(size) for size in SIZES}

            before = claims
            await asyncio.sleep(FLOOD_SECONDS)  # the idle worker's own claims over the window
            idle = claims - before
            before, sent, rejected = claims, 0, worker_app.stats().pings_rejected
            deadline = anyio.current_time() + FLOOD_SECONDS
            while anyio.current_time() < deadline and sent < 50_000:
                for text in recorded:
                    for channel in channels(schema):
                        await sender.execute("SELECT pg_notify(%s, %s)", (channel, text))
                        sent += 1
            flooded = claims - before
            assert sent > 100
            assert flooded <= 10 * max(idle, 1), f"{sent} replays cost {flooded} claims (idle: {idle})"
            assert worker_app.stats().pings_rejected > rejected  # the replays reached it, and were dropped


# -- the keyring's lifetime ------------------------------------------------------------------------------


async def test_workers_rotate_the_keys_by_themselves(dsn: str, schema: str) -> None:
    async with pgflow.App(dsn, schema=schema, signal_key_period=1.0) as app:
        await app.migrate_async()
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            async def newest() -> int:
                cur = await conn.execute(f'SELECT max(id) FROM "{schema}".signal_keys')
                row = await cur.fetchone()
                return int(row[0]) if row else 0

            first = await newest()
            async with app.worker(concurrency=1):
                with anyio.fail_after(WAIT):
                    while await newest() < first + 2:
                        await asyncio.sleep(0.1)


async def test_a_key_id_past_two_to_the_sixteen_seals(dsn: str, schema: str) -> None:
    async with pgflow.App(dsn, schema=schema) as app:
        await app.migrate_async()
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute(f'UPDATE "{schema}".signal_keys SET id = 65535')
        # (at once: the public call asks for a minute's overlap, for the processes already running)
        assert await app._client.runtime().db(lambda store: store.channel.rotate_signal_key(0.0)) == 65536

    async def echo(n: int) -> int:
        return n

    async with pgflow.App(dsn, schema=schema, poll_interval=60.0) as caller, \
            pgflow.App(dsn, schema=schema) as runner:
        wf = caller.workflow(name="trust.echo")(echo)
        runner.workflow(name="trust.echo")(echo)
        async with runner.worker(concurrency=1):
            began = anyio.current_time()
            handle = await wf.with_options(delay=0.5).start_async(7)
            assert await handle.result_async(timeout=WAIT / 2) == 7
            # (result() looks once more when its timeout ends: a result that came then came by no ping)
            assert anyio.current_time() - began < WAIT / 4, "the result came by the minute's poll, not by a ping"
        assert runner.stats().pings_rejected == 0 and caller.stats().pings_rejected == 0
