"""What every port of the engine stands on: a pool of autocommit connections and one schema."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from .. import connecting
from ..pool import Pool


def quote_identifier(name: str) -> str:
    """``name`` as an SQL identifier, quoted by psycopg (not by a template: the schema name is safe
    today only because App checks it against a pattern)."""
    return sql.Identifier(name).as_string()


class Database:
    """One schema's tables behind one pool: what the ports share."""

    def __init__(self, pool: Pool, schema: str) -> None:
        self.pool = pool
        self.schema = schema
        self.quoted = quote_identifier(schema)

    def sql(self, template: str) -> str:
        """``template`` with ``{s}`` as the quoted schema."""
        return template.replace("{s}", self.quoted)

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
    """A group of statements with one role (starts, claims, the journal, ...), over the ``Database``
    the engine gives every port."""

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
