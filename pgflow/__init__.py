"""pgflow: durable workflows, steps and streams with PostgreSQL as the only moving part."""

from ._core.runtime import Stats
from ._core.worker import Worker
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
from .version import __version__ as __version__
from .workflow import Starter, Step, Workflow

__all__ = [
    "App",
    "ConfigurationError",
    "NonDeterministicWorkflow",
    "PgflowError",
    "RetryPolicy",
    "SerializationError",
    "Starter",
    "Stats",
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
