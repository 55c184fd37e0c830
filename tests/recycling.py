"""Migrated schemas used again, test after test (the ``schema`` fixture in conftest.py).

A test's schema costs a migration (every table, index and function of pgflow made anew) and a
``DROP SCHEMA ... CASCADE``: most of what a short test spends on its server, and on the PostgreSQL 15,
which runs without autovacuum, thousands of dead catalogue rows a session. So a schema a test is done with
goes back to a pool, and the next test gets it reset to what a fresh migration leaves, for everything a
test can observe (tests/test_schema_recycling.py checks it):

* the same objects: the catalogue's description of the schema (tables, columns and their defaults,
  constraints, indexes, views, functions, triggers, policies, sequences' settings, owners and grants, the
  partitions of chunks and their bounds) equals that of a schema this pool migrated itself, the reference;
  a test that changed any of it (moved the schema's clock, dropped a function, added a partition) leaves a
  schema that is dropped, not used again;
* no rows but those the migration writes (the table of migrations, the chunks' partitioning and
  partitions, a signal key of its own drawn anew, their times now), sequences as never used;
* the planner's view and the statistics views of a table never analyzed, scanned or written: the pages
  and rows ``pg_class`` counts, no ``pg_statistic`` rows, every counter of ``pg_stat_*`` at zero. These
  are the server's own catalogues: the tests' role is a superuser on both servers;
* the period of chunk partitions the clock is in: a schema migrated in an earlier period (the day turned)
  is not used again.

A schema is reset when the next test takes it, not when its own test ends: the fixtures of that test
(worker processes, their connections) are all gone by then. A reset that cannot have its locks at once
(some session still holds one) or meets a session holding an advisory lock leaves the schema to be dropped
with its database or server, and the test gets a newly migrated one. Tests about making a schema (the
migration, its owners, an upgrade) ask for one no one made with ``@pytest.mark.new_schema``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from pgflow._core.engine.migrations import migrate

__all__ = ["SchemaPool", "describe"]

# Every object of schema %(name)s, one line each, sorted; the schema's name in them is replaced by '@'.
DESCRIBE = """
WITH n AS (SELECT oid FROM pg_catalog.pg_namespace WHERE nspname = %(name)s),
lines(line) AS (
  SELECT concat_ws(' ', 'schema', nspowner::regrole, nspacl) FROM pg_catalog.pg_namespace
   WHERE oid = (SELECT oid FROM n)
  UNION ALL SELECT concat_ws(' ', 'rel', c.relname, c.relkind, c.relpersistence, c.relowner::regrole, c.relacl,
   c.reloptions, c.relrowsecurity, c.relforcerowsecurity, pg_catalog.pg_get_expr(c.relpartbound, c.oid),
   pg_catalog.pg_get_partkeydef(c.oid), CASE WHEN c.relkind IN ('i', 'I') THEN pg_catalog.pg_get_indexdef(c.oid)
   WHEN c.relkind IN ('v', 'm') THEN pg_catalog.pg_get_viewdef(c.oid) END)
   FROM pg_catalog.pg_class c WHERE c.relnamespace = (SELECT oid FROM n)
  UNION ALL SELECT concat_ws(' ', 'column', c.relname, a.attnum, a.attname,
   pg_catalog.format_type(a.atttypid, a.atttypmod), a.attnotnull, a.attidentity, a.attgenerated,
   pg_catalog.pg_get_expr(d.adbin, d.adrelid), a.attacl, a.attstattarget)
   FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_class c ON c.oid = a.attrelid
   LEFT JOIN pg_catalog.pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
   WHERE c.relnamespace = (SELECT oid FROM n) AND a.attnum > 0 AND NOT a.attisdropped
  UNION ALL SELECT concat_ws(' ', 'constraint', conrelid::regclass, conname, convalidated,
   pg_catalog.pg_get_constraintdef(oid)) FROM pg_catalog.pg_constraint WHERE connamespace = (SELECT oid FROM n)
  UNION ALL SELECT concat_ws(' ', 'function', pg_catalog.pg_get_functiondef(p.oid), p.proowner::regrole, p.proacl)
   FROM pg_catalog.pg_proc p WHERE p.pronamespace = (SELECT oid FROM n)
  UNION ALL SELECT concat_ws(' ', 'trigger', pg_catalog.pg_get_triggerdef(t.oid), t.tgenabled)
   FROM pg_catalog.pg_trigger t JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid
   WHERE c.relnamespace = (SELECT oid FROM n) AND NOT t.tgisinternal
  UNION ALL SELECT concat_ws(' ', 'policy', p.polrelid::regclass, p.polname, p.polcmd, p.polpermissive, p.polroles,
   pg_catalog.pg_get_expr(p.polqual, p.polrelid), pg_catalog.pg_get_expr(p.polwithcheck, p.polrelid))
   FROM pg_catalog.pg_policy p JOIN pg_catalog.pg_class c ON c.oid = p.polrelid
   WHERE c.relnamespace = (SELECT oid FROM n)
  UNION ALL SELECT concat_ws(' ', 'type', t.typname, t.typtype, t.typowner::regrole)
   FROM pg_catalog.pg_type t WHERE t.typnamespace = (SELECT oid FROM n) AND t.typrelid = 0
   AND NOT (t.typtype = 'b' AND t.typcategory = 'A')
  UNION ALL SELECT concat_ws(' ', 'sequence', s.seqrelid::regclass, s.seqtypid::regtype, s.seqstart,
   s.seqincrement, s.seqmax, s.seqmin, s.seqcache, s.seqcycle)
   FROM pg_catalog.pg_sequence s JOIN pg_catalog.pg_class c ON c.oid = s.seqrelid
   WHERE c.relnamespace = (SELECT oid FROM n)
  UNION ALL SELECT concat_ws(' ', 'statistics', stxname) FROM pg_catalog.pg_statistic_ext
   WHERE stxnamespace = (SELECT oid FROM n)
)
SELECT pg_catalog.replace(string_agg(line, E'\\n' ORDER BY line), %(name)s, '@') FROM lines
"""

# The tables of the schema (partitions too, not their partitioned parents), and whether each has any
# storage: one never written has none.
TABLES = ("SELECT c.relname, pg_catalog.pg_relation_size(c.oid) > 0 FROM pg_catalog.pg_class c"
          " WHERE c.relnamespace = pg_catalog.to_regnamespace(%s) AND c.relkind = 'r' ORDER BY c.relname")
# Sessions other than this one that hold an advisory lock in this database (a lock of this schema's name
# may be among them: a maintenance service's, which the next test's worker could not take).
ADVISORY = ("SELECT count(*) FROM pg_catalog.pg_locks WHERE locktype = 'advisory' AND granted"
            " AND pid <> pg_catalog.pg_backend_pid()"
            " AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())")
# The period of chunk partitions the reference's first partition of new streams is for (a migration makes
# that of the period the clock is in, and those after it): its start, and whether the clock is still in it.
PERIOD = ("SELECT min(p.starts_at), min(p.starts_at) = pg_catalog.date_bin(pg_catalog.make_interval(hours =>"
          " s.period_hours), pg_catalog.now(), timestamptz '2000-01-01 00:00:00+00') FROM {s}.chunk_partitions p,"
          " {s}.chunk_partitioning s WHERE p.first_id >= 4294967296 GROUP BY s.period_hours")
STILL_IN = ("SELECT pg_catalog.date_bin(pg_catalog.make_interval(hours => %s), pg_catalog.now(),"
            " timestamptz '2000-01-01 00:00:00+00') = %s")
# What the migration wrote at its own time, made as it does at the time of the reset.
NOW_AGAIN = [
    "UPDATE {s}.migrations SET applied_at = now()",
    "UPDATE {s}.chunk_partitions SET ends_at = now() WHERE name = 'chunks_before_partitions'",
    "UPDATE {s}.signal_keys SET created_at = now(), seal_from = now(),"
    " secret = decode(replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex')",
]
LOCK_TIMEOUT = "2s"


@dataclass
class Reference:
    """What a schema just migrated looks like (taken from one this pool migrated itself)."""

    description: str
    rows: dict[str, list[Any]]  # the tables the migration writes rows into: those rows, as JSON
    sequences: dict[str, int | None]  # each sequence's last value, None: never used
    sizes: list[tuple[str, int, float, int]]  # (relation, relpages, reltuples, relallvisible)
    period: tuple[int, Any]  # the chunk partitions' period in hours, the start of the one it was made in


def describe(conn: psycopg.Connection[Any], name: str) -> str:
    """The objects of schema ``name`` as text, its name written as '@' (``DESCRIBE``)."""
    row = conn.execute(DESCRIBE, {"name": name}).fetchone()
    return str(row[0]) if row and row[0] is not None else ""


def migrate_schema(dsn: str, name: str) -> None:
    """Migrate schema ``name`` as pgflow does on first use, on a thread of its own (the caller may be
    running an event loop)."""

    async def run() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await migrate(conn, f'"{name}"')

    failure: list[BaseException] = []

    def target() -> None:
        try:
            asyncio.run(run())
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller
            failure.append(exc)

    thread = threading.Thread(target=target, name="schema migration")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


class SchemaPool:
    """The migrated schemas of one server that tests hand back, and the reference they are reset to."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._reference: Reference | None = None
        self._period_check: str | None = None
        self._returned: list[str] = []
        self.made = self.reused = self.discarded = 0

    def take(self) -> str:
        """A migrated, empty schema: one a test handed back, reset, or else a new one."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while self._returned:
                name = self._returned.pop()
                if self._reset(conn, name):
                    self.reused += 1
                    return name
                self.discarded += 1
        name = f"t_{uuid.uuid4().hex[:12]}"
        migrate_schema(self.dsn, name)
        self.made += 1
        if self._reference is None:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                self._reference = self._look(conn, name)
        return name

    def give_back(self, name: str) -> None:
        """The schema of a test that has ended: reset when a test takes it."""
        self._returned.append(name)

    def drop_all(self) -> None:
        """Drop the schemas handed back (at the end of the session; not when the server or the session's
        database has gone already, with them)."""
        names, self._returned = self._returned, []
        try:
            with psycopg.connect(self.dsn, autocommit=True, connect_timeout=5) as conn:
                for name in names:
                    self._drop(conn, name)
        except psycopg.OperationalError:
            pass

    # -- the reference and the reset ------------------------------------------------------------------

    def _look(self, conn: psycopg.Connection[Any], name: str) -> Reference:
        s = sql.Identifier(name)
        tables = [table for table, _ in conn.execute(TABLES, (f'"{name}"',)).fetchall()]
        rows: dict[str, list[Any]] = {}
        for table in tables:
            found = conn.execute(sql.SQL("SELECT coalesce(jsonb_agg(to_jsonb(t)), '[]') FROM {}.{} t").format(
                s, sql.Identifier(table))).fetchone()
            if found and found[0]:
                rows[table] = found[0]
        sequences = dict(conn.execute(
            "SELECT sequencename::text, last_value FROM pg_catalog.pg_sequences WHERE schemaname = %s",
            (name,)).fetchall())
        sizes = conn.execute(
            "SELECT relname::text, relpages, reltuples, relallvisible FROM pg_catalog.pg_class"
            " WHERE relnamespace = pg_catalog.to_regnamespace(%s)", (f'"{name}"',)).fetchall()
        [hours] = rows["chunk_partitioning"]
        period = conn.execute(sql.SQL(PERIOD).format(s=s)).fetchone()
        assert period is not None
        return Reference(describe(conn, name), rows, sequences, sizes, (int(hours["period_hours"]), period[0]))

    def _reset(self, conn: psycopg.Connection[Any], name: str) -> bool:
        """Reset a schema handed back to what ``take`` promises; False (and the schema dropped, or left
        when that cannot be done at once) when it cannot be."""
        reference = self._reference
        if reference is not None and conn.execute(STILL_IN, reference.period).fetchone() != (True,):
            reference = self._reference = None  # the period turned: a new reference, from the next schema made
        if (reference is None or describe(conn, name) != reference.description
                or conn.execute(ADVISORY).fetchone() != (0,)):
            self._drop(conn, name)
            return False
        written = [table for table, used in conn.execute(TABLES, (f'"{name}"',)).fetchall()
                   if used or table in reference.rows]
        try:
            with conn.transaction():
                conn.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
                self._empty(conn, name, written)
        except psycopg.errors.LockNotAvailable:
            return False  # a session holds a lock on it still: left as it is
        conn.execute("SELECT pg_catalog.pg_stat_force_next_flush()")  # this session's counts, then zero
        conn.execute("SELECT pg_catalog.pg_stat_reset_single_table_counters(c.oid) FROM pg_catalog.pg_class c"
                     " WHERE c.relnamespace = pg_catalog.to_regnamespace(%s)", (f'"{name}"',))
        return True

    def _empty(self, conn: psycopg.Connection[Any], name: str, written: list[str]) -> None:
        reference = self._reference
        assert reference is not None
        s = sql.Identifier(name)
        if written:
            conn.execute(sql.SQL("TRUNCATE {} CASCADE").format(
                sql.SQL(", ").join(sql.SQL("{}.{}").format(s, sql.Identifier(t)) for t in written)))
        for table, rows in reference.rows.items():
            conn.execute(sql.SQL("INSERT INTO {s}.{t} OVERRIDING SYSTEM VALUE SELECT * FROM"
                                 " jsonb_populate_recordset(NULL::{s}.{t}, %s)").format(s=s, t=sql.Identifier(table)),
                         (json.dumps(rows),))
        for statement in NOW_AGAIN:
            conn.execute(sql.SQL(statement).format(s=s))
        for sequence, last in reference.sequences.items():
            name_of = sql.SQL("{}.{}").format(s, sql.Identifier(sequence)).as_string(conn)
            if last is None:
                conn.execute("SELECT pg_catalog.setval(%s::regclass, seqstart, false) FROM pg_catalog.pg_sequence"
                             " WHERE seqrelid = %s::regclass", (name_of, name_of))
            else:
                conn.execute("SELECT pg_catalog.setval(%s::regclass, %s, true)", (name_of, last))
        conn.execute("DELETE FROM pg_catalog.pg_statistic WHERE starelid IN (SELECT oid FROM pg_catalog.pg_class"
                     " WHERE relnamespace = pg_catalog.to_regnamespace(%s))", (f'"{name}"',))
        conn.execute("UPDATE pg_catalog.pg_class c SET relpages = r.pages, reltuples = r.tuples,"
                     " relallvisible = r.visible FROM unnest(%s::text[], %s::int[], %s::real[], %s::int[])"
                     " AS r(name, pages, tuples, visible)"
                     " WHERE c.relnamespace = pg_catalog.to_regnamespace(%s) AND c.relname = r.name",
                     ([r[0] for r in reference.sizes], [r[1] for r in reference.sizes],
                      [r[2] for r in reference.sizes], [r[3] for r in reference.sizes], f'"{name}"'))

    @staticmethod
    def _drop(conn: psycopg.Connection[Any], name: str) -> None:
        try:
            with conn.transaction():
                conn.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
                conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))
        except psycopg.errors.LockNotAvailable:
            pass  # left to go with its database or server
