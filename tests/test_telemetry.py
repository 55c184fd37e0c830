"""OpenTelemetry: the caller's trace continues in the worker, through the table, also after a crash
and takeover; step spans sit under their workflow's; exceptions are recorded; the metrics move.

The test process configures the SDK once (a global provider can be set only once per process), with
an in-memory exporter for spans, kept only during these tests, and an in-memory reader for metrics. Worker
processes trace with their own SDK (tests/apps/traced.py) and write their spans to a file.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import pgflow

from .apps import crashy
from .helpers import ONE_SERVER
from .processes import Processes, lines, result_of, wait_until

WAIT = 60.0


class Recording(InMemorySpanExporter):
    """Keeps spans only while a test of this module runs: the provider stays set for the rest of
    the session (a global provider cannot be unset), and other tests' spans are not wanted."""

    recording = False

    def export(self, spans: Any) -> Any:
        return super().export(spans) if self.recording else SpanExportResult.SUCCESS


class SDK:
    def __init__(self) -> None:
        self.spans = Recording()
        self.tracing = TracerProvider()
        self.tracing.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.metering = MeterProvider(metric_readers=[self.reader])

    def finished(self) -> list[ReadableSpan]:
        return list(self.spans.get_finished_spans())

    def metrics(self) -> dict[str, list[Any]]:
        """pgflow's instruments: name -> data points (cumulative since the session set them up)."""
        found: dict[str, list[Any]] = {}
        data = self.reader.get_metrics_data()
        for resource in data.resource_metrics if data else []:
            for scope in resource.scope_metrics:
                if scope.scope.name == "pgflow":
                    for metric in scope.metrics:
                        found[metric.name] = list(metric.data.data_points)
        return found


@pytest.fixture(scope="session")
def installed_sdk() -> Iterator[SDK]:
    """Set once per process: the tests of each server run apart, and a provider cannot be set twice."""
    sdk = SDK()
    trace.set_tracer_provider(sdk.tracing)
    metrics.set_meter_provider(sdk.metering)
    try:
        yield sdk
    finally:
        sdk.tracing.shutdown()
        sdk.metering.shutdown()


@pytest.fixture
def sdk(installed_sdk: SDK) -> Iterator[SDK]:
    installed_sdk.spans.recording = True
    try:
        yield installed_sdk
    finally:
        installed_sdk.spans.recording = False
        installed_sdk.spans.clear()


def hex_ids(span: ReadableSpan) -> tuple[str, str, str | None]:
    """(trace id, span id, parent span id) in hex, as the worker's file has them."""
    context = span.get_span_context()
    assert context is not None
    parent = None if span.parent is None else f"{span.parent.span_id:016x}"
    return f"{context.trace_id:032x}", f"{context.span_id:016x}", parent


def read_spans(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in lines(path)]


# -- one trace from the caller through worker processes, across a SIGKILL -------------------------------


@pytest.mark.slow
def test_the_callers_trace_continues_in_the_worker_process_and_after_a_takeover(
    sdk: SDK, app: pgflow.App, worker_env: dict[str, str], procs: Processes, tmp_path: Path,
) -> None:
    wf = crashy.build(app)
    effects, gate = tmp_path / "effects.txt", tmp_path / "gate"
    spans_a, spans_b = tmp_path / "spans-a.jsonl", tmp_path / "spans-b.jsonl"

    a = procs.worker("worker-A", "tests.apps.traced:app", {**worker_env, "PGFLOW_TEST_SPANS": str(spans_a)})
    with trace.get_tracer("test").start_as_current_span("request") as request:
        handle = wf.async_flow.start(str(effects), str(gate), 4)
    wait_until(lambda: "s2 start" in lines(effects), "step 2 to start in worker A", procs, a)
    a.signal(signal.SIGKILL)
    assert a.wait_exit() == -signal.SIGKILL
    gate.touch()
    b = procs.worker("worker-B", "tests.apps.traced:app", {**worker_env, "PGFLOW_TEST_SPANS": str(spans_b)})
    assert result_of(handle, procs) == crashy.expected(4)
    # The workflow span ends after the end is recorded, so wait for it rather than for the result.
    wait_until(lambda: any(s["name"].startswith("pgflow.workflow ") for s in read_spans(spans_b)),
               "worker B's workflow span", procs, b)

    trace_id, request_id, _ = hex_ids(request)  # type: ignore[arg-type]
    [start] = [s for s in sdk.finished() if s.name == f"pgflow.start {wf.async_flow.name}"
               and (s.attributes or {}).get("pgflow.workflow.id") == handle.id]
    start_trace, start_id, start_parent = hex_ids(start)
    assert (start_trace, start_parent) == (trace_id, request_id)
    assert dict(start.attributes or {}) == {"pgflow.workflow.id": handle.id, "pgflow.workflow.name": wf.async_flow.name,
                                            "pgflow.queue": "default"}

    # Worker A ended only step 1's span before it was killed; its workflow span never ended.
    [first] = read_spans(spans_a)
    assert (first["name"], first["trace_id"], first["attributes"]["pgflow.step.position"]) == (
        f"pgflow.step {wf.first.name}", trace_id, 0)
    # Worker B read the caller's traceparent with its claim: its workflow span (attempt 2) is a child
    # of the start span, and the steps it ran are children of its workflow span. Step 2's try in B is
    # its second (the one A's death cut short is counted).
    spans = read_spans(spans_b)
    [workflow] = [s for s in spans if s["name"] == f"pgflow.workflow {wf.async_flow.name}"]
    assert (workflow["trace_id"], workflow["parent_id"]) == (trace_id, start_id)
    assert workflow["attributes"] == {"pgflow.workflow.id": handle.id, "pgflow.workflow.name": wf.async_flow.name,
                                      "pgflow.queue": "default", "pgflow.workflow.attempt": 2,
                                      "pgflow.workflow.status": "succeeded"}
    assert first["parent_id"] != workflow["span_id"]  # A's workflow span: another attempt's
    steps = [s for s in spans if s["name"].startswith("pgflow.step ")]
    assert [(s["name"], s["attributes"]["pgflow.step.position"], s["attributes"]["pgflow.step.attempt"])
            for s in steps] == [(f"pgflow.step {wf.second_async.name}", 1, 2), (f"pgflow.step {wf.third.name}", 2, 1)]
    assert {(s["trace_id"], s["parent_id"]) for s in steps} == {(trace_id, workflow["span_id"])}


@ONE_SERVER  # the OpenTelemetry API in Python: the same on any server
def test_without_an_sdk_nothing_is_traced_or_stored(dsn: str, schema: str, tmp_path: Path) -> None:
    """A process with the API only: start works, and the workflow is stored without a traceparent."""
    script = (
        "import pgflow, sys\n"
        f"app = pgflow.App({dsn!r}, schema={schema!r})\n"
        "@app.workflow\n"
        "def plain() -> None: ...\n"
        "print(plain.start().id)\n"
        "app.close()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=WAIT,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    with psycopg.connect(dsn) as conn:
        row = conn.execute(f'SELECT traceparent FROM "{schema}".workflows WHERE id = %s',
                           (done.stdout.strip(),)).fetchone()
    assert row == (None,)


# -- in one process: span parents and exceptions for every kind of workflow and step ---------------------


@ONE_SERVER  # spans made in Python: the same on any server (the trace through the table is tested on both above)
@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_step_spans_sit_under_their_workflow_and_exceptions_are_recorded(
    sdk: SDK, app: pgflow.App, kind: str,
) -> None:
    @app.step
    async def fine_async(x: int) -> int:
        return x + 1

    @app.step
    def fine_sync(x: int) -> int:
        return x + 1

    @app.step(max_attempts=2, backoff=0.01)
    def broken(x: int) -> int:
        raise ValueError(f"broken {x}")

    if kind == "async":
        @app.workflow
        async def flow(x: int) -> int:
            return await broken(await fine_sync(await fine_async(x)))
    else:
        @app.workflow
        def flow(x: int) -> int:
            return broken(fine_sync(fine_async(x)))  # type: ignore[arg-type]

    async with app.worker(concurrency=2):
        handle = await flow.start_async(1)
        with anyio.fail_after(WAIT), pytest.raises(pgflow.WorkflowFailed):
            await handle.result_async()
        with anyio.fail_after(WAIT):
            while not [s for s in sdk.finished() if s.name == f"pgflow.workflow {flow.name}"]:
                await anyio.sleep(0.02)
    spans = [s for s in sdk.finished() if (s.attributes or {}).get("pgflow.workflow.id") == handle.id]
    [start] = [s for s in spans if s.name.startswith("pgflow.start ")]
    [workflow] = [s for s in spans if s.name.startswith("pgflow.workflow ")]
    steps = [s for s in spans if s.name.startswith("pgflow.step ")]
    trace_id, start_id, _ = hex_ids(start)
    assert hex_ids(workflow)[0::2] == (trace_id, start_id)
    workflow_id = hex_ids(workflow)[1]
    assert [(s.name, (s.attributes or {})["pgflow.step.attempt"]) for s in steps] == [
        (f"pgflow.step {fine_async.name}", 1), (f"pgflow.step {fine_sync.name}", 1),
        (f"pgflow.step {broken.name}", 1), (f"pgflow.step {broken.name}", 2)]
    assert {hex_ids(s)[0::2] for s in steps} == {(trace_id, workflow_id)}
    for failed in steps[2:]:
        assert failed.status.status_code == StatusCode.ERROR
        [event] = failed.events
        assert (event.name, (event.attributes or {})["exception.type"]) == ("exception", "ValueError")
    assert workflow.status.status_code == StatusCode.ERROR
    assert workflow.status.description == "ValueError: broken 3"
    assert [(e.name, (e.attributes or {})["exception.message"]) for e in workflow.events] == [
        ("exception", "broken 3")]
    assert (workflow.attributes or {})["pgflow.workflow.status"] == "failed"


# -- metrics --------------------------------------------------------------------------------------------


def total(points: list[Any], **attributes: str) -> float:
    """The sum of the counter points whose attributes include ``attributes``."""
    return sum(p.value for p in points if all(p.attributes.get(k) == v for k, v in attributes.items()))


def histogram(points: list[Any], **attributes: str) -> tuple[int, float]:
    """(count, sum) of the histogram points whose attributes include ``attributes``."""
    chosen = [p for p in points if all(p.attributes.get(k) == v for k, v in attributes.items())]
    return sum(p.count for p in chosen), sum(p.sum for p in chosen)


@ONE_SERVER  # metrics counted in Python: the same on any server
@pytest.mark.anyio
async def test_the_metrics_move(sdk: SDK, app: pgflow.App) -> None:
    tries: dict[int, int] = {}

    @app.step(max_attempts=2, backoff=0.01, retry_on=(ConnectionError,))
    async def flaky(i: int) -> int:
        tries[i] = tries.get(i, 0) + 1
        if tries[i] == 1:
            raise ConnectionError("first try")
        return i

    @app.workflow
    async def metered(i: int) -> int:
        for n in range(5):
            await pgflow.write_stream_async("out", n)
        await pgflow.close_stream_async("out")
        return await flaky(i)

    @app.workflow(queue="other")
    async def doomed() -> None:
        raise RuntimeError("no")

    name, queue = "pgflow.workflow.name", "pgflow.queue"
    before = sdk.metrics()
    handles = [*await metered.start_many_async([(1,), (2,)]), metered.start(3), await doomed.start_async()]
    async with app.worker(concurrency=4, queues=["default", "other"]):
        with anyio.fail_after(WAIT):
            assert [await h.result_async() for h in handles[:3]] == [1, 2, 3]
            with pytest.raises(pgflow.WorkflowFailed):
                await handles[3].result_async()
    after = sdk.metrics()

    def moved(metric: str, **attributes: str) -> float:
        return total(after[metric], **attributes) - total(before.get(metric, []), **attributes)

    assert moved("pgflow.workflows.started", **{name: metered.name, queue: "default"}) == 3
    assert moved("pgflow.workflows.started", **{name: doomed.name, queue: "other"}) == 1
    assert moved("pgflow.workflows.finished", **{name: metered.name, "pgflow.workflow.status": "succeeded"}) == 3
    assert moved("pgflow.workflows.finished", **{name: doomed.name, "pgflow.workflow.status": "failed"}) == 1
    assert moved("pgflow.step.attempts", **{"pgflow.step.name": flaky.name}) == 6  # each failed once, then ran
    chunks = moved("pgflow.stream.chunks")
    assert chunks >= 3 * 6  # 5 chunks and a close marker each (other tests' workers may add theirs)
    count, size = histogram(after["pgflow.stream.batch_size"])
    count0, size0 = histogram(before.get("pgflow.stream.batch_size", []))
    assert count > count0 and size - size0 == chunks  # every chunk went in some batch
    count, waited = histogram(after["pgflow.workflow.claim_delay"], **{name: metered.name})
    count0, waited0 = histogram(before.get("pgflow.workflow.claim_delay", []), **{name: metered.name})
    assert count - count0 == 3 and 0 <= waited - waited0 < 3 * WAIT

    # The two started together share the start_many span as their parent.
    spans = {hex_ids(s)[1]: s for s in sdk.finished()}
    parents = {hex_ids(s)[2] for s in spans.values() if s.name == f"pgflow.workflow {metered.name}"
               and (s.attributes or {}).get("pgflow.workflow.id") in (handles[0].id, handles[1].id)}
    [many] = [spans[p] for p in parents if p is not None]
    assert (many.name, (many.attributes or {}).get("pgflow.workflow.count")) == (f"pgflow.start_many {metered.name}", 2)
