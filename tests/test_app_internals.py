"""The one seam of ``App``: pgflow's own tools (the pytest plugin, check-replay, the dashboard, Durable
Streams, the CLI) reach an App's insides only through ``app._internals()`` (``AppInternals``), never
through its other private attributes, so the App can change what it keeps without breaking them.

The guard reads pgflow's source: outside ``pgflow/app.py``, an expression that holds an App (a name or a
field annotated ``App``, or named ``app`` by the code's own convention) is never followed by a private
attribute other than ``_internals``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pgflow
from pgflow._core.internals import AppInternals, Pointing

PACKAGE = Path(pgflow.__file__).resolve().parent
ALLOWED = {"_internals"}


def _is_app_annotation(node: ast.expr | None) -> bool:
    if node is None:
        return False
    text = ast.unparse(node).strip("'\"")
    return text in ("App", "pgflow.App", "App | None", "pgflow.App | None")


class _Reads(ast.NodeVisitor):
    """The private attributes read from an App in one module: (line, the expression)."""

    def __init__(self) -> None:
        self.found: list[tuple[int, str]] = []
        self.app_names = {"app"}  # the code's convention; annotated names are added as they are met
        self.app_fields = {"app", "_app"}  # self.<field> holding an App

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) \
                    and _is_app_annotation(item.annotation):
                self.app_fields.add(item.target.id)
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
            if _is_app_annotation(arg.annotation):
                self.app_names.add(arg.arg)
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef  # noqa: N815 - ast.NodeVisitor's naming

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if _is_app_annotation(node.annotation):
            if isinstance(node.target, ast.Name):
                self.app_names.add(node.target.id)
            elif isinstance(node.target, ast.Attribute):
                self.app_fields.add(node.target.attr)
        self.generic_visit(node)

    def _holds_app(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.app_names
        return isinstance(node, ast.Attribute) and node.attr in self.app_fields

    def visit_Attribute(self, node: ast.Attribute) -> None:
        private = node.attr.startswith("_") and not node.attr.startswith("__")
        if private and node.attr not in ALLOWED and self._holds_app(node.value):
            self.found.append((node.lineno, ast.unparse(node)))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr", "hasattr") \
                and len(node.args) >= 2 and self._holds_app(node.args[0]) \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                and node.args[1].value.startswith("_") and node.args[1].value not in ALLOWED:
            self.found.append((node.lineno, ast.unparse(node)))
        self.generic_visit(node)


def private_reads(source: str) -> list[tuple[int, str]]:
    reads = _Reads()
    reads.visit(ast.parse(source))
    return reads.found


def test_no_module_outside_app_py_reads_a_private_attribute_of_app() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "app.py":
            continue
        found += [f"{path.relative_to(PACKAGE.parent)}:{line}: {text}"
                  for line, text in private_reads(path.read_text())]
    assert found == [], "go through app._internals() (pgflow/_core/internals.py) instead:\n" + "\n".join(found)


def test_the_guard_sees_each_way_of_reading_an_app_private() -> None:
    """(The guard itself: each form it must catch, and what it must let through.)"""
    caught = private_reads(
        "from pgflow import App\n"
        "def f(app, other: App, b: 'App') -> None:\n"
        "    app._client.call(1)\n"
        "    other._runtimes.reset()\n"
        "    b._dsn = None\n"
        "    getattr(app, '_settings')\n"
        "class Holder:\n"
        "    target: App\n"
        "    def g(self) -> None:\n"
        "        self.app._sync.stop()\n"
        "        self.target._config()\n")
    assert [line for line, _ in caught] == [3, 4, 5, 6, 10, 11]
    assert private_reads(
        "def f(app, workflow) -> None:\n"
        "    app._internals().runtime()\n"
        "    workflow._client\n"  # another class's private: not the App's
        "    app.__class__\n"
        "    app.registry\n") == []


@pytest.mark.anyio
async def test_the_seam_points_an_app_elsewhere_and_back_only_when_closed() -> None:
    """``point`` changes what the App resolves (schema, settings, a new clock) and puts everything back
    from ``pointing()``; an App in use on a loop refuses it and is left as it was."""
    app = pgflow.App("postgresql://nowhere.invalid/db", schema="before", suspend_after=3.0)
    internals = app._internals()
    assert isinstance(internals, AppInternals) and internals.registry is app.registry
    saved = internals.pointing()
    assert saved.dsn == "postgresql://nowhere.invalid/db" and saved.settings["schema"] == "before"
    clock = internals.clock
    internals.point(Pointing("postgresql://elsewhere.invalid/db", {**saved.settings, "schema": "during"}))
    assert app.schema == "during" and app.dsn == "postgresql://elsewhere.invalid/db"
    assert (await internals.config()).schema == "during" and internals.clock is not clock
    assert internals.runtime() is internals.runtime()  # this loop's, made once (nothing connects yet)
    with pytest.raises(RuntimeError, match="close the App"):
        internals.point(saved)
    assert app.schema == "during"  # refused: nothing changed
    await internals.close_here()
    internals.point(saved)
    assert app.schema == "before" and app.dsn == "postgresql://nowhere.invalid/db"
    assert (await internals.config()).suspend_after == 3.0
