"""One way to run a statement (issue 41): every statement pgflow sends is a named constant of its port's
module (the catalogue), and runs through the executor of ``_core/engine/database.py`` (``Database`` and
``Session``), which alone calls psycopg's ``execute`` or the libpq path of ``wire.py``. Read from the
source, so a new ``conn.execute`` anywhere fails here before it ships."""

from __future__ import annotations

import ast
import collections.abc
import importlib
import re
import types
import typing
from datetime import datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import pq

from pgflow._core.engine import arrays, fencing, quote_identifier, wire, workers
from pgflow._core.engine.database import SNAPSHOT, Sql
from pgflow._core.engine.migrations import migrate
from pgflow._core.engine.statement import Statement

PACKAGE = Path(__file__).resolve().parent.parent / "pgflow"
ENGINE = PACKAGE / "_core" / "engine"
EXECUTOR = {ENGINE / "database.py", ENGINE / "wire.py"}
# Calls that run a statement or take a connection to run one on: psycopg's (a connection's or a
# cursor's execute, a cursor, a pool's checkout) and the libpq path's.
RUNS = {"execute", "executemany", "cursor", "connection"}
WIRE = {"fetch", "fetch_then_durable", "pipeline"}
# What outside the engine still takes a connection of the engine's pool itself, and why.
OUTSIDE = {
    # Checks a connection of the pool out with a timeout of its own for the wait (a flush that cannot
    # have one within 2 s drops its pings rather than stall the notifier); its statement is
    # engine.channel.NOTIFY, run through a Session over that connection (channel.notify).
    ("_core/signals/notifier.py", "connection"),
    # Looks at the server session behind a transaction-mode pooler through engine.sessions.SETTINGS,
    # on a connection of the pool's, once at the start (a Database has not been made yet).
    ("_core/pooler.py", "connection"),
    # pgflow.testing's own connection to the DSN (psycopg's sync API, before the App's pool is open and
    # after it closed): whether the test's schema exists, and the DROP of the schema the test made.
    ("testing/env.py", "execute"),
}
# Statements built at call time, each because a part of it can be no parameter and its values are
# unbounded: an identifier (the channel a listener listens on) or a function's body (the test clock).
BUILT_AT_CALL_TIME = {("_core/engine/clock.py", "set_clock"), ("_core/engine/channel.py", "listen"),
                      ("_core/engine/channel.py", "unlisten")}


def _modules_bound(tree: ast.Module) -> set[str]:
    """The names a module binds to modules it imports (``from . import wire``, ``import psycopg``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names if a.name.islower()}
    return names


def _calls(path: Path) -> list[tuple[str, int, str]]:
    """(receiver, line, attribute) of each call in ``path`` that runs a statement outside the executor."""
    tree = ast.parse(path.read_text())
    modules = _modules_bound(tree) - {"conn", "pool", "cur", "cursor"}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        receiver, attr = ast.unparse(node.func.value), node.func.attr
        module_call = receiver in modules  # (``protocol.cursor(...)`` is a function of pgflow's)
        if (attr in RUNS and not module_call) or (attr in WIRE and receiver == "wire"):
            found.append((receiver, node.lineno, attr))
    return found


def test_only_the_executor_runs_statements() -> None:
    offending = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in EXECUTOR:
            continue
        name = path.relative_to(PACKAGE).as_posix()
        calls = [(receiver, line, attr) for receiver, line, attr in _calls(path) if (name, attr) not in OUTSIDE]
        if calls:
            offending[name] = calls
    assert offending == {}, "run statements through engine.database's Database or Session"


def test_the_exceptions_outside_the_engine_are_still_there() -> None:
    """Each exception above names a call that exists (one moved onto the executor leaves the list)."""
    for name, attr in OUTSIDE:
        assert any(found == attr for _, _, found in _calls(PACKAGE / name)), (name, attr)


def test_statements_are_named_at_import_not_built_per_call() -> None:
    """A port's method picks a statement of the catalogue; it builds none (a ``Sql`` or a
    ``wire.Statement`` made in an ``async def``), except where its variants are unbounded."""
    built = set()
    for path in sorted(ENGINE.glob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Call) and ast.unparse(node.func) in ("Sql", "wire.Statement"):
                    built.add((name, function.name))
    assert built == BUILT_AT_CALL_TIME


# -- each statement's types (issue 41): its rows and its parameters, as it declares them (engine/statement.py)

# Modules whose statements are not typed yet (their rows plain tuples of anything, their parameters one
# mapping or sequence): none now (the free-standing streams' were the last, typed once their group
# commit's rework had landed).
NOT_TYPED_YET: set[str] = set()
_PLACEHOLDER = re.compile(r"%%|%\((\w+)\)[sb]|%[sb]")


def _statements(module: str) -> dict[str, Statement[Any, Any]]:
    """The statements named in ``module`` of the engine (``NAME``; ``NAME[key]`` for one of a dict of variants)."""
    found: dict[str, Statement[Any, Any]] = {}
    for name, value in vars(importlib.import_module(f"pgflow._core.engine.{module}")).items():
        if isinstance(value, Statement):
            found[name] = value
        elif isinstance(value, dict):
            found |= {f"{name}[{key!r}]": v for key, v in value.items() if isinstance(v, Statement)}
    return found


def catalogue() -> dict[str, Statement[Any, Any]]:
    """Every statement of the engine, each once (``module.NAME``, under the first module that names it)."""
    found: dict[int, tuple[str, Statement[Any, Any]]] = {}
    for path in sorted(ENGINE.glob("*.py")):
        for name, statement in _statements(path.stem).items():
            found.setdefault(id(statement), (f"{path.stem}.{name}", statement))
    return dict(found.values())


def typed() -> dict[str, Statement[Any, Any]]:
    """The statements that declare their types: all but those of ``NOT_TYPED_YET``."""
    left = {id(statement) for module in NOT_TYPED_YET for statement in _statements(module).values()}
    return {name: statement for name, statement in catalogue().items() if id(statement) not in left}


def test_every_statement_declares_its_rows() -> None:
    """``row=``: a NamedTuple, a ``tuple[...]``, or None for a statement that returns none (whether it
    does, and how many columns of which types, the server says below)."""
    assert [name for name, statement in typed().items() if statement.untyped] == []
    typed_since = {module for module in NOT_TYPED_YET if not any(s.untyped for s in _statements(module).values())}
    assert typed_since == set(), "typed now: take them off NOT_TYPED_YET"


def test_each_statements_parameters_are_the_ones_it_names() -> None:
    """A TypedDict names each ``%(name)s`` of its statement, a NamedTuple has one field per ``%s``, and a
    statement that declares none has no placeholder. (A ``wire.Statement`` checks its own as it is made.)
    One of a dict of variants may be given what its siblings take besides its own (a page of the
    dashboard's list, whatever its filters)."""
    wrong = {}
    for name, statement in typed().items():
        if not isinstance(statement, Sql) or statement.untyped:
            continue
        marks = [m for m in _PLACEHOLDER.finditer(statement.template) if m.group(0) != "%%"]
        names, positional = {m.group(1) for m in marks if m.group(1)}, sum(1 for m in marks if not m.group(1))
        spec = statement.params
        declared = (set(), 0) if spec is None else (set(typing.get_type_hints(spec)), 0) if statement.named \
            else (set(), len(spec._fields))
        variant = "[" in name and declared[0] >= names and declared[1] == positional
        if declared != (names, positional) and not variant:
            wrong[name] = (declared, (names, positional))
    assert wrong == {}


def test_a_statement_is_given_its_arguments_as_it_declares_them() -> None:
    """By keyword for a TypedDict's parameters; in order for a NamedTuple's (by keyword too: put in its
    order); in one mapping or sequence for a statement not typed yet; nothing for one that takes none."""
    assert workers.UNREGISTER.given((), {"id": "w"}) == {"id": "w"}
    assert fencing.HOLDS.given(("w", 7), {}) == ("w", 7)
    assert fencing.HOLDS.given(("w",), {"lease": 7}) == ("w", 7)
    assert Sql("SELECT %(a)s").given(({"a": 1},), {}) == {"a": 1}
    assert SNAPSHOT.given((), {}) is None


# What a column or parameter of each type is in Python (psycopg's loaders and dumpers), by the type's name;
# an array's ("_text") is a list of its element's.
PYTHON = {"int2": int, "int4": int, "int8": int, "oid": int, "float4": float, "float8": float, "numeric": Decimal,
          "text": str, "varchar": str, "name": str, "bool": bool, "bytea": bytes, "timestamptz": datetime,
          "interval": timedelta, "jsonb": Any, "void": type(None)}


def _fits(annotation: Any, type_name: str) -> bool:
    """Whether a value of the PostgreSQL type ``type_name`` is one of ``annotation`` (None left aside:
    whether a column may be NULL is the statement's to say, not its type's)."""
    if annotation is Any or annotation is object:
        return True
    if annotation is None:  # (as tuple[None] says it)
        return type_name == "void"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _fits(args[0], type_name)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(arg, type_name) for arg in args if arg is not type(None)) or type_name == "void"
    if type_name.startswith("_"):
        if isinstance(annotation, type) and issubclass(annotation, bytes):  # an array packed (engine/arrays.py)
            return annotation.__module__ == arrays.__name__ and annotation.__name__.lower() == f"{type_name[1:]}array"
        return origin in (list, collections.abc.Sequence) and _fits(args[0], type_name[1:])
    expected = PYTHON.get(type_name)
    if expected is Any or expected is None:
        return expected is Any or type_name not in PYTHON
    return isinstance(origin or annotation, type) and issubclass(origin or annotation, expected) \
        and not (expected is int and issubclass(annotation, bool))


def _columns(row: Any) -> list[Any] | None:
    """The types a row declares, one per column (None: no rows)."""
    if row is None:
        return None
    if isinstance(row, types.GenericAlias):
        return list(typing.get_args(row))
    hints = typing.get_type_hints(row)
    return [hints[field] for field in row._fields]


def _numbered(template: str) -> tuple[str, list[str]]:
    """A ``Sql`` template with libpq's placeholders for psycopg's (as psycopg sends it), and the names of
    its named ones in their order."""
    order: list[str] = []
    count = 0

    def number(match: re.Match[str]) -> str:
        nonlocal count
        if match.group(0) == "%%":
            return "%"
        if match.group(1) is None:
            count += 1
            return f"${count}"
        order.extend([match.group(1)] if match.group(1) not in order else [])
        return f"${order.index(match.group(1)) + 1}"

    return _PLACEHOLDER.sub(number, template), order


@pytest.mark.anyio
async def test_each_statement_returns_the_rows_it_declares(dsn: str, schema: str) -> None:
    """The server's own description of each statement, prepared on a migrated schema, against what the
    statement declares: as many columns as its row has fields (none when it declares none), each of a
    type its field holds; and for a ``Sql``, each parameter of a type its declaration gives (the server
    infers them as it does for psycopg's, which sends most without one)."""
    quoted = quote_identifier(schema)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await migrate(conn, quoted)
        cur = await conn.execute("SELECT oid::int, typname FROM pg_type")
        names = {oid: name for oid, name in await cur.fetchall()}
    with psycopg.connect(dsn, autocommit=True) as conn:
        wrong = {}
        for n, (name, statement) in enumerate(typed().items()):
            if statement.untyped:
                continue  # (test_every_statement_declares_its_rows names it)
            if isinstance(statement, wire.Statement):
                text, types_given = statement.for_schema(quoted)[0], statement._types
                params: list[Any] = []  # (sent as declared)
            else:
                assert isinstance(statement, Sql)
                numbered, order = _numbered(statement.for_schema(quoted))
                text, types_given = numbered.encode(), None
                hints = {} if statement.params is None else typing.get_type_hints(statement.params)
                params = [hints[name] for name in order] if statement.named else list(hints.values())
            prepared = conn.pgconn.prepare(f"t{n}".encode(), text, types_given)
            assert prepared.status == pq.ExecStatus.COMMAND_OK, (name, prepared.get_error_message())
            described = conn.pgconn.describe_prepared(f"t{n}".encode())
            columns = [names[described.ftype(i)] for i in range(described.nfields)]
            declared = _columns(statement.row)
            if declared is None:
                if columns:
                    wrong[name] = f"declares no rows, returns {columns}"
            elif len(declared) != len(columns) or not all(map(_fits, declared, columns)):
                wrong[name] = f"declares {declared}, returns {columns}"
            sent = [names[described.param_type(i)] for i in range(described.nparams)]
            if params and (len(params) != len(sent) or not all(map(_fits, params, sent))):
                wrong[name] = f"declares the parameters {params}, takes {sent}"
    assert wrong == {}
