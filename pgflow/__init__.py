"""pgflow: durable workflows, steps and streams with PostgreSQL as the only moving part."""

from ._core.runtime import Stats
from ._core.worker import Worker
from .app import App
from .canvas import Canvas, Signature, chain, chord, group
from .checkreplay import Mismatch, ReplayReport, check_replay, check_replay_async
from .context import attempt, step_attempt, workflow_id
from .durable import recv, recv_async, set_event, set_event_async, sleep, sleep_async
from .errors import (
    CannotResume,
    ConfigurationError,
    EmbeddedUnavailable,
    MaxAttemptsExceeded,
    NonDeterministicWorkflow,
    PgflowError,
    SerializationError,
    StepFailed,
    StepTimeout,
    UnknownWorkflow,
    WorkflowCancelled,
    WorkflowConflict,
    WorkflowExpired,
    WorkflowFailed,
    WorkflowTimeout,
)
from .handle import WorkflowHandle
from .patches import deprecate_patch, patched, patched_async
from .records import StepInfo, StreamInfo, WorkflowInfo, WorkflowRecord
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
    "Canvas",
    "CannotResume",
    "ConfigurationError",
    "EmbeddedUnavailable",
    "MaxAttemptsExceeded",
    "Mismatch",
    "NonDeterministicWorkflow",
    "PgflowError",
    "ReplayReport",
    "RetryPolicy",
    "SerializationError",
    "Signature",
    "Starter",
    "Stats",
    "Step",
    "StepFailed",
    "StepInfo",
    "StepTimeout",
    "StreamInfo",
    "UnknownWorkflow",
    "Worker",
    "Workflow",
    "WorkflowCancelled",
    "WorkflowConflict",
    "WorkflowExpired",
    "WorkflowFailed",
    "WorkflowHandle",
    "WorkflowInfo",
    "WorkflowRecord",
    "WorkflowTimeout",
    "attempt",
    "chain",
    "check_replay",
    "check_replay_async",
    "chord",
    "close_stream",
    "close_stream_async",
    "deprecate_patch",
    "group",
    "patched",
    "patched_async",
    "recv",
    "recv_async",
    "set_event",
    "set_event_async",
    "sleep",
    "sleep_async",
    "step_attempt",
    "stream_offset",
    "workflow_id",
    "write_stream",
    "write_stream_async",
]
