"""Schema squatting: a role with CREATE on the database (or on pgflow's schema) that makes the schema, or
an object in it, before or after pgflow does. pgflow must refuse such a schema before it reads or runs
anything of it, on the slow path (a schema to migrate) and on the fast one (an App starting on a schema
already migrated), even when it migrates as a superuser. Each test has a real squatter role."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

import pgflow
from pgflow._core.engine import migrations
from pgflow.errors import ConfigurationError

# Each test makes the schema, or has it made, its own way: a name no schema has yet (tests/recycling.py).
pytestmark = pytest.mark.new_schema


@pytest.fixture
def squatter(dsn: str) -> Iterator[str]:
    """A fresh role with LOGIN and CREATE on the database; dropped with all it owns afterwards."""
    name = f"squatter_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{name}" LOGIN')
        conn.execute(f'GRANT CREATE ON DATABASE "{conn.info.dbname}" TO "{name}"')
    try:
        yield name
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (name,))
            conn.execute(f'DROP OWNED BY "{name}" CASCADE')  # its objects, and what was granted to it here
            conn.execute(f'DROP ROLE "{name}"')


def as_role(dsn: str, role: str, *statements: str) -> None:
    with psycopg.connect(make_conninfo(dsn, user=role), autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


def loot(dsn: str, schema: str) -> list[str]:
    """Whose sessions ran the squatter's spy function."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [str(row[0]) for row in conn.execute(f'SELECT who FROM "{schema}".loot')]


def test_a_schema_another_role_made_first_is_refused_and_nothing_of_it_runs(
        dsn: str, schema: str, squatter: str) -> None:
    # The squatter's schema holds a "migrations" view over a function that records who reads it.
    as_role(dsn, squatter,
            f'CREATE SCHEMA "{schema}"',
            f'CREATE TABLE "{schema}".loot (who text)',
            f'GRANT INSERT ON "{schema}".loot TO PUBLIC',
            f'CREATE FUNCTION "{schema}".spy() RETURNS int LANGUAGE sql VOLATILE AS'
            f' $$ INSERT INTO "{schema}".loot VALUES (current_user) RETURNING 1 $$',
            f'CREATE VIEW "{schema}".migrations AS SELECT "{schema}".spy() AS version, \'x\'::text AS name',
            f'GRANT USAGE ON SCHEMA "{schema}" TO PUBLIC',
            f'GRANT SELECT ON "{schema}".migrations TO PUBLIC')
    with pgflow.App(dsn, schema=schema) as app:  # as postgres, a superuser
        with pytest.raises(ConfigurationError) as refused:
            app.migrate()
    message = str(refused.value)
    assert f'schema "{schema}" is owned by role {squatter!r}' in message
    assert "PGFLOW_SCHEMA_OWNERS" in message and "DROP SCHEMA" in message and "\n" not in message
    assert loot(dsn, schema) == []  # the view was never read: the function never ran as postgres
    with psycopg.connect(dsn, autocommit=True) as conn:  # and pgflow made nothing in it
        assert conn.execute("SELECT to_regclass(%s)", (f'"{schema}".workflows',)).fetchone() == (None,)


def test_an_app_refuses_a_squatted_schema_on_first_use(dsn: str, schema: str, squatter: str) -> None:
    """Not only ``migrate``: a start (the App migrates on its first use) is refused the same way."""
    as_role(dsn, squatter, f'CREATE SCHEMA "{schema}"',
            f'CREATE FUNCTION "{schema}".clock_now() RETURNS timestamptz LANGUAGE sql AS $$ SELECT now() $$')
    with pgflow.App(dsn, schema=schema) as app:
        flow = app.workflow(name="owners.flow")(_noop)
        with pytest.raises(ConfigurationError, match=squatter):
            flow.start()


def test_an_object_another_role_put_in_our_schema_is_refused_on_the_fast_path(
        dsn: str, schema: str, squatter: str) -> None:
    with pgflow.App(dsn, schema=schema) as app:
        app.migrate()
    # Given CREATE on the schema (a careless grant), the squatter adds a function and a table to it.
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'GRANT CREATE, USAGE ON SCHEMA "{schema}" TO "{squatter}"')
    as_role(dsn, squatter, f'CREATE FUNCTION "{schema}".next_stream_id(int) RETURNS bigint LANGUAGE sql'
                           " AS $$ SELECT 1::bigint $$")
    with pgflow.App(dsn, schema=schema) as app:  # a new process: the schema is at the latest version
        with pytest.raises(ConfigurationError) as refused:
            app.migrate()
    message = str(refused.value)
    assert f"function 'next_stream_id(integer)' in schema \"{schema}\" is owned by role {squatter!r}" in message
    assert "not by 'postgres'" in message
    as_role(dsn, squatter, f'DROP FUNCTION "{schema}".next_stream_id(int)',
            f'CREATE TABLE "{schema}".extra (a int)')
    with pgflow.App(dsn, schema=schema) as app:
        with pytest.raises(ConfigurationError, match=f"table 'extra' in schema .* role {squatter!r}"):
            app.migrate()
    as_role(dsn, squatter, f'DROP TABLE "{schema}".extra')
    with pgflow.App(dsn, schema=schema) as app:  # nothing foreign left: used again
        app.migrate()


def test_the_operators_empty_schema_is_used_and_a_missing_one_is_ours(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    with pgflow.App(dsn, schema=schema) as app:
        assert app.migrate() == migrations.available()[-1].version
    other = f"t_{uuid.uuid4().hex[:12]}"
    try:
        with pgflow.App(dsn, schema=other) as app:
            app.migrate()
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute("SELECT pg_get_userbyid(nspowner) = current_user FROM pg_namespace"
                               " WHERE nspname = %s", (other,)).fetchone()
            assert row == (True,)
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{other}" CASCADE')


def test_an_owner_named_in_the_environment_is_accepted(
        dsn: str, schema: str, squatter: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deployment whose dedicated owner role made the schema, and another role migrates and runs."""
    as_role(dsn, squatter, f'CREATE SCHEMA "{schema}"', f'GRANT CREATE, USAGE ON SCHEMA "{schema}" TO PUBLIC')
    monkeypatch.setenv(migrations.OWNERS_VARIABLE, f" other_role , {squatter}")
    with pgflow.App(dsn, schema=schema) as app:
        app.migrate()
        flow = app.workflow(name="owners.named")(_noop)
        assert flow.start().id
    monkeypatch.setenv(migrations.OWNERS_VARIABLE, "other_role")
    with pgflow.App(dsn, schema=schema) as app:
        with pytest.raises(ConfigurationError, match=squatter):
            app.migrate()


async def _noop() -> None:
    return None
