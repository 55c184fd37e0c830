"""pgflow's channel as a test hears it: payloads opened with the schema's keyring, as a process of
pgflow's (a role that may read the keys) opens them. An App's keyring is loaded once its store has
opened (any call that reaches the database)."""

from __future__ import annotations

from typing import Any

import psycopg

import pgflow
from pgflow._core.signals import News, payload


def opened(app: pgflow.App, text: str) -> News | None:
    """The news a payload tells, or None when it does not open with ``app``'s keyring."""
    sealed = app._runtimes.keyring.open(text)
    return None if sealed is None else payload.decode(sealed.plaintext)


def named(news: News) -> list[str]:
    """Every key a payload's news names, the keys of what it carries included."""
    return news.plain().keys


def seal(app: pgflow.App, news: News) -> list[str]:
    """The payloads ``app``'s process would send for ``news``."""
    sealed = [app._runtimes.keyring.seal(text) for text in payload.plaintexts(news)]
    assert None not in sealed, "the App's keyring is not loaded: open its store first"
    return sealed  # type: ignore[return-value]


async def listen(dsn: str, schema: str) -> psycopg.AsyncConnection[Any]:
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    await conn.execute(f'LISTEN "pgflow_{schema}"')
    return conn
