"""The keyring that seals pings: made by the migration, readable by pgflow's roles only, rotated with
no downtime (during a rotation every process accepts both keys, and moves to the new one at its time)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import anyio
import msgspec
import psycopg
import pytest

import pgflow
from pgflow._core.engine.channel import SignalKey
from pgflow._core.signals import Keyring, News, service
from pgflow._core.signals import keys as signal_keys

pytestmark = pytest.mark.anyio

WAIT = 30.0
ROOT = Path(__file__).resolve().parent.parent


async def keys_of(dsn: str, schema: str) -> list[tuple[int, int]]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(f'SELECT id, octet_length(secret) FROM "{schema}".signal_keys ORDER BY id')
        return list(await cur.fetchall())


async def test_the_migration_makes_a_key_that_only_pgflows_roles_may_read(app: pgflow.App, dsn: str,
                                                                          schema: str) -> None:
    await app.migrate_async()
    assert await keys_of(dsn, schema) == [(1, 32)]
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute("SELECT has_table_privilege('public', %s, 'SELECT')", (f'"{schema}".signal_keys',))
        assert await cur.fetchone() == (False,)


async def test_a_rotation_loses_no_ping_between_two_processes(dsn: str, schema: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "KEYS_AT_MOST_EVERY", 0.05)  # a reload asked for by an unknown key, soon
    # Two Apps, as two processes (each one's payloads are foreign to the other), polling so seldom that
    # only their pings can deliver a result in time.
    async with pgflow.App(dsn, schema=schema, poll_interval=600) as caller, \
            pgflow.App(dsn, schema=schema, poll_interval=600) as runner:

        async def echo(n: int) -> int:
            return n

        wf = caller.workflow(name="keys.echo")(echo)
        runner.workflow(name="keys.echo")(echo)
        await runner.migrate_async()

        async def round_trip(n: int) -> None:
            waiting = [asyncio.create_task((await wf.start_async(n)).result_async(timeout=WAIT))]
            assert await asyncio.wait_for(waiting[0], WAIT) == n

        async def reload(app: pgflow.App) -> None:
            store = await app._client.runtime().store()
            app._runtimes.keyring.load(await store.channel.signal_keys())

        async with runner.worker():
            await round_trip(1)
            store = await caller._client.runtime().store()
            new = await store.channel.rotate_signal_key(1.0)  # (App.rotate_signal_key asks for a minute at least)
            assert new == 2
            await reload(runner)  # the runner has reloaded the keyring since; the caller not yet
            await round_trip(2)  # the old key still seals
            assert [app._runtimes.keyring._sealing_key() for app in (caller, runner)] == [1, 1]
            while runner._runtimes.keyring._sealing_key() != 2:
                await asyncio.sleep(0.05)
            # The caller hears a payload sealed with a key it does not know: it reloads by itself.
            runner._client.runtime().signals.announce(News([signal_keys.queue("nobody")]))
            with anyio.fail_after(WAIT):
                while caller._runtimes.keyring._sealing_key() != 2:
                    await asyncio.sleep(0.05)
            await round_trip(3)
            # Past the overlap the old key is no longer given out, nor accepted once reloaded.
            while len(await store.channel.signal_keys()) != 1:
                await asyncio.sleep(0.05)
            await reload(runner)
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                cur = await conn.execute(f'SELECT secret FROM "{schema}".signal_keys WHERE id = 1')
                [(secret,)] = await cur.fetchall()
            stale = Keyring(f"pgflow_{schema}")
            stale.load([SignalKey(1, bytes(secret), 0, None)])
            text = stale.seal(b"news sealed with the retired key")
            assert text is not None and runner._runtimes.keyring.open(text) is None
            await round_trip(4)
        assert runner.stats().pings_rejected == 0  # (the caller dropped what it could not open yet)


def test_the_cli_rotates_the_key(dsn: str, schema: str, app: pgflow.App) -> None:
    app.migrate()
    env = {**os.environ, "PGFLOW_DSN": dsn, "PGFLOW_SCHEMA": schema}
    done = subprocess.run([sys.executable, "-m", "pgflow", "keys", "rotate", "--overlap", "60", "--json"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr
    assert msgspec.json.decode(done.stdout) == {"key": 2, "sealed_with_in_s": 60.0}
    with pytest.raises(ValueError, match="between 60 and 86400"):
        app.rotate_signal_key(5)
