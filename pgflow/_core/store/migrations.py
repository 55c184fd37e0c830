"""Numbered SQL migrations, applied once per schema however many processes start at once.

Each file in ``sql/`` is ``NNNN_name.sql``; ``{schema}`` in it is replaced by the quoted schema.
The fast path (already at the latest version) takes no lock, so a process that starts against a
migrated database pays two small queries; the slow path serialises on an advisory lock held by the
migrating transaction, so concurrent starters wait for the first and then find nothing to do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources

import psycopg
from psycopg import AsyncConnection

DEADLOCK_ATTEMPTS = 5


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def available() -> list[Migration]:
    """The migrations shipped with this version of pgflow, in order."""
    found = []
    for entry in resources.files(__package__).joinpath("sql").iterdir():
        match = re.fullmatch(r"(\d{4})_(\w+)\.sql", entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    return sorted(found, key=lambda m: m.version)


async def applied_version(conn: AsyncConnection[tuple[object, ...]], schema: str) -> int:
    """The highest migration applied to ``schema``; 0 when it has none."""
    row = await (await conn.execute("SELECT to_regclass(%s)", (f"{schema}.migrations",))).fetchone()
    if row is None or row[0] is None:
        return 0
    row = await (await conn.execute(f"SELECT coalesce(max(version), 0) FROM {schema}.migrations")).fetchone()
    return int(row[0]) if row else 0  # type: ignore[call-overload]


async def applied_versions(conn: AsyncConnection[tuple[object, ...]], schema: str) -> set[int]:
    """Every migration applied to ``schema``."""
    row = await (await conn.execute("SELECT to_regclass(%s)", (f"{schema}.migrations",))).fetchone()
    if row is None or row[0] is None:
        return set()
    cur = await conn.execute(f"SELECT version FROM {schema}.migrations")
    return {int(r[0]) for r in await cur.fetchall()}  # type: ignore[call-overload]


async def migrate(conn: AsyncConnection[tuple[object, ...]], schema: str) -> list[Migration]:
    """Bring ``schema`` up to date; return the migrations this call applied (often none). Every
    shipped migration not applied yet is applied, not only those above the highest applied: branches
    developed side by side number theirs apart, and a merged build may bring a lower number later.

    A new schema gets them all in one transaction (nobody can be using it yet, and one commit is
    cheaper than thirty). An upgrade applies each in a transaction of its own, so that the locks one
    takes end with it while workers of the version before go on: 0023 scans the chunks under a lock
    that lets them write, and must not run under 0022's, which would stop them. A migration that
    meets a deadlock (its locks against those of running statements) is tried again."""
    todo = available()
    done = await applied_versions(conn, schema)
    if {m.version for m in todo} <= done:
        return []
    if not done:
        return await _apply(conn, schema, todo)
    applied_now = []
    for migration in todo:
        if migration.version not in done:
            applied_now += await _apply(conn, schema, [migration])
    return applied_now


async def _apply(conn: AsyncConnection[tuple[object, ...]], schema: str, todo: list[Migration]) -> list[Migration]:
    """Apply those of ``todo`` not applied yet (another process may have, while this one waited for
    the lock), in one transaction; return those this call applied."""
    attempts = 1
    while True:
        try:
            return await _apply_once(conn, schema, todo)
        except psycopg.errors.DeadlockDetected:
            if attempts == DEADLOCK_ATTEMPTS:
                raise
            attempts += 1


async def _apply_once(conn: AsyncConnection[tuple[object, ...]], schema: str,
                      todo: list[Migration]) -> list[Migration]:
    applied_now = []
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"pgflow.migrate.{schema}",))
        await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
        await conn.execute(
            f"CREATE TABLE IF NOT EXISTS {schema}.migrations ("
            " version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = await applied_versions(conn, schema)
        for migration in todo:
            if migration.version in done:
                continue
            await conn.execute(migration.sql.replace("{schema}", schema).encode())
            await conn.execute(
                f"INSERT INTO {schema}.migrations (version, name) VALUES (%s, %s)",
                (migration.version, migration.name),
            )
            applied_now.append(migration)
    return applied_now
