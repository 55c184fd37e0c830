"""Values: what arguments, results and step outputs may be, how they come back, and what is refused.

Typed parameters and return values are rebuilt from their hints (Structs, dataclasses, datetimes, bytes);
unannotated ones come back as builtins. A bad argument raises SerializationError in the caller, before
anything is written.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import msgspec
import pytest

import pgflow

from .helpers import KINDS, ONE_SERVER, TIMEOUT, Point, query, requeue

pytestmark = pytest.mark.anyio


@dataclass
class Box:
    label: str
    corners: list[Point]
    created: datetime  # naive


class Bundle(msgspec.Struct):
    point: Point
    box: Box
    blob: bytes
    nested: dict[str, list[dict[str, int | None]]]
    maybe: int | None
    when: datetime  # aware


Nested = dict[str, list[dict[str, int | None]]]

WHEN = datetime(2024, 2, 29, 23, 59, 58, 123456, tzinfo=UTC)
CREATED = datetime(2001, 1, 2, 3, 4, 5, 6)
BLOB = bytes(range(256)) + b"\x00\xff"
NESTED: Nested = {"a": [{"one": 1, "none": None}], "empty": [], "b": [{}, {"two": 2}]}


async def workflow_rows(dsn: str, schema: str) -> int:
    """Rows in the workflows table; 0 when the schema or table does not exist (yet)."""
    [(table,)] = await query(dsn, "SELECT to_regclass(%s)::text", f"{schema}.workflows")
    if table is None:
        return 0
    [(count,)] = await query(dsn, f"SELECT count(*) FROM {schema}.workflows")
    return int(count)


async def start(api: str, starter: Any, *args: Any, **kwargs: Any) -> pgflow.WorkflowHandle[Any]:
    """Start through the async twin, or through the sync one from a thread."""
    if api == "async":
        return await starter.start_async(*args, **kwargs)  # type: ignore[no-any-return]
    return await anyio.to_thread.run_sync(lambda: starter.start(*args, **kwargs))  # type: ignore[no-any-return]


async def result(api: str, handle: pgflow.WorkflowHandle[Any]) -> Any:
    if api == "async":
        return await handle.result_async(timeout=TIMEOUT)
    return await anyio.to_thread.run_sync(lambda: handle.result(timeout=TIMEOUT))


# -- typed round trips ------------------------------------------------------------------------------------


def build_carry(app: pgflow.App, kind: str, seen: list[dict[str, Any]]) -> pgflow.Workflow[Any, Bundle]:
    @app.step(name="values.shift")
    def shift(when: datetime) -> datetime:
        assert isinstance(when, datetime)
        return when + timedelta(days=1)

    @app.step(name="values.grow")
    async def grow(box: Box, blob: bytes) -> Box:
        return Box(box.label + "!", [*box.corners, Point(len(blob), 0)], box.created)

    def observe(point: Point, box: Box, blob: bytes, nested: Nested, maybe: int | None, when: datetime,
                shifted: datetime, grown: Box) -> None:
        seen.append({
            "point": type(point), "box": type(box), "corner": type(box.corners[0]), "created": type(box.created),
            "blob": type(blob), "nested": type(nested), "maybe": maybe, "when": when,
            "shifted": shifted, "grown": grown, "grown_corner": type(grown.corners[-1]),
        })

    if kind == "async":
        @app.workflow(name="values.carry")
        async def carry(point: Point, box: Box, blob: bytes, nested: Nested, maybe: int | None,
                        when: datetime) -> Bundle:
            shifted = await shift(when)
            grown = await grow(box, blob)
            observe(point, box, blob, nested, maybe, when, shifted, grown)
            return Bundle(point, grown, blob, nested, maybe, shifted)
    else:
        @app.workflow(name="values.carry")
        def carry(point: Point, box: Box, blob: bytes, nested: Nested, maybe: int | None,
                  when: datetime) -> Bundle:
            shifted = shift(when)
            grown = grow(box, blob)
            observe(point, box, blob, nested, maybe, when, shifted, grown)
            return Bundle(point, grown, blob, nested, maybe, shifted)

    return carry


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("api", ["async", "sync"])
async def test_typed_values_round_trip(app: pgflow.App, dsn: str, schema: str, kind: str, api: str) -> None:
    seen: list[dict[str, Any]] = []
    carry = build_carry(app, kind, seen)
    box = Box("crate", [Point(1, 2), Point(-3, 4)], CREATED)
    expected_box = Box("crate!", [Point(1, 2), Point(-3, 4), Point(len(BLOB), 0)], CREATED)

    async with app.worker(concurrency=4):
        with_none = await start(api, carry, Point(7, 8), box, BLOB, NESTED, None, WHEN)
        with_int = await start(api, carry, point=Point(0, 0), box=box, blob=b"", nested={}, maybe=5, when=WHEN)
        first = await result(api, with_none)
        second = await result(api, with_int)

    assert isinstance(first, Bundle)
    assert first == Bundle(Point(7, 8), expected_box, BLOB, NESTED, None, WHEN + timedelta(days=1))
    assert isinstance(first.box, Box) and isinstance(first.box.corners[0], Point)
    assert first.when.tzinfo is not None and first.when == WHEN + timedelta(days=1)
    assert first.box.created == CREATED and first.box.created.tzinfo is None
    assert second == Bundle(Point(0, 0), Box("crate!", [Point(1, 2), Point(-3, 4), Point(0, 0)], CREATED), b"",
                            {}, 5, WHEN + timedelta(days=1))

    # Inside the workflow the arguments arrived typed, as the hints say.
    expected_types = {"point": Point, "box": Box, "corner": Point, "created": datetime, "blob": bytes,
                      "nested": dict, "grown_corner": Point}
    for observed in seen:
        assert {k: observed[k] for k in expected_types} == expected_types
    assert sorted((s["maybe"] is None) for s in seen) == [False, True]

    # The same values read back from the table by another handle on the same app.
    assert await app.handle(with_none.id).result_async(timeout=TIMEOUT) == first


@pytest.mark.parametrize("kind", KINDS)
async def test_typed_step_outputs_replay_typed(app: pgflow.App, dsn: str, schema: str, kind: str) -> None:
    """On re-execution, step outputs come from the journal, rebuilt as datetime and dataclass."""
    seen: list[dict[str, Any]] = []
    carry = build_carry(app, kind, seen)
    box = Box("b", [Point(1, 1)], CREATED)

    async with app.worker(concurrency=4):
        handle = await carry.start_async(Point(1, 1), box, b"xyz", NESTED, 3, WHEN)
        first = await handle.result_async(timeout=TIMEOUT)
    await requeue(dsn, schema, handle.id)
    async with app.worker(concurrency=4):
        second = await handle.result_async(timeout=TIMEOUT)

    assert second == first
    assert len(seen) == 2
    replayed = seen[1]
    assert isinstance(replayed["shifted"], datetime) and replayed["shifted"] == WHEN + timedelta(days=1)
    assert isinstance(replayed["grown"], Box) and replayed["grown_corner"] is Point
    assert replayed["grown"] == seen[0]["grown"]


@pytest.mark.parametrize("kind", KINDS)
async def test_unannotated_parameter_accepts_anything_encodable(app: pgflow.App, kind: str) -> None:
    if kind == "async":
        @app.workflow(name="values.anything")
        async def anything(x, *rest, **extra):  # type: ignore[no-untyped-def]
            return [x, list(rest), extra]
    else:
        @app.workflow(name="values.anything")
        def anything(x, *rest, **extra):  # type: ignore[no-untyped-def]
            return [x, list(rest), extra]

    values: list[tuple[Any, Any]] = [
        (1, 1), (-2.5, -2.5), ("text", "text"), (True, True), (None, None), (b"\x00raw", b"\x00raw"),
        ([1, [2, "3"], {"k": None}], [1, [2, "3"], {"k": None}]),
        ((1, 2), [1, 2]),
        ({"k": {"n": [1, b"b"]}}, {"k": {"n": [1, b"b"]}}),
        (Point(1, 2), {"x": 1, "y": 2}),  # unannotated: builtins, not the Struct
        (Box("l", [Point(0, 1)], CREATED), {"label": "l", "corners": [{"x": 0, "y": 1}],
                                            "created": CREATED.isoformat()}),
        (WHEN, WHEN),
        (2**63 - 1, 2**63 - 1),
    ]
    async with app.worker(concurrency=4):
        handles = [await anything.start_async(value) for value, _ in values]
        extra = await anything.start_async(1, "two", 3.0, flag=True, blob=b"b")
        for handle, (_, expected) in zip(handles, values, strict=True):
            assert await handle.result_async(timeout=TIMEOUT) == [expected, [], {}]
        assert await extra.result_async(timeout=TIMEOUT) == [1, ["two", 3.0], {"flag": True, "blob": b"b"}]


# -- refused arguments: SerializationError, and nothing written --------------------------------------------


def build_refusers(app: pgflow.App) -> dict[str, pgflow.Workflow[Any, Any]]:
    @app.workflow(name="values.typed")
    async def typed(x: int, label: str = "none") -> int:
        return x

    @app.workflow(name="values.structured")
    def structured(p: Point, box: Box | None = None) -> int:
        return p.x

    @app.workflow(name="values.loose")
    async def loose(x, y=None):  # type: ignore[no-untyped-def]
        return x

    return {"typed": typed, "structured": structured, "loose": loose}


class _Opaque:
    pass


# (case, workflow, args factory, kwargs, fragments the message must contain)
REFUSED: list[tuple[str, str, Callable[[], tuple[Any, ...]], dict[str, Any], list[str]]] = [
    ("wrong type", "typed", lambda: ("seven",), {}, ["argument 'x'", "int"]),
    ("wrong keyword type", "typed", lambda: (7,), {"label": 8}, ["argument 'label'", "str"]),
    ("wrong struct field", "structured", lambda: (Point("a", 1),), {}, ["argument 'p'", "int"]),  # type: ignore[arg-type]
    ("wrong nested dataclass field", "structured",
     lambda: (Point(1, 1), Box("l", [Point(1, 1)], "not a date")), {}, ["argument 'box'"]),  # type: ignore[arg-type]
    ("missing argument", "typed", lambda: (), {}, ["missing", "'x'"]),
    ("unexpected keyword", "typed", lambda: (1,), {"z": 2}, ["unexpected keyword", "'z'"]),
    ("too many positionals", "typed", lambda: (1, "a", 3), {}, ["too many"]),
    ("unencodable object", "loose", lambda: (object(),), {}, ["argument 'x'", "object"]),
    ("unencodable custom class", "loose", lambda: (1,), {"y": _Opaque()}, ["argument 'y'", "_Opaque"]),
    ("unencodable inside a list", "loose", lambda: ([1, {"k": object()}],), {}, ["argument 'x'"]),
    ("socket", "loose", lambda: (socket.socket(),), {}, ["argument 'x'", "socket"]),
]


@ONE_SERVER  # arguments are checked in Python before any statement: the same on any server
@pytest.mark.parametrize("migrated", [pytest.param(False, id="fresh-schema", marks=pytest.mark.new_schema),
                                      pytest.param(True, id="migrated-schema")])
@pytest.mark.parametrize(("case", "flow", "make_args", "kwargs", "fragments"), REFUSED, ids=[r[0] for r in REFUSED])
async def test_refused_arguments_raise_and_write_nothing(
    app: pgflow.App, dsn: str, schema: str, migrated: bool, case: str, flow: str,
    make_args: Callable[[], tuple[Any, ...]], kwargs: dict[str, Any], fragments: list[str],
) -> None:
    flows = build_refusers(app)
    if migrated:
        await app.migrate_async()
    args = make_args()
    try:
        for api in ("async", "sync"):
            for starter in (flows[flow], flows[flow].with_options(id=f"refused-{api}")):
                with pytest.raises(pgflow.SerializationError) as refused:
                    await start(api, starter, *args, **kwargs)
                assert isinstance(refused.value, TypeError)
                for fragment in fragments:
                    assert fragment in str(refused.value), (fragment, str(refused.value))
                assert flows[flow].name in str(refused.value)
    finally:
        for value in [*args, *kwargs.values()]:
            if isinstance(value, socket.socket):
                value.close()

    assert await workflow_rows(dsn, schema) == 0
    if not migrated:
        # The refusal happened in the caller before any connection: not even the schema was created.
        assert await query(dsn, "SELECT to_regnamespace(%s)::text", schema) == [(None,)]


async def test_accepted_arguments_are_written(app: pgflow.App, dsn: str, schema: str) -> None:
    """The counterpart of the refusals: valid calls of the same workflows write one row each."""
    flows = build_refusers(app)
    await flows["typed"].start_async(7, label="x")
    await flows["structured"].start_async({"x": 1, "y": 2})  # a dict is decoded as the Struct it matches
    await flows["loose"].start_async([1, {"k": "v"}], y=b"b")
    assert await workflow_rows(dsn, schema) == 3


# -- values that cannot be stored on the way out ---------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_unencodable_result_fails_the_workflow_clearly(app: pgflow.App, kind: str) -> None:
    if kind == "async":
        @app.workflow(name="values.bad_result")
        async def bad_result() -> Any:
            return {"ok": 1, "lock": anyio.Lock()}
    else:
        @app.workflow(name="values.bad_result")
        def bad_result() -> Any:
            return {"ok": 1, "lock": _Opaque()}

    async with app.worker(concurrency=2):
        handle = await bad_result.start_async()
        with pytest.raises(pgflow.WorkflowFailed) as failed:
            await handle.result_async(timeout=TIMEOUT)
        assert await handle.status_async() == "failed"
    error = failed.value
    assert error.error_type.endswith("SerializationError")
    assert "result of workflow 'values.bad_result'" in error.message
    assert "cannot be stored" in error.message


@pytest.mark.parametrize("kind", KINDS)
async def test_a_result_that_breaks_its_hint_is_reported_within_the_contract(
    app: pgflow.App, kind: str,
) -> None:
    """``result`` returns the value or raises WorkflowFailed / WorkflowCancelled / TimeoutError (the
    API contract), and agrees with ``status``: a result the worker stored must be readable, or the
    workflow must not be recorded as succeeded."""
    if kind == "async":
        @app.workflow(name="values.liar")
        async def liar() -> int:
            return "not an int"  # type: ignore[return-value]
    else:
        @app.workflow(name="values.liar")
        def liar() -> int:
            return "not an int"  # type: ignore[return-value]

    async with app.worker(concurrency=2):
        handle = await liar.start_async()
        try:
            outcome: Any = await handle.result_async(timeout=TIMEOUT)
        except pgflow.WorkflowFailed as exc:
            outcome = exc
        status = await handle.status_async()
    if isinstance(outcome, pgflow.WorkflowFailed):
        assert status == "failed"
        assert "values.liar" in outcome.message or "int" in outcome.message
    else:
        assert (status, outcome) == ("succeeded", "not an int")


@pytest.mark.parametrize("kind", KINDS)
async def test_a_step_output_that_breaks_its_hint_replays_as_it_ran(
    app: pgflow.App, dsn: str, schema: str, kind: str,
) -> None:
    """Replay must reproduce the first run: a step whose output does not match its return hint may be
    refused, or passed on as it is, but the same journal must not succeed once and fail on replay."""
    runs: list[int] = []

    if kind == "async":
        @app.step(name="values.loose_step")
        async def loose_step() -> int:
            runs.append(1)
            return "seven"  # type: ignore[return-value]

        @app.workflow(name="values.uses_loose_step")
        async def flow() -> str:
            return repr(await loose_step())
    else:
        @app.step(name="values.loose_step")
        def loose_step() -> int:
            runs.append(1)
            return "seven"  # type: ignore[return-value]

        @app.workflow(name="values.uses_loose_step")
        def flow() -> str:
            return repr(loose_step())

    async def outcome(handle: pgflow.WorkflowHandle[str]) -> tuple[str, str]:
        async with app.worker(concurrency=2):
            try:
                return "succeeded", await handle.result_async(timeout=TIMEOUT)
            except pgflow.WorkflowFailed as exc:
                return "failed", exc.error_type

    handle = await flow.start_async()
    first = await outcome(handle)
    await requeue(dsn, schema, handle.id)
    second = await outcome(handle)
    assert runs, "the step never ran"
    assert second == first


@pytest.mark.parametrize("kind", KINDS)
async def test_unencodable_step_output_fails_the_workflow_clearly(
    app: pgflow.App, dsn: str, schema: str, kind: str,
) -> None:
    if kind == "async":
        @app.step(name="values.bad_output")
        async def bad_output() -> Any:
            return object()

        @app.workflow(name="values.calls_bad_output")
        async def flow() -> str:
            await bad_output()
            return "unreachable"
    else:
        @app.step(name="values.bad_output")
        def bad_output() -> Any:
            return object()

        @app.workflow(name="values.calls_bad_output")
        def flow() -> str:
            bad_output()
            return "unreachable"

    async with app.worker(concurrency=2):
        handle = await flow.start_async()
        with pytest.raises(pgflow.WorkflowFailed) as failed:
            await handle.result_async(timeout=TIMEOUT)
    assert failed.value.error_type.endswith("SerializationError")
    assert "output of step 'values.bad_output'" in failed.value.message
