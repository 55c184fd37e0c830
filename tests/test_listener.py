"""The listener of one loop, on a real server: every notification that opens reaches the waiters,
whether it arrives while the listener waits on its socket or while its own statement (a LISTEN, the
health check) runs on the connection."""

from __future__ import annotations

import uuid

import anyio
import psycopg
import pytest

from pgflow._core.engine.channel import SignalKey
from pgflow._core.signals import News, Waiter, Waiters
from pgflow._core.signals import keys as signal_keys
from pgflow._core.signals.listener import Listener
from pgflow._core.signals.sealing import Keyring, sealed

pytestmark = pytest.mark.anyio

SECRET = SignalKey(1, bytes(range(32)), -1.0, None)
SENT = 3000


def keyring(channel: str) -> Keyring:
    ring = Keyring(channel)
    ring.load([SECRET])
    return ring


@pytest.mark.parametrize("health_every", [0.0, 30.0], ids=["checking-all-the-time", "waiting"])
async def test_every_notification_reaches_the_waiters(dsn: str, health_every: float) -> None:
    """With ``health_every`` 0 the listener runs its health check between any two turns of its wait,
    so most notifications arrive while its own statement holds the connection (psycopg hands them
    over then); with 30 s they all arrive while it waits on the socket. None may be lost either way."""
    channels = (f"pgflow_t{uuid.uuid4().hex[:8]}", f"pgflows_t{uuid.uuid4().hex[:8]}")
    waiters = Waiters()
    woken = Waiter()
    waiters.add(signal_keys.queue("q"), woken)
    listener = Listener(lambda: dsn, channels, waiters, keyring(channels[0]), idle=60.0,
                        health_every=health_every)
    sender_ring = keyring(channels[0])
    payloads = []  # each its own (a transaction delivers identical notifications once)
    for _ in range(SENT):
        pings = sealed(sender_ring, channels, News([signal_keys.queue("q")]))
        assert pings is not None
        payloads.append(pings.payloads[0])
    async with anyio.create_task_group() as group:
        group.start_soon(listener.run)
        with anyio.fail_after(30):
            while not listener.connected:
                await anyio.sleep(0.01)
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as sender:
            for n in range(0, SENT, 10):  # one transaction of ten at a time: they arrive all along
                await sender.execute("SELECT pg_notify(%s, p) FROM unnest(%s::text[]) AS p",
                                     (channels[0], payloads[n:n + 10]))
        with anyio.move_on_after(30):
            while listener.heard < SENT:
                await anyio.sleep(0.01)
        group.cancel_scope.cancel()
    assert (listener.heard, listener.rejected) == (SENT, 0)
