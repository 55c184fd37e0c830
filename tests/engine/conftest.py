"""The engines the conformance suite judges (see ``tests/engine/__init__.py``): a factory each, in
``ENGINES``, parametrized by the suite's servers (``server``: pg18, pg15)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

import anyio
import psycopg
import pytest
from psycopg import sql

from pgflow._core.engine import Engine
from pgflow._core.pool import Pool
from pgflow._core.registry import Config

from ..servers import EmbeddedServer


class Heard:
    """The payloads heard on some channels, in the order they came."""

    def __init__(self) -> None:
        self.payloads: list[tuple[str, str]] = []  # (channel, payload)
        self._changed = anyio.Event()

    def add(self, channel: str, payload: str) -> None:
        self.payloads.append((channel, payload))
        self._changed.set()
        self._changed = anyio.Event()

    async def until(self, payload: str, timeout: float = 10.0) -> list[tuple[str, str]]:
        """Every payload heard up to and including ``payload`` (which the test sends after what it
        wants to know was or was not sent: pings of one engine arrive in the order of their commits)."""
        with anyio.fail_after(timeout):
            while not any(p == payload for _, p in self.payloads):
                await self._changed.wait()
        index = next(i for i, (_, p) in enumerate(self.payloads) if p == payload)
        return self.payloads[:index + 1]


class EngineFactory(Protocol):
    """What the suite needs of an engine besides its ports."""

    def store(self) -> contextlib.AbstractAsyncContextManager[Engine]:
        """A fresh, empty store, ready to use (migrated), and its engine; gone after the block."""

    def peer(self, engine: Engine) -> Engine:
        """Another engine on ``engine``'s store: what another process sees (nothing of ``engine``'s
        own state in memory, such as what its claims remember between rounds, is shared)."""

    def listening(self, channels: Sequence[str]) -> contextlib.AbstractAsyncContextManager[Heard]:
        """Hear the pings sent on ``channels`` (by any engine on the store) for the block."""


class PostgreSQL:
    """pgflow's engine on a PostgreSQL server: a schema of its own per store."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    @contextlib.asynccontextmanager
    async def store(self) -> AsyncIterator[Engine]:
        schema = f"e_{uuid.uuid4().hex[:12]}"
        pool = Pool(Config(self.dsn, schema=schema, pool_size=6))
        await pool.open(wait=True, timeout=30)
        try:
            engine = Engine(pool, schema)
            await engine.migrations.migrate()
            yield engine
        finally:
            await pool.close()
            async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')

    def peer(self, engine: Engine) -> Engine:
        return Engine(engine.pool, engine.schema)

    @contextlib.asynccontextmanager
    async def listening(self, channels: Sequence[str]) -> AsyncIterator[Heard]:
        heard = Heard()
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            for channel in channels:
                await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))

            async def hear() -> None:
                async for note in conn.notifies():
                    heard.add(note.channel, note.payload)

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(hear)
                try:
                    yield heard
                finally:
                    tasks.cancel_scope.cancel()


# The engines judged, by name: each made from the address of the suite's server (a factory that needs
# none ignores it). A new engine is one more entry.
ENGINES: dict[str, Callable[[str], EngineFactory]] = {"postgresql": PostgreSQL}


@pytest.fixture(scope="session", params=sorted(ENGINES))
def factory(request: pytest.FixtureRequest, server: tuple[str, EmbeddedServer | None]) -> EngineFactory:
    return ENGINES[request.param](server[0])


@pytest.fixture(scope="package")
async def engine(factory: EngineFactory) -> AsyncIterator[Engine]:
    """One store per engine and server for the whole suite: a store costs a migration (most of a
    second), and the tests keep apart by unique names, queues, ids and worker ids. Closed when the
    suite ends, not the session: the tests after it count this process's sessions."""
    async with factory.store() as engine:
        yield engine


@pytest.fixture
def peer(factory: EngineFactory, engine: Engine) -> Engine:
    """Another process's engine on the suite's store."""
    return factory.peer(engine)
