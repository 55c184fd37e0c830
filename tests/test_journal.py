"""The step journal: replay of recorded steps, non-determinism, retries, and plain (unjournaled) calls.

Re-execution is produced for real: after a first run the workflow row is put back to ``queued`` with SQL
(keeping its recorded steps), and a worker runs it again, as it would after a crash.
"""

from __future__ import annotations

import pathlib
import pickle
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import pytest

import pgflow
from pgflow.retry import RetryPolicy

from .helpers import KINDS, TIMEOUT, Point, fail_to_end, query, requeue, run_to_end, running, step_rows

pytestmark = pytest.mark.anyio


@dataclass
class Labelled:
    label: str
    point: Point


class Summary(msgspec.Struct):
    total: int
    point: Point
    labelled: Labelled


class MyError(Exception):
    """A step's own exception type, defined at module level: a replay finds it loaded and raises it again."""


class Planted:
    """What a hostile row would hold: a pickle whose loading runs code (here, writes a file)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


# -- helpers ------------------------------------------------------------------------------------------------


def step_of(app: pgflow.App, kind: str, body: Callable[[], Any], name: str, **options: Any) -> pgflow.Step[Any, Any]:
    """A step without arguments that runs ``body``, as an ``async def`` or a ``def``."""
    if kind == "async":
        async def run() -> Any:
            return body()
    else:
        def run() -> Any:
            return body()
    return app.step(name=name, **options)(run)


def workflow_of(
    app: pgflow.App, kind: str, step: pgflow.Step[Any, Any], name: str = "one_step",
) -> pgflow.Workflow[Any, Any]:
    """A workflow that calls ``step`` once and returns its output, as an ``async def`` or a ``def``."""
    if kind == "async":
        async def flow() -> Any:
            return await step()
    else:
        def flow() -> Any:
            return step()
    return app.workflow(name=name)(flow)


def catching_workflow_of(
    app: pgflow.App, kind: str, step: pgflow.Step[Any, Any], name: str, catch: type[BaseException],
    caught: list[BaseException], answer: Callable[[BaseException], str],
) -> pgflow.Workflow[Any, Any]:
    """A workflow that calls ``step`` once and, when it raises ``catch``, keeps the exception in
    ``caught`` and returns ``answer(exc)``; as an ``async def`` or a ``def``."""
    if kind == "async":
        async def flow() -> Any:
            try:
                return await step()
            except catch as exc:
                caught.append(exc)
                return answer(exc)
    else:
        def flow() -> Any:
            try:
                return step()
            except catch as exc:
                caught.append(exc)
                return answer(exc)
    return app.workflow(name=name)(flow)


# -- replay of recorded steps -------------------------------------------------------------------------


def build_three_steps(
    app: pgflow.App, kind: str, calls: Counter[str], seen: list[list[type]],
) -> pgflow.Workflow[Any, Any]:
    """A workflow of three steps (async, sync, async) with side effects counted in ``calls``; each run of
    the workflow body appends the types of the step outputs it received to ``seen``."""

    @app.step(name="journal.add")
    async def add(a: int, b: int) -> int:
        calls["add"] += 1
        return a + b

    @app.step(name="journal.make_point")
    def make_point(x: int) -> Point:
        calls["make_point"] += 1
        return Point(x, x * 2)

    @app.step(name="journal.label")
    async def label(p: Point) -> Labelled:
        calls["label"] += 1
        return Labelled(f"p{p.x}", p)

    if kind == "async":
        @app.workflow(name="journal.flow")
        async def flow(x: int) -> Summary:
            calls["body"] += 1
            total = await add(x, 1)
            point = await make_point(total)
            labelled = await label(point)
            seen.append([type(total), type(point), type(labelled), type(labelled.point)])
            return Summary(total, point, labelled)
    else:
        @app.workflow(name="journal.flow")
        def flow(x: int) -> Summary:
            calls["body"] += 1
            total = add(x, 1)
            point = make_point(total)
            labelled = label(point)
            seen.append([type(total), type(point), type(labelled), type(labelled.point)])
            return Summary(total, point, labelled)

    return flow


@pytest.mark.parametrize("kind", KINDS)
async def test_recorded_steps_are_replayed_not_rerun(app: pgflow.App, dsn: str, schema: str, kind: str) -> None:
    calls: Counter[str] = Counter()
    seen: list[list[type]] = []
    flow = build_three_steps(app, kind, calls, seen)
    expected = Summary(5, Point(5, 10), Labelled("p5", Point(5, 10)))

    handle = await flow.start_async(4)
    assert await run_to_end(app, handle) == expected
    assert calls == {"body": 1, "add": 1, "make_point": 1, "label": 1}
    recorded = await step_rows(dsn, schema, handle.id)
    assert [(r[0], r[1], r[2], r[3]) for r in recorded] == [
        (0, "journal.add", 1, None), (1, "journal.make_point", 1, None), (2, "journal.label", 1, None),
    ]

    await requeue(dsn, schema, handle.id)
    result = await run_to_end(app, handle)

    assert calls == {"body": 2, "add": 1, "make_point": 1, "label": 1}, "a recorded step ran again"
    assert result == expected
    assert isinstance(result, Summary)
    # The replayed outputs were decoded from the journal to the steps' annotated return types.
    assert seen == [[int, Point, Labelled, Point]] * 2
    assert await query(dsn, f"SELECT attempt, status FROM {schema}.workflows WHERE id = %s", handle.id) == [
        (2, "succeeded")
    ]
    assert len(await step_rows(dsn, schema, handle.id)) == 3


@pytest.mark.parametrize("kind", KINDS)
async def test_only_unrecorded_steps_run_on_reexecution(app: pgflow.App, dsn: str, schema: str, kind: str) -> None:
    """A crash after the second step: the third was never recorded, so only it runs again."""
    calls: Counter[str] = Counter()
    seen: list[list[type]] = []
    flow = build_three_steps(app, kind, calls, seen)

    handle = await anyio.to_thread.run_sync(lambda: flow.start(1))
    first = await run_to_end(app, handle)
    await query(dsn, f"DELETE FROM {schema}.steps WHERE workflow_id = %s AND position = 2", handle.id)
    await requeue(dsn, schema, handle.id)

    async with running(app):
        second = await anyio.to_thread.run_sync(lambda: handle.result(timeout=TIMEOUT))
    assert second == first
    assert calls == {"body": 2, "add": 1, "make_point": 1, "label": 2}
    assert [r[1] for r in await step_rows(dsn, schema, handle.id)] == [
        "journal.add", "journal.make_point", "journal.label",
    ]


# -- non-determinism ----------------------------------------------------------------------------------


async def journal_of_three_steps(app: pgflow.App, kind: str) -> tuple[pgflow.WorkflowHandle[Any], Counter[str]]:
    """The three-step workflow started with 2 and run to its end once: the journal a re-execution meets.
    Its handle, and the counts of the step bodies that ran (``build_three_steps``)."""
    calls: Counter[str] = Counter()
    handle = await build_three_steps(app, kind, calls, []).start_async(2)
    await run_to_end(app, handle)
    return handle, calls


@pytest.mark.parametrize("kind", KINDS)
async def test_renamed_journal_entry_fails_as_nondeterministic(
    app: pgflow.App, dsn: str, schema: str, kind: str,
) -> None:
    handle, calls = await journal_of_three_steps(app, kind)

    await query(dsn, f"UPDATE {schema}.steps SET name = 'journal.renamed' WHERE workflow_id = %s AND position = 0",
                handle.id)
    await requeue(dsn, schema, handle.id)
    failure = await fail_to_end(app, handle)

    assert failure.error_type.endswith("NonDeterministicWorkflow")
    assert "journal.add" in failure.message and "journal.renamed" in failure.message
    assert calls["add"] == 1, "the step at the disputed position must not run"
    assert await handle.status_async() == "failed"


@pytest.mark.parametrize("kind", KINDS)
async def test_changed_code_at_a_recorded_position_fails_as_nondeterministic(
    app: pgflow.App, dsn: str, schema: str, kind: str,
) -> None:
    """The same workflow name, redeployed with a different first step, meets the old journal."""
    handle, calls = await journal_of_three_steps(app, kind)
    await requeue(dsn, schema, handle.id)

    async with pgflow.App(dsn, schema=schema, poll_interval=0.5) as changed:
        @changed.step(name="journal.other")
        def other(x: int) -> int:
            calls["other"] += 1
            return x

        if kind == "async":
            @changed.workflow(name="journal.flow")
            async def new_flow(x: int) -> int:
                return await other(x)
        else:
            @changed.workflow(name="journal.flow")
            def new_flow(x: int) -> int:
                return other(x)

        failure = await fail_to_end(changed, changed.handle(handle.id))

    assert failure.error_type.endswith("NonDeterministicWorkflow")
    assert "journal.other" in failure.message and "journal.add" in failure.message
    assert calls["other"] == 0
    assert calls["add"] == 1


# -- retries ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("wf_kind", KINDS)
@pytest.mark.parametrize("step_kind", KINDS)
async def test_step_retried_until_it_succeeds(
    app: pgflow.App, dsn: str, schema: str, wf_kind: str, step_kind: str,
) -> None:
    runs: list[int] = []

    def flaky() -> str:
        runs.append(len(runs) + 1)
        if len(runs) < 4:
            raise ConnectionError(f"failure {len(runs)}")
        return f"ok after {len(runs)}"

    step = step_of(app, step_kind, flaky, "flaky", max_attempts=4, backoff=0.01)
    flow = workflow_of(app, wf_kind, step)
    handle = await flow.start_async()
    assert await run_to_end(app, handle) == "ok after 4"
    assert runs == [1, 2, 3, 4]
    assert await step_rows(dsn, schema, handle.id) == [(0, "flaky", 4, None, None, True)]


@pytest.mark.parametrize("kind", KINDS)
async def test_retry_on_types_retries_only_matching_exceptions(
    app: pgflow.App, dsn: str, schema: str, kind: str,
) -> None:
    raised: list[type[Exception]] = []

    def picky() -> str:
        # The first failure matches retry_on (KeyError), the second does not (ValueError).
        error = KeyError("missing") if not raised else ValueError("bad value")
        raised.append(type(error))
        raise error

    step = step_of(app, kind, picky, "picky", max_attempts=5, backoff=0.01, retry_on=(KeyError,))
    handle = await workflow_of(app, kind, step).start_async()
    failure = await fail_to_end(app, handle)

    assert raised == [KeyError, ValueError]
    assert failure.error_type == "ValueError"
    assert failure.message == "bad value"
    assert await step_rows(dsn, schema, handle.id) == [(0, "picky", 2, "ValueError", "bad value", False)]


@pytest.mark.parametrize("kind", KINDS)
async def test_non_matching_exception_runs_once(app: pgflow.App, dsn: str, schema: str, kind: str) -> None:
    runs: list[int] = []

    def wrong() -> str:
        runs.append(1)
        raise ValueError("not retryable")

    step = step_of(app, kind, wrong, "wrong", max_attempts=4, backoff=0.01, retry_on=(KeyError,))
    handle = await workflow_of(app, kind, step).start_async()
    failure = await fail_to_end(app, handle)
    assert runs == [1]
    assert failure.error_type == "ValueError"
    assert await step_rows(dsn, schema, handle.id) == [(0, "wrong", 1, "ValueError", "not retryable", False)]


@pytest.mark.parametrize("kind", KINDS)
async def test_retry_on_predicate_decides(app: pgflow.App, dsn: str, schema: str, kind: str) -> None:
    messages = ["transient 1", "transient 2", "permanent"]
    runs: list[str] = []
    judged: list[str] = []

    def sometimes() -> str:
        runs.append(messages[len(runs)])
        raise RuntimeError(runs[-1])

    def transient(exc: BaseException) -> bool:
        judged.append(str(exc))
        return str(exc).startswith("transient")

    step = step_of(app, kind, sometimes, "sometimes", max_attempts=10, backoff=0.01, retry_on=transient)
    handle = await workflow_of(app, kind, step).start_async()
    failure = await fail_to_end(app, handle)
    assert runs == messages
    assert judged == messages
    assert (failure.error_type, failure.message) == ("RuntimeError", "permanent")
    assert await step_rows(dsn, schema, handle.id) == [(0, "sometimes", 3, "RuntimeError", "permanent", False)]


@pytest.mark.parametrize("wf_kind", KINDS)
@pytest.mark.parametrize("step_kind", KINDS)
async def test_exhausted_attempts_fail_the_workflow(
    app: pgflow.App, dsn: str, schema: str, wf_kind: str, step_kind: str,
) -> None:
    runs: list[int] = []

    def always() -> str:
        runs.append(1)
        raise MyError(f"always ({len(runs)})")

    step = step_of(app, step_kind, always, "always", max_attempts=3, backoff=0.01)
    handle = await workflow_of(app, wf_kind, step).start_async()
    failure = await fail_to_end(app, handle)

    assert len(runs) == 3
    assert failure.error_type.endswith("test_journal.MyError")
    assert failure.message == "always (3)"
    assert "MyError" in failure.traceback
    [row] = await step_rows(dsn, schema, handle.id)
    assert row[:3] == (0, "always", 3)
    assert row[3] is not None and row[3].endswith("test_journal.MyError")
    assert row[4:] == ("always (3)", False)


async def test_retries_are_not_replayed_again(app: pgflow.App, dsn: str, schema: str) -> None:
    """A step that needed retries is recorded once; on re-execution it is neither run nor retried."""
    runs: list[int] = []

    def flaky() -> int:
        runs.append(1)
        if len(runs) < 2:
            raise ConnectionError("once")
        return len(runs)

    step = step_of(app, "sync", flaky, "flaky", max_attempts=3, backoff=0.01)
    handle = await workflow_of(app, "async", step).start_async()
    assert await run_to_end(app, handle) == 2
    await requeue(dsn, schema, handle.id)
    assert await run_to_end(app, handle) == 2
    assert len(runs) == 2


# -- recorded exceptions ------------------------------------------------------------------------------


async def caught_then_replayed(
    app: pgflow.App, dsn: str, schema: str, step_kind: str, wf_kind: str, error: Exception,
    catch: type[BaseException], answer: Callable[[BaseException], str], expected: str,
) -> tuple[pgflow.WorkflowHandle[Any], list[BaseException]]:
    """A step that raises ``error``, in a workflow that catches ``catch`` and returns ``answer(exc)``: run
    to its end, then again from its journal. Both runs must return ``expected``, and the step must have
    run only the first time. The handle, and what the workflow caught in each run."""
    runs: list[int] = []
    caught: list[BaseException] = []

    def boom() -> str:
        runs.append(1)
        raise error

    step = step_of(app, step_kind, boom, "boom")
    flow = catching_workflow_of(app, wf_kind, step, "catching", catch, caught, answer)
    handle = await flow.start_async()
    assert await run_to_end(app, handle) == expected
    await requeue(dsn, schema, handle.id)
    assert await run_to_end(app, handle) == expected
    assert runs == [1], "the failed step ran again instead of replaying its exception"
    return handle, caught


@pytest.mark.parametrize("wf_kind", KINDS)
@pytest.mark.parametrize("step_kind", KINDS)
async def test_recorded_exception_replays_as_the_same_type(
    app: pgflow.App, dsn: str, schema: str, wf_kind: str, step_kind: str,
) -> None:
    handle, caught = await caught_then_replayed(
        app, dsn, schema, step_kind, wf_kind, MyError("bad input"), MyError, lambda exc: f"recovered from {exc}",
        expected="recovered from bad input")
    [row] = await step_rows(dsn, schema, handle.id)
    assert row[1] == "boom" and row[3] is not None and row[3].endswith("MyError")
    assert [type(exc) for exc in caught] == [MyError, MyError]
    assert str(caught[1]) == "bad input"


@pytest.mark.parametrize("kind", KINDS)
async def test_an_exception_of_a_class_not_found_by_name_replays_as_step_failed(
    app: pgflow.App, dsn: str, schema: str, kind: str,
) -> None:
    """An exception whose class cannot be found again by its name (here: a local class) replays as
    StepFailed naming it."""

    class LocalError(Exception):
        pass

    # (whatever the replay raises is caught)
    _, caught = await caught_then_replayed(
        app, dsn, schema, kind, kind, LocalError("cannot find me"), Exception, lambda exc: "caught", expected="caught")

    assert isinstance(caught[0], LocalError)
    replayed = caught[1]
    assert isinstance(replayed, pgflow.StepFailed)
    assert replayed.error_type.endswith("LocalError")
    assert replayed.message == "cannot find me"


async def test_a_pickle_planted_in_the_journal_is_never_loaded(app: pgflow.App, dsn: str, schema: str,
                                                                tmp_path: pathlib.Path) -> None:
    """A session that could write the steps table puts a pickle that runs code in a failed step's
    row (the column older versions kept pickled exceptions in). The replay raises the recorded type
    from the recorded data; the blob is never loaded."""
    marker = tmp_path / "the pickle ran"
    blob = pickle.dumps(Planted(str(marker)))
    pickle.loads(blob)  # (it does what it says: the file appears)
    assert marker.exists()
    marker.unlink()
    caught: list[BaseException] = []

    @app.step(name="planted.boom")
    async def boom() -> str:
        raise MyError("bad input", 7)

    @app.workflow(name="planted")
    async def flow() -> str:
        try:
            return await boom()
        except MyError as exc:
            caught.append(exc)
            return "caught"

    handle = await flow.start_async()
    assert await run_to_end(app, handle) == "caught"
    await query(dsn, f"UPDATE {schema}.steps SET exception = %s WHERE workflow_id = %s", blob, handle.id)
    await requeue(dsn, schema, handle.id)
    assert await run_to_end(app, handle) == "caught"
    assert not marker.exists(), "a blob read back from the journal was loaded: it ran as code"
    assert [type(exc) for exc in caught] == [MyError, MyError]
    assert caught[1].args == ("bad input", 7)


# -- RetryPolicy --------------------------------------------------------------------------------------


def test_delay_is_drawn_from_the_upper_half_of_the_ceiling() -> None:
    policy = RetryPolicy(max_attempts=10, backoff=1.0, backoff_rate=2.0, max_backoff=5.0)
    for attempt, ceiling in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 5.0), (5, 5.0), (9, 5.0)]:
        delays = [policy.delay(attempt) for _ in range(300)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays), (attempt, min(delays), max(delays))
        assert len(set(delays)) > 1, "no jitter"


def test_delay_with_rate_one_is_constant_ceiling() -> None:
    policy = RetryPolicy(max_attempts=5, backoff=0.2, backoff_rate=1.0)
    for attempt in (1, 2, 4):
        assert all(0.1 <= policy.delay(attempt) <= 0.2 for _ in range(100))


def test_zero_backoff_means_no_wait() -> None:
    assert RetryPolicy(max_attempts=3, backoff=0.0).delay(2) == 0.0


def test_should_retry_counts_attempts() -> None:
    policy = RetryPolicy(max_attempts=3)
    error = RuntimeError("x")
    assert policy.should_retry(error, 1)
    assert policy.should_retry(error, 2)
    assert not policy.should_retry(error, 3)
    assert not policy.should_retry(error, 4)
    assert not RetryPolicy().should_retry(error, 1), "max_attempts=1 (the default) never retries"


def test_should_retry_matches_types_and_subclasses() -> None:
    policy = RetryPolicy(max_attempts=5, retry_on=(LookupError, ConnectionError))
    assert policy.should_retry(KeyError("k"), 1)
    assert policy.should_retry(IndexError("i"), 1)
    assert policy.should_retry(ConnectionResetError("c"), 1)
    assert not policy.should_retry(ValueError("v"), 1)


def test_should_retry_with_a_predicate() -> None:
    policy = RetryPolicy(max_attempts=5, retry_on=lambda exc: "again" in str(exc))
    assert policy.should_retry(RuntimeError("try again"), 1)
    assert not policy.should_retry(RuntimeError("give up"), 1)
    assert not policy.should_retry(RuntimeError("try again"), 5)


def test_should_retry_never_retries_base_exceptions() -> None:
    policy = RetryPolicy(max_attempts=5, retry_on=(BaseException,))
    assert not policy.should_retry(KeyboardInterrupt(), 1)
    assert not policy.should_retry(SystemExit(1), 1)
    assert not RetryPolicy(max_attempts=5, retry_on=lambda exc: True).should_retry(KeyboardInterrupt(), 1)


@pytest.mark.parametrize("kwargs", [
    {"max_attempts": 0}, {"max_attempts": -1}, {"backoff": -0.1}, {"max_backoff": -1.0},
    {"backoff_rate": 0.5},
])
def test_bad_policy_arguments_raise(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)


def test_bad_step_retry_arguments_raise_at_decoration() -> None:
    app = pgflow.App("postgresql://unused.invalid/none")  # nothing connects until first use
    with pytest.raises(ValueError):
        @app.step(max_attempts=0)
        def never() -> None: ...
    assert not app.steps


# -- plain calls --------------------------------------------------------------------------------------


@pytest.mark.new_schema  # nothing, not even the schema, is made
async def test_steps_outside_a_workflow_are_plain_calls(app: pgflow.App, dsn: str, schema: str) -> None:
    calls: Counter[str] = Counter()

    @app.step(max_attempts=3)
    def double(x: int) -> int:
        calls["double"] += 1
        return x * 2

    @app.step
    async def triple(x: int) -> int:
        calls["triple"] += 1
        return x * 3

    assert double(4) == 8
    assert await triple(4) == 12
    assert await anyio.to_thread.run_sync(double, 5) == 10
    assert calls == {"double": 2, "triple": 1}

    # A plain call is not retried: the function runs once and its exception propagates.
    @app.step(max_attempts=3, backoff=0.01)
    def failing() -> None:
        calls["failing"] += 1
        raise MyError("plain")

    with pytest.raises(MyError):
        failing()
    assert calls["failing"] == 1
    # Nothing went to the database: not even the schema was created.
    assert await query(dsn, "SELECT to_regclass(%s)", f"{schema}.steps") == [(None,)]


@pytest.mark.parametrize("wf_kind", KINDS)
@pytest.mark.parametrize("step_kind", KINDS)
async def test_a_step_inside_a_step_is_a_plain_call(
    app: pgflow.App, dsn: str, schema: str, wf_kind: str, step_kind: str,
) -> None:
    calls: Counter[str] = Counter()

    if step_kind == "async":
        @app.step(name="inner")
        async def inner(x: int) -> int:
            calls["inner"] += 1
            return x + 1

        @app.step(name="outer")
        async def outer(x: int) -> int:
            calls["outer"] += 1
            return await inner(x) + await inner(x * 10)
    else:
        @app.step(name="inner")
        def inner(x: int) -> int:
            calls["inner"] += 1
            return x + 1

        @app.step(name="outer")
        def outer(x: int) -> int:
            calls["outer"] += 1
            return inner(x) + inner(x * 10)  # type: ignore[no-any-return]

    if wf_kind == "async":
        @app.workflow(name="nesting")
        async def flow(x: int) -> int:
            return await outer(x) + await outer(x + 1)
    else:
        @app.workflow(name="nesting")
        def flow(x: int) -> int:
            return outer(x) + outer(x + 1)  # type: ignore[no-any-return]

    handle = await flow.start_async(1)
    assert await run_to_end(app, handle) == (2 + 11) + (3 + 21)
    assert calls == {"outer": 2, "inner": 4}
    rows = await step_rows(dsn, schema, handle.id)
    assert [(r[0], r[1]) for r in rows] == [(0, "outer"), (1, "outer")]
