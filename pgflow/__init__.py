"""pgflow: durable workflows, steps and streams with PostgreSQL as the only moving part."""

__version__ = "0.1.0"

from .app import App
from .errors import (
    ConfigurationError,
    NonDeterministicWorkflow,
    PgflowError,
    SerializationError,
    StepFailed,
    UnknownWorkflow,
    WorkflowCancelled,
    WorkflowConflict,
    WorkflowFailed,
)
from .handle import StepInfo, WorkflowHandle
from .retry import RetryPolicy
from .streams import (
    close_stream,
    close_stream_async,
    stream_offset,
    write_stream,
    write_stream_async,
)
from .worker import Worker
from .workflow import Starter, Step, Workflow

__all__ = [
    "App",
    "ConfigurationError",
    "NonDeterministicWorkflow",
    "PgflowError",
    "RetryPolicy",
    "SerializationError",
    "Starter",
    "Step",
    "StepFailed",
    "StepInfo",
    "UnknownWorkflow",
    "Worker",
    "Workflow",
    "WorkflowCancelled",
    "WorkflowConflict",
    "WorkflowFailed",
    "WorkflowHandle",
    "close_stream",
    "close_stream_async",
    "stream_offset",
    "write_stream",
    "write_stream_async",
]
