"""The SQL that looks at the server session behind a connection, for connections through a pooler."""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection


async def settings(conn: AsyncConnection[Any], names: list[str]) -> dict[str, str]:
    """The current values of the settings ``names`` (as ``SHOW`` spells them) on the server session
    that serves this statement."""
    cur = await conn.execute("SELECT name, pg_catalog.current_setting(name) FROM pg_catalog.unnest(%s::text[]) name",
                             (names,))
    return {str(name): str(value) for name, value in await cur.fetchall()}
