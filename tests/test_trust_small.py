"""Small matters of trust from a security review, each with the hostile or careless party it is about:
the user's application name kept on pgflow's connections, a test environment that drops only the schema
it made, recorded exception names that must stay data, and check-replay's exit codes."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import types
import uuid
from pathlib import Path
from typing import Any

import anyio
import msgspec
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pgflow
from pgflow._core.outcomes import rebuilt
from pgflow.errors import StepFailed
from pgflow.testing import PgflowEnv

from .helpers import ONE_SERVER, query

WAIT = 30.0
ROOT = Path(__file__).resolve().parent.parent

if os.environ.get("PGFLOW_TRUST_BROKEN_IMPORT"):  # check-replay's test of an app whose import fails
    raise RuntimeError("this module fails at import, as the test asked")


# -- the user's application_name --------------------------------------------------------------------------


def _named(dsn: str, form: str, name: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """``dsn`` naming the application ``name`` in ``form``: in the URL, as key=value, or through PGAPPNAME."""
    if form == "url":
        return f"{dsn}{'&' if '?' in dsn else '?'}application_name={name}"
    if form == "keywords":
        return make_conninfo("", **{**conninfo_to_dict(dsn), "application_name": name})
    if form == "PGAPPNAME":
        monkeypatch.setenv("PGAPPNAME", name)
    return dsn


async def _names_of_this_process(dsn: str, name: str, since: datetime.datetime) -> list[str]:
    """The application names of this process's sessions opened since ``since`` (the server's time when the
    test's App was made: a session another test of this process left open is not this App's): pgflow's own
    (by the pid in them) and the user's."""
    rows = await query(dsn, "SELECT application_name FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
                            " AND backend_start >= %s", since)
    pid = str(os.getpid())
    ours = [str(row[0]) for row in rows if row[0]]
    return sorted(n for n in ours if n == name or n.split(" ")[0].rsplit("-", 1)[-1] == pid and n.startswith("pgflow-"))


@pytest.mark.anyio
@pytest.mark.parametrize("form", ["url", "keywords", "PGAPPNAME", "none"])
async def test_the_users_application_name_is_kept_on_every_connection(
        dsn: str, schema: str, form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PGAPPNAME", raising=False)
    name = f"myapp-{uuid.uuid4().hex[:8]}"
    [(since,)] = await query(dsn, "SELECT statement_timestamp()")
    app = pgflow.App(_named(dsn, form, name, monkeypatch), schema=schema, poll_interval=0.5)
    app.workflow(name="trust.noop")(_noop)
    pid = os.getpid()
    maintenance = f"pgflow-maintenance-{pid}" + ("" if form == "none" else f" ({name})")
    try:
        async with app.worker():
            with anyio.fail_after(WAIT):  # the pool, the listener and the maintenance lock connection
                while True:
                    names = await _names_of_this_process(dsn, name, since)
                    wanted = {maintenance, f"pgflow-{pid}", f"pgflow-listener-{pid}"} if form == "none" else \
                        {maintenance, name}
                    if wanted <= set(names) and (form == "none" or names.count(name) >= 2):
                        break
                    await anyio.sleep(0.1)
            if form != "none":  # nothing of pgflow's own names replaced the user's
                assert set(names) == {name, maintenance}, names
            health = await app.health_async()  # and `pgflow status` still knows the worker's lock connection
            assert any(holder.worker for holder in health.maintenance), health.maintenance
    finally:
        await app.close_async()


# -- PgflowEnv drops only the schema it made ------------------------------------------------------------

env_app = pgflow.App(poll_interval=60.0)
env_flow = env_app.workflow(name="trust.env_flow")(lambda n: n)


def _schemas(dsn: str, *names: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [str(r[0]) for r in conn.execute("SELECT nspname FROM pg_namespace WHERE nspname = ANY(%s)"
                                                " ORDER BY nspname", (list(names),))]


@pytest.mark.new_schema  # somebody's schema, made here
def test_the_test_environment_leaves_a_schema_that_was_there_before(dsn: str, schema: str) -> None:
    # Somebody's schema, with a table of theirs in it (owned by the same role, so pgflow may use it).
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
        conn.execute(f'CREATE TABLE "{schema}".precious (a int)')
        conn.execute(f'INSERT INTO "{schema}".precious VALUES (42)')
    env = PgflowEnv(env_app, dsn, schema=schema).start()
    try:
        assert env_flow.start(3).result(timeout=WAIT) == 3
    finally:
        env.stop()
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute(f'SELECT a FROM "{schema}".precious').fetchall() == [(42,)]
    # A schema the environment made itself, named or not, is dropped.
    made = f"t_{uuid.uuid4().hex[:12]}"
    for env in (PgflowEnv(env_app, dsn, schema=made), PgflowEnv(env_app, dsn)):
        env.start()
        assert _schemas(dsn, env.schema) == [env.schema]
        env.stop()
        assert _schemas(dsn, env.schema) == []
    assert env_app._dsn is None and env_app._settings["schema"] == "pgflow"


@pytest.mark.new_schema  # somebody's schema, made here
def test_a_test_environment_that_cannot_start_leaves_a_schema_that_was_there(
        dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its start fails (the schema's owner is not expected): the teardown after the failure drops nothing."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
        conn.execute(f'ALTER SCHEMA "{schema}" OWNER TO pg_database_owner')  # a built-in role, not ours
    with pytest.raises(pgflow.ConfigurationError, match="pg_database_owner"):
        PgflowEnv(env_app, dsn, schema=schema).start()
    assert _schemas(dsn, schema) == [schema]


# -- a recorded exception's name is data -----------------------------------------------------------------


class Nested:
    class Inner(Exception):
        """An exception class inside a class: its recorded name is ``module.Nested.Inner``."""


touched: list[str] = []  # what a lookup ran of the code below: must stay empty


class _Meta(type):
    @property
    def Hidden(cls) -> type[Exception]:  # noqa: N802 - looks like a class to a path
        touched.append("metaclass property")
        return ValueError

    def __getattr__(cls, name: str) -> Any:
        touched.append(f"metaclass __getattr__ {name}")
        return ValueError


class Guarded(metaclass=_Meta):
    pass


def _recorded(type_name: str, args: list[Any] | None = None) -> dict[str, Any]:
    return {"type": type_name, "message": "hostile", "args": ["rm -rf /tmp/x"] if args is None else args,
            "traceback": ""}


def test_a_recorded_exception_name_is_looked_up_never_followed(monkeypatch: pytest.MonkeyPatch) -> None:
    touched.clear()
    # A lazily loading package (PEP 562), already imported: its __getattr__ would import or run anything.
    lazy = types.ModuleType("trust_lazy")

    def lazy_getattr(name: str) -> Any:
        touched.append(f"module __getattr__ {name}")
        return ValueError

    lazy.__getattr__ = lazy_getattr  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, "trust_lazy", lazy)
    monkeypatch.setattr(os, "system", lambda command: touched.append(f"os.system {command}"))
    unimported = [name for name in ("this", "antigravity") if name not in sys.modules]
    here = __name__
    hostile = [
        "os:system", "builtins:eval", "eval", "exec", "builtins.eval", "os.system", "subprocess.run",
        f"{here}.os.error",  # a path through this module's attribute os to OSError, a real exception class
        f"{here}.sys.modules", f"{here}.pytest.fail.Exception",
        "trust_lazy.Boom", "trust_lazy.os.error",
        f"{here}.Guarded.Hidden", f"{here}.Guarded.Missing",
        f"{here}.Nested.__init__", f"{here}.Nested.Inner.__class__",
        "this.Zen", "antigravity.Fly",  # never imported for a row's sake
        "KeyboardInterrupt", "SystemExit", "pgflow.errors.LeaseLost",  # not ordinary exceptions
        "a." * 5000 + "Error", "", ".", "ValueError.", "1.Error",
    ]
    for name in hostile:
        exc = rebuilt(_recorded(name))
        assert type(exc) is StepFailed and exc.error_type == name, (name, exc)
    assert touched == []
    assert [name for name in unimported if name in sys.modules] == []
    # What is an exception class where the name says is rebuilt as before.
    assert type(rebuilt(_recorded("ValueError", ["bad"]))) is ValueError
    inner = rebuilt(_recorded(f"{here}.Nested.Inner", ["deep"]))
    assert type(inner) is Nested.Inner and inner.args == ("deep",)
    assert type(rebuilt(_recorded("pgflow.errors.WorkflowConflict", ["x"]))) is pgflow.WorkflowConflict


# -- check-replay: 1 is a verdict, 2 an error -------------------------------------------------------------

replay_app = pgflow.App()  # configured by the environment of the `pgflow check-replay` process


@replay_app.step(name="trust.one")
async def one(x: int) -> int:
    return x


@replay_app.workflow(name="trust.replayed")
async def replayed(x: int) -> int:
    return await one(x)


def _check_replay(env: dict[str, str], *more: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pgflow", "check-replay", "--app", f"{__name__}:replay_app", *more],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)


@ONE_SERVER  # the command's exit codes (its journal reads are tested on both servers in test_deploys)
@pytest.mark.new_schema  # it begins on a schema not migrated yet
def test_check_replay_exits_1_for_a_mismatch_and_2_when_it_cannot_check(
        dsn: str, schema: str, worker_env: dict[str, str]) -> None:
    not_migrated = _check_replay(worker_env)
    assert not_migrated.returncode == 2 and "pgflow migrate" in not_migrated.stderr, not_migrated.stderr
    with pgflow.App(dsn, schema=schema) as app:
        app.migrate()
    unreachable = _check_replay({**worker_env, "PGFLOW_DSN": "postgresql://nobody:s3cret@127.0.0.1:1/nothing"})
    assert unreachable.returncode == 2 and "cannot connect" in unreachable.stderr, unreachable.stderr
    assert "s3cret" not in unreachable.stderr + unreachable.stdout
    broken = _check_replay({**worker_env, "PGFLOW_TRUST_BROKEN_IMPORT": "1"})
    assert broken.returncode == 2 and "cannot import the app" in broken.stderr, broken.stderr
    for args in (["--limit", "0"], ["--status", "failed"], ["--within", "nan"]):
        bad = _check_replay(worker_env, *args)
        assert bad.returncode == 2, (args, bad.stderr)
    inputs = msgspec.msgpack.encode([[5], {}])
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'INSERT INTO "{schema}".workflows (id, name, queue, inputs) VALUES'
                     " ('fresh', 'trust.replayed', 'default', %s)", (inputs,))
    assert _check_replay(worker_env).returncode == 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'INSERT INTO "{schema}".workflows (id, name, queue, inputs) VALUES'
                     " ('changed', 'trust.replayed', 'default', %s)", (inputs,))
        conn.execute(f'INSERT INTO "{schema}".steps (workflow_id, position, name, attempts, attempt)'
                     " VALUES ('changed', 0, 'trust.other', 1, 1)")
    mismatch = _check_replay(worker_env)
    assert mismatch.returncode == 1 and "'changed'" in mismatch.stdout, (mismatch.stdout, mismatch.stderr)
    described = subprocess.run([sys.executable, "-m", "pgflow", "check-replay", "--help"], env=worker_env, cwd=ROOT,
                               capture_output=True, text=True, timeout=60)
    assert described.returncode == 0
    assert "2 when the check could not be made" in " ".join(described.stdout.split())


async def _noop() -> None:
    return None
