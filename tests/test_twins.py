"""The sync and async twins cannot drift apart: every public ``x_async`` has an ``x`` with the same
parameters (names, kinds, defaults, hints) and both say what they do. Server-free: it reads signatures.
The twins' behaviour is tested side by side wherever a feature is (KINDS = ["async", "sync"])."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import pgflow
from pgflow import durable, streams
from pgflow._core.twins import blocking
from pgflow.workflow import Starter

OWNERS: list[Any] = [pgflow.App, pgflow.WorkflowHandle, pgflow.Workflow, Starter, durable, streams]


def pairs() -> Iterator[tuple[str, Callable[..., Any], Callable[..., Any]]]:
    for owner in OWNERS:
        for name, member in vars(owner).items() if inspect.ismodule(owner) else inspect.getmembers(owner):
            if name.endswith("_async") and not name.startswith("_") and callable(member):
                twin_name = name.removesuffix("_async")
                assert hasattr(owner, twin_name), f"{owner.__name__}.{name} has no blocking twin {twin_name}"
                yield f"{owner.__name__.rsplit('.', 1)[-1]}.{twin_name}", getattr(owner, twin_name), member


PAIRS = list(pairs())


def test_the_twins_found_cover_the_public_api() -> None:
    names = {name for name, _, _ in PAIRS}
    assert {"App.migrate", "App.close", "App.list_workflows", "App.health", "WorkflowHandle.result",
            "WorkflowHandle.stream", "WorkflowHandle.send", "Workflow.start", "Starter.start_many",
            "durable.recv", "streams.write_stream"} <= names
    assert len(PAIRS) >= 29


@pytest.mark.parametrize(("name", "twin", "original"), PAIRS, ids=[name for name, _, _ in PAIRS])
def test_each_twin_takes_the_same_parameters_and_has_a_docstring(
    name: str, twin: Callable[..., Any], original: Callable[..., Any],
) -> None:
    assert list(inspect.signature(twin).parameters.values()) == \
        list(inspect.signature(original).parameters.values()), name
    assert inspect.getdoc(twin), f"{name} has no docstring"
    assert inspect.getdoc(original), f"{name}_async has no docstring"


def test_a_derived_twin_carries_the_originals_name_signature_and_docstring() -> None:
    twin = pgflow.WorkflowHandle.result
    original = pgflow.WorkflowHandle.result_async
    assert twin.__name__ == "result" and twin.__qualname__ == "WorkflowHandle.result"
    assert inspect.signature(twin) == inspect.signature(original)
    assert twin.__doc__ == original.__doc__


def test_a_drifted_twin_is_caught() -> None:
    """The check above is not vacuous: a pair whose parameters differ compares unequal."""

    class Drifted:
        async def look_async(self, key: str, timeout: float | None = None) -> int:
            """Look."""
            return 0

        def look(self, key: str, timeout: float = 1.0) -> int:
            """Look."""
            return 0

    assert list(inspect.signature(Drifted.look).parameters.values()) != \
        list(inspect.signature(Drifted.look_async).parameters.values())


def test_blocking_refuses_what_is_not_an_async_twin() -> None:
    async def look() -> None:
        """Not named as a twin."""

    with pytest.raises(TypeError, match="'_async' method"):
        blocking(look)  # type: ignore[arg-type]
