"""OpenTelemetry spans around workflow executions and step calls.

Only the API is a dependency: with no SDK configured these spans cost next to nothing, and an
application that configures one sees every execution and step with its workflow id and attempt.
"""

from __future__ import annotations

from opentelemetry import trace

tracer = trace.get_tracer("pgflow")
