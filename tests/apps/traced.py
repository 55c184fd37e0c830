"""The crash workflows of crashy.py, served by a worker process that traces with the OpenTelemetry SDK.

Every span the worker ends is appended at once, one JSON line each, to the file named by
PGFLOW_TEST_SPANS (a SimpleSpanProcessor exports each span as it ends, so a worker SIGKILLed later
has written every span it ended before; the provider's own exit hook flushes the rest on a clean
stop). The test process reads the lines back to check the trace the caller started continues here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

import pgflow

from .crashy import build


class LineExporter(SpanExporter):
    """Each span as one line of JSON: the ids in hex, attributes, status and event names."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with open(self.path, "a", encoding="utf-8") as out:
            for span in spans:
                context, parent = span.get_span_context(), span.parent
                assert context is not None
                out.write(json.dumps({
                    "name": span.name, "trace_id": f"{context.trace_id:032x}", "span_id": f"{context.span_id:016x}",
                    "parent_id": None if parent is None else f"{parent.span_id:016x}",
                    "attributes": dict(span.attributes or {}), "status": span.status.status_code.name,
                    "events": [event.name for event in span.events],
                }) + "\n")
            out.flush()
        return SpanExportResult.SUCCESS


provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(LineExporter(os.environ["PGFLOW_TEST_SPANS"])))
trace.set_tracer_provider(provider)

app = pgflow.App()  # env-configured, like crashy's
flows = build(app)
