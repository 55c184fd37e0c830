"""One way to run a statement (issue 41): every statement pgflow sends is a named constant of its port's
module (the catalogue), and runs through the executor of ``_core/engine/database.py`` (``Database`` and
``Session``), which alone calls psycopg's ``execute`` or the libpq path of ``wire.py``. Read from the
source, so a new ``conn.execute`` anywhere fails here before it ships."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pgflow"
ENGINE = PACKAGE / "_core" / "engine"
EXECUTOR = {ENGINE / "database.py", ENGINE / "wire.py"}
# Calls that run a statement or take a connection to run one on: psycopg's (a connection's or a
# cursor's execute, a cursor, a pool's checkout) and the libpq path's.
RUNS = {"execute", "executemany", "cursor", "connection"}
WIRE = {"fetch", "fetch_then_durable"}
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
