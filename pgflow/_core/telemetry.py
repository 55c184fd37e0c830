"""OpenTelemetry: spans for starting a workflow, running it and each step attempt, the caller's trace
carried to the worker through the table, and a handful of metrics.

Only the API is a dependency: with no SDK configured every span and instrument here is a no-op, and
nothing is stored with the workflow (but a trace context that came in from elsewhere, e.g. a request's
headers extracted by the API's propagator, is passed on). With one, ``start`` (and ``start_many``) opens a span in the
caller and stores its W3C ``traceparent`` in the workflow's row; whichever worker claims the workflow
(the first, or the one that takes it over after a crash) reads it back with the claim, so its
workflow span is a child of the caller's start span, and the step spans are children of that.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .status import Status as WorkflowStatus

tracer = trace.get_tracer("pgflow")
meter = metrics.get_meter("pgflow")
_w3c = TraceContextTextMapPropagator()

# Span and metric attributes.
WORKFLOW_ID = "pgflow.workflow.id"
WORKFLOW_NAME = "pgflow.workflow.name"
QUEUE = "pgflow.queue"
ATTEMPT = "pgflow.workflow.attempt"  # the claim: 1 for the first run, 2 after a takeover, ...
STATUS = "pgflow.workflow.status"
COUNT = "pgflow.workflow.count"  # workflows a start_many span started
STEP_NAME = "pgflow.step.name"
STEP_POSITION = "pgflow.step.position"
STEP_ATTEMPT = "pgflow.step.attempt"  # attempts of the step in this run, from 1

workflows_started = meter.create_counter(
    "pgflow.workflows.started", unit="{workflow}", description="workflows created by start, start_many or a schedule")
workflows_finished = meter.create_counter(
    "pgflow.workflows.finished", unit="{workflow}", description="workflow ends recorded, by status")
step_attempts = meter.create_counter(
    "pgflow.step.attempts", unit="{attempt}", description="step attempts started (replayed steps not counted)")
chunks_written = meter.create_counter(
    "pgflow.stream.chunks", unit="{chunk}", description="stream chunks committed (close markers included)")
batch_sizes = meter.create_histogram(
    "pgflow.stream.batch_size", unit="{chunk}", description="chunks per group-committed stream batch",
    explicit_bucket_boundaries_advisory=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 5000])
claim_delays = meter.create_histogram(
    "pgflow.workflow.claim_delay", unit="s",
    description="from a workflow being due (started, its delay over, or its dead worker's lease run out) "
                "to a worker claiming and starting it",
    explicit_bucket_boundaries_advisory=[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                                         10, 30, 60, 300, 3600])


_sdk_seen = False
_UNKNOWN = object()
_PROVIDER_IN_ENV = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ


def tracing() -> bool:
    """Whether an SDK is set up to receive spans. Without one every span is a no-op, but making one
    still costs a context switch in and out: for a no-op workflow, a tenth of its worker's time. The
    public lookup reads the environment on every call (a twentieth of a no-op's worker time), so
    until a provider is set only the API's global is looked at; a provider, once set, stays."""
    global _sdk_seen
    if _sdk_seen:
        return True
    if getattr(trace, "_TRACER_PROVIDER", _UNKNOWN) is None and not _PROVIDER_IN_ENV:
        return False
    _sdk_seen = not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    return _sdk_seen


def traceparent() -> str | None:
    """The current span as a W3C ``traceparent``; None without a valid span (no SDK, no trace)."""
    if not tracing():
        return None
    carrier: dict[str, str] = {}
    _w3c.inject(carrier)
    return carrier.get("traceparent")


def continued(stored: str | None) -> Context | None:
    """The context a stored ``traceparent`` names (None: the current one, for a workflow stored
    without a trace)."""
    return _w3c.extract({"traceparent": stored}) if stored else None


@contextmanager
def starting(name: str, queue: str, count: int | None = None) -> Iterator[Span]:
    """The caller's span around a start, or a start_many of ``count`` workflows; inside it,
    ``traceparent()`` is what to store with them. An exception (a bad argument, an id taken) is
    recorded on it."""
    if not tracing():
        yield trace.INVALID_SPAN
        return
    attributes: dict[str, Any] = {WORKFLOW_NAME: name, QUEUE: queue}
    if count is not None:
        attributes[COUNT] = count
    operation = "start" if count is None else "start_many"
    with tracer.start_as_current_span(f"pgflow.{operation} {name}", kind=SpanKind.PRODUCER,
                                      attributes=attributes) as span:
        yield span


_NO_SPAN: AbstractContextManager[Span] = nullcontext(trace.INVALID_SPAN)  # (reusable: it does nothing)


def running(name: str, queue: str, id: str, attempt: int, stored: str | None, waited: float | None,
            ) -> AbstractContextManager[Span]:
    """The worker's span of one execution, a child of the caller's start span when one was stored
    (with no SDK, nothing to enter: no generator per workflow)."""
    if waited is not None:
        claim_delays.record(max(0.0, waited), {WORKFLOW_NAME: name, QUEUE: queue})
    if not tracing():
        return _NO_SPAN
    attributes: dict[str, Any] = {WORKFLOW_ID: id, WORKFLOW_NAME: name, QUEUE: queue, ATTEMPT: attempt}
    return tracer.start_as_current_span(f"pgflow.workflow {name}", context=continued(stored), kind=SpanKind.CONSUMER,
                                        attributes=attributes)


def ended(span: Span, status: str, error: dict[str, Any] | None) -> None:
    """Mark a workflow span with the end its execution came to (recorded just after: ``finished``)."""
    if not span.is_recording():
        return
    span.set_attribute(STATUS, status)
    if status == WorkflowStatus.FAILED:
        detail = f"{error.get('type')}: {error.get('message')}" if error else None
        span.set_status(Status(StatusCode.ERROR, detail))


def finished(name: str, queue: str, status: str) -> None:
    """Count a workflow end, once it is recorded."""
    workflows_finished.add(1, {WORKFLOW_NAME: name, QUEUE: queue, STATUS: status})


def failed(exc: BaseException) -> None:
    """Record the exception a workflow ended with on its span (the span is ended by ``running``)."""
    trace.get_current_span().record_exception(exc)


@contextmanager
def step(name: str, workflow_id: str, position: int, attempt: int) -> Iterator[None]:
    """The span of one attempt of a step, under its workflow's span; its exception is recorded."""
    step_attempts.add(1, {STEP_NAME: name})
    if not tracing():
        yield
        return
    with tracer.start_as_current_span(f"pgflow.step {name}", attributes={
            WORKFLOW_ID: workflow_id, STEP_NAME: name, STEP_POSITION: position, STEP_ATTEMPT: attempt}):
        yield
