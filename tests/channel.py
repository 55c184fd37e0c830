"""pgflow's channel as a test hears it: payloads opened with the schema's keyring, as a process of
pgflow's (a role that may read the keys) opens them. An App's keyring is loaded once its store has
opened (any call that reaches the database)."""

from __future__ import annotations

import os
from typing import Any

import psycopg

import pgflow
from pgflow._core.engine.channel import Pings
from pgflow._core.registry import Config
from pgflow._core.signals import News, payload
from pgflow._core.signals.sealing import sealed


def opened(app: pgflow.App, note: psycopg.Notify) -> News | None:
    """The news a notification tells, or None when it does not open with ``app``'s keyring on the
    channel it came by."""
    sealed = app._runtimes.keyring.open(note.payload, note.channel)
    return None if sealed is None else payload.decode(sealed.plaintext)


def named(news: News) -> list[str]:
    """Every key a payload's news names, the keys of what it carries included."""
    return news.plain().keys


def seal(app: pgflow.App, news: News) -> Pings:
    """The payloads ``app``'s process would send for ``news``, each with its channel."""
    pings = sealed(app._runtimes.keyring, channels(app.schema), news)
    assert pings is not None, "the App's keyring is not loaded: open its store first"
    return pings


def channels(schema: str) -> tuple[str, str]:
    """A schema's main channel and its stream channel."""
    return Config.channel_of(schema), Config.stream_channel_of(schema)


async def listen(dsn: str, schema: str) -> psycopg.AsyncConnection[Any]:
    """A connection listening on both of a schema's channels, as any role may."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    for channel in channels(schema):
        await conn.execute(f'LISTEN "{channel}"')
    return conn


def identity(app: pgflow.App) -> dict[str, Any]:
    """Who this process seals as: its pid, its sender, and the counter of the payload just sealed (a
    fork test's probe of each process)."""
    keyring = app._runtimes.keyring
    text = keyring.seal(b"probe")
    assert text is not None, "the keyring is not loaded"
    opened = keyring.open(text)
    assert opened is not None
    return {"pid": os.getpid(), "sender": opened.sender.hex(), "counter": opened.counter}
