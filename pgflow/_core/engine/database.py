"""The engine's one way to run a statement: a ``Database`` (a pool of autocommit connections and one
schema) runs every statement of every port, on a connection of its own or in a ``Session``.

A statement is one of two kinds, both named in their port's module (the catalogue):

- ``wire.Statement``: the statements run for every workflow and every batch (a start, a claim, a batch
  of ends or chunks), whose parameters declare their types once; sent through libpq, binary both
  ways, prepared once per connection (``wire.py`` says what that buys);
- ``Sql``: every other statement, whose parameters psycopg adapts; psycopg prepares one after it ran a
  few times on a connection.

Either is prepared where the connection allows it and sent plain through a transaction-mode pooler
(the pool turns psycopg's preparing off there, and ``Pool.prepares`` tells ``wire`` to do the same).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import psycopg
from psycopg import AsyncConnection, sql

from .. import connecting
from ..pool import Pool
from . import wire

Params = Mapping[str, Any] | Sequence[Any] | None
Row = tuple[Any, ...]


def quote_identifier(name: str) -> str:
    """``name`` as an SQL identifier, quoted by psycopg (not by a template: the schema name is safe
    today only because App checks it against a pattern)."""
    return sql.Identifier(name).as_string()


class Sql:
    """A statement whose parameters psycopg adapts: its template, with ``{s}`` for the schema and
    psycopg's placeholders (``%s``, ``%(name)s``)."""

    __slots__ = ("template", "_by_schema")

    def __init__(self, template: str) -> None:
        self.template = template
        self._by_schema: dict[str, str] = {}

    def for_schema(self, schema: str) -> str:
        """The statement for the (quoted) ``schema``."""
        found = self._by_schema.get(schema)
        if found is None:
            found = self._by_schema[schema] = self.template.replace("{s}", schema)
        return found

    def __repr__(self) -> str:
        return f"Sql({self.template[:60]!r}...)"


Statement = Sql | wire.Statement


class Session:
    """One connection checked out of the engine's pool: statements that must share it (a transaction,
    a snapshot, a lock) run here, in order."""

    __slots__ = ("conn", "_db")

    def __init__(self, conn: AsyncConnection[Any], db: Database) -> None:
        self.conn = conn
        self._db = db

    async def rows(self, statement: Statement, params: Params = None) -> list[Row]:
        """The rows ``statement`` returns (none for one that returns no rows)."""
        if isinstance(statement, wire.Statement):
            assert isinstance(params, Mapping), "a wire statement takes its parameters by name"
            return await wire.fetch(self.conn, statement, self._db.quoted, params, prepare=self._db.pool.prepares)
        cur = await self.conn.execute(statement.for_schema(self._db.quoted), params)
        return await cur.fetchall() if cur.description is not None else []

    async def row(self, statement: Statement, params: Params = None) -> Row | None:
        """The first row ``statement`` returns, or None."""
        rows = await self.rows(statement, params)
        return rows[0] if rows else None

    async def run(self, statement: Statement, params: Params = None) -> None:
        """Run ``statement`` for what it does, not for rows."""
        await self.rows(statement, params)

    async def rows_then_durable(self, statement: wire.Statement, params: Mapping[str, Any]) -> list[Row]:
        """``rows``, then a commit that waits for the disk, in the same round trip (``wire.fetch_then_durable``)."""
        return await wire.fetch_then_durable(self.conn, statement, self._db.quoted, params)

    def transaction(self) -> AbstractAsyncContextManager[psycopg.AsyncTransaction]:
        return self.conn.transaction()


class Database:
    """One schema's tables behind one pool: what every port runs its statements through."""

    def __init__(self, pool: Pool, schema: str) -> None:
        self.pool = pool
        self.schema = schema
        self.quoted = quote_identifier(schema)

    @asynccontextmanager
    async def session(self, *, within: float | None = None) -> AsyncIterator[Session]:
        """A connection of the pool's, whose use must be over ``within`` seconds (``Pool.connection``)."""
        async with self.pool.connection(within=within) as conn:
            yield Session(conn, self)

    async def rows(self, statement: Statement, params: Params = None, *, within: float | None = None) -> list[Row]:
        """``statement``'s rows, on a connection of its own."""
        async with self.pool.connection(within=within) as conn:
            return await Session(conn, self).rows(statement, params)

    async def row(self, statement: Statement, params: Params = None, *, within: float | None = None) -> Row | None:
        """``statement``'s first row or None, on a connection of its own."""
        rows = await self.rows(statement, params, within=within)
        return rows[0] if rows else None

    async def run(self, statement: Statement, params: Params = None, *, within: float | None = None) -> None:
        """Run ``statement`` for what it does, on a connection of its own."""
        await self.rows(statement, params, within=within)

    async def on_this_machine(self) -> bool:
        """Whether the pool's connections reach a server on this machine (``connecting.on_this_machine``)."""
        async with self.pool.connection() as conn:
            try:
                hostaddr = conn.info.hostaddr
            except psycopg.NotSupportedError:  # (libpq before 12 does not say)
                hostaddr = ""
            cur = await conn.execute("SELECT host(inet_server_addr())")
            row = await cur.fetchone()
            return connecting.on_this_machine(conn.info.host, hostaddr, row[0] if row else None)


class Port:
    """A group of statements with one role (starts, claims, the journal, ...), run through the
    ``Database`` the engine gives every port."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.pool = db.pool
        self.schema = db.schema
        self._s = db.quoted

    def _sql(self, template: str) -> str:
        return template.replace("{s}", self._s)

    async def _fetchone(self, template: str, params: Any) -> tuple[Any, ...] | None:
        async with self.pool.connection() as conn:
            cur = await conn.execute(self._sql(template), params)
            row: tuple[Any, ...] | None = await cur.fetchone()
            return row
