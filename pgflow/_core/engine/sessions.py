"""The SQL about the server session behind a connection rather than the schema's tables: its settings
(looked at through a pooler), and the session-level advisory locks by which one worker of the fleet is
elected for each maintenance service (``_core/maintenance.py``), held by a connection of its own."""

from __future__ import annotations

from typing import Any, NamedTuple

from psycopg import AsyncConnection

from .database import Session, Sql


class Names(NamedTuple):
    names: list[str]


class Lock(NamedTuple):
    name: str


# The current values of some settings (as ``SHOW`` spells their names).
SETTINGS = Sql("SELECT name, pg_catalog.current_setting(name) FROM pg_catalog.unnest(%s::text[]) name",
               row=tuple[str, str], params=Names)
# A service's lock taken by this session, unless another holds it: held until the session ends.
TRY_LOCK = Sql("SELECT pg_try_advisory_lock(hashtext(%s))", row=tuple[bool], params=Lock)
# A round trip: the session still answers (so the locks it holds are still its).
ANSWER = Sql("SELECT 1", row=tuple[int])


async def settings(conn: AsyncConnection[Any], names: list[str]) -> dict[str, str]:
    """The current values of the settings ``names`` (as ``SHOW`` spells them) on the server session
    that serves this statement."""
    return dict(await Session(conn).rows(SETTINGS, names))


async def try_lock(conn: AsyncConnection[Any], name: str) -> bool:
    """Whether ``conn``'s session took (or already held) the advisory lock of ``name``."""
    row = await Session(conn).row(TRY_LOCK, name)
    return bool(row and row[0])


async def answer(conn: AsyncConnection[Any]) -> None:
    await Session(conn).run(ANSWER)
