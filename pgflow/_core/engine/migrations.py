"""Numbered SQL migrations, applied once per schema however many processes start at once.

Each file in ``sql/`` is ``NNNN_name.sql``; ``{schema}`` in it is replaced by the quoted schema.
The fast path (already at the latest version) takes no lock, so a process that starts against a
migrated database pays two small queries; the slow path serialises on an advisory lock held by the
migrating transaction, so concurrent starters wait for the first and then find nothing to do.

pgflow adopts no schema it would not have made itself. A role with CREATE on the database can make the
schema first, or (given CREATE on it) put a function, table or view in it that pgflow's statements
then use: its code would run as the role that migrates, and its owner could read every row and the
signal keys. So before any statement reads or changes the schema (on the fast path too, in one query
over the catalog), the schema and every table, view, sequence, function and type in it must be owned
by the migrating role (``current_user``) or by a role named in ``PGFLOW_SCHEMA_OWNERS`` (comma-separated:
for deployments where a dedicated owner role migrates and other roles run the workers and callers,
name the owner there, and any role of the workers that makes chunk partitions). Anything else is a
``ConfigurationError`` naming the object and its owner. Membership in the owner role is not enough
(a superuser is a member of every role, and must be refused a squatter's schema too). A schema that
does not exist is created, owned by the migrating role; an empty one of an expected owner is used.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from importlib import resources
from typing import NamedTuple, TypedDict

import psycopg
from psycopg import AsyncConnection

from ...errors import ConfigurationError
from .database import Port, Session, Sql

DEADLOCK_ATTEMPTS = 5
OWNERS_VARIABLE = "PGFLOW_SCHEMA_OWNERS"  # roles besides the migrating one that may own the schema's objects

# The first object of the schema (the schema itself first) whose owner is neither the current role nor
# one of %(owners)s, with the current role and how many such objects there are; no row when all is well
# or the schema does not exist. %(schema)s is the quoted name, as the statements write it. A relation's row
# type and an array type always have the owner of what they belong to, checked already: left out of the count.
class Owners(TypedDict):
    schema: str  # quoted
    owners: list[str]


class Foreign(NamedTuple):
    """The first object of the schema that is not ours (``FOREIGN_OWNED``)."""

    kind: str
    name: str
    owner: str
    current: str  # the current role
    not_ours: int  # how many objects are not ours


FOREIGN_OWNED = Sql(
    "SELECT o.kind, o.name, pg_catalog.pg_get_userbyid(o.owner), current_user, count(*) OVER ()"
    " FROM pg_catalog.pg_namespace n CROSS JOIN LATERAL ("
    "  SELECT 0 AS rank, 'schema' AS kind, n.nspname::text AS name, n.nspowner AS owner"
    "  UNION ALL SELECT 1, CASE c.relkind WHEN 'r' THEN 'table' WHEN 'p' THEN 'table' WHEN 'v' THEN 'view'"
    "   WHEN 'm' THEN 'materialized view' WHEN 'S' THEN 'sequence' WHEN 'f' THEN 'foreign table'"
    "   WHEN 'c' THEN 'type' ELSE 'index' END, c.relname::text, c.relowner"
    "   FROM pg_catalog.pg_class c WHERE c.relnamespace = n.oid"
    "  UNION ALL SELECT 2, 'function', p.proname || '(' || pg_catalog.pg_get_function_identity_arguments(p.oid)"
    "   || ')', p.proowner FROM pg_catalog.pg_proc p WHERE p.pronamespace = n.oid"
    "  UNION ALL SELECT 3, 'type', t.typname::text, t.typowner FROM pg_catalog.pg_type t"
    "   WHERE t.typnamespace = n.oid AND t.typrelid = 0 AND NOT (t.typtype = 'b' AND t.typcategory = 'A')) o"
    " WHERE n.oid = pg_catalog.to_regnamespace(%(schema)s) AND o.owner NOT IN ("
    "  SELECT r.oid FROM pg_catalog.pg_roles r WHERE r.rolname = current_user OR r.rolname = ANY(%(owners)s::text[]))"
    " ORDER BY o.rank, o.name LIMIT 1", row=Foreign, params=Owners)


class Named(NamedTuple):
    name: str


class Recorded(NamedTuple):
    version: int
    name: str


# Whether the schema has its table of migrations (%s: its name, the schema's quoted; a regclass, which
# psycopg reads as its name); what it holds.
HAS_MIGRATIONS = Sql("SELECT to_regclass(%s)", row=tuple[str | None], params=Named)
LATEST = Sql("SELECT coalesce(max(version), 0) FROM {s}.migrations", row=tuple[int])
APPLIED = Sql("SELECT version FROM {s}.migrations", row=tuple[int])
# A migrating transaction: its lock (per schema), the schema and its table of migrations made unless
# they exist, then each migration applied and recorded.
LOCK = Sql("SELECT pg_advisory_xact_lock(hashtext(%s))", row=tuple[None], params=Named)
CREATE_SCHEMA = Sql("CREATE SCHEMA IF NOT EXISTS {s}", row=None)
CREATE_MIGRATIONS = Sql(
    "CREATE TABLE IF NOT EXISTS {s}.migrations ("
    " version integer PRIMARY KEY, name text NOT NULL,"
    " applied_at timestamptz NOT NULL DEFAULT now())", row=None)
RECORD = Sql("INSERT INTO {s}.migrations (version, name) VALUES (%s, %s)", row=None, params=Recorded)


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
    s = Session(conn, schema)
    found = await s.row(HAS_MIGRATIONS, f"{schema}.migrations")
    if found is None or found[0] is None:
        return 0
    latest = await s.row(LATEST)
    return latest[0] if latest else 0


async def applied_versions(conn: AsyncConnection[tuple[object, ...]], schema: str) -> set[int]:
    """Every migration applied to ``schema``."""
    s = Session(conn, schema)
    found = await s.row(HAS_MIGRATIONS, f"{schema}.migrations")
    if found is None or found[0] is None:
        return set()
    return {version for version, in await s.rows(APPLIED)}


async def migrate(conn: AsyncConnection[tuple[object, ...]], schema: str) -> list[Migration]:
    """Bring ``schema`` up to date; return the migrations this call applied (often none). Every
    shipped migration not applied yet is applied, not only those above the highest applied: branches
    developed side by side number theirs apart, and a merged build may bring a lower number later.

    A new schema gets them all in one transaction (nobody can be using it yet, and one commit is
    cheaper than thirty). An upgrade applies each in a transaction of its own, so that the locks one
    takes end with it while workers of the version before go on: 0023 scans the chunks under a lock
    that lets them write, and must not run under 0022's, which would stop them. A migration that
    meets a deadlock (its locks against those of running statements) is tried again.

    The owners are checked first: nothing of a schema another role could change is read or run."""
    await check_owners(conn, schema)
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
    s = Session(conn, schema)
    async with s.transaction():
        await s.run(LOCK, f"pgflow.migrate.{schema}")
        await s.run(CREATE_SCHEMA)
        await check_owners(conn, schema)  # made by another role since the first look: not ours
        await s.run(CREATE_MIGRATIONS)
        done = await applied_versions(conn, schema)
        for migration in todo:
            if migration.version in done:
                continue
            await s.script(migration.sql.replace("{schema}", schema).encode())
            await s.run(RECORD, migration.version, migration.name)
            applied_now.append(migration)
        await check_owners(conn, schema)  # an object another role put there meanwhile: nothing commits
    return applied_now


def expected_owners() -> list[str]:
    """The roles ``PGFLOW_SCHEMA_OWNERS`` names, besides the migrating one."""
    return [name.strip() for name in os.environ.get(OWNERS_VARIABLE, "").split(",") if name.strip()]


async def check_owners(conn: AsyncConnection[tuple[object, ...]], schema: str) -> None:
    """Raise ConfigurationError when ``schema`` (quoted) or anything in it is owned by a role that is
    neither the current one nor named in ``PGFLOW_SCHEMA_OWNERS``. One catalog query, no lock."""
    row = await Session(conn, schema).row(FOREIGN_OWNED, schema=schema, owners=expected_owners())
    if row is not None:
        raise ConfigurationError(refusal(schema, *row))


def refusal(schema: str, kind: str, name: str, owner: str, current: str, count: int) -> str:
    """The one line that says what another role owns and what to do. Names are the catalog's, which
    another role chose: they are shown as Python literals, so no control character reaches a terminal."""
    what = f"schema {schema}" if kind == "schema" else f"{kind} {name!r} in schema {schema}"
    more = f" (and {count - 1} more objects not ours)" if count > 1 else ""
    fix = (f"DROP SCHEMA {schema} CASCADE if you did not make it" if kind == "schema"
           else "drop it (or ALTER its OWNER) if you did not make it")
    return (f"{what} is owned by role {owner!r}, not by {current!r} which runs pgflow{more}: pgflow will not use"
            f" a schema another role can change under it; {fix}, or, if role {owner!r} is yours, name it in"
            f" {OWNERS_VARIABLE} (comma-separated)")


class Schema(Port):
    """The port that brings the schema up to date and says which version it is at."""

    async def migrate(self) -> list[Migration]:
        # Unbounded: a migration may build an index on a big table, or wait for another process's.
        async with self.db.session(within=math.inf) as s:
            return await migrate(s.conn, self.db.quoted)

    async def version(self) -> int:
        async with self.db.session() as s:
            return await applied_version(s.conn, self.db.quoted)
