"""What an App knows without touching the database: its settings, workflows, steps and queue limits.

Plain data: the runtime, the worker and the executions receive the pieces they need from here, so none
of them depends on the App (or on the public wrappers users hold).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ..cron import Cron
from ..errors import ConfigurationError
from ..retry import RetryPolicy
from .checks import (
    check_name,
    check_positive_seconds,
    check_priority,
    check_queue,
    check_run_options,
    check_schedulable,
    setting_up,
)
from .codec import DEFAULT_VALUE_LIMIT, FunctionCodec, decode
from .key_options import KeyFunction, check_key_function

NotifyMode = Literal["buffered", "off"]

# Runs of a workflow that a crash, a stop or a lost lease may cut short before it is given up (the
# default of ``max_attempts``; None: for ever). A step that kills its worker (a segfault, the OOM
# killer, os._exit) would otherwise crash-loop the fleet for ever; a run given back while it sleeps
# or waits costs nothing, and ``resume()`` starts the count afresh.
DEFAULT_MAX_ATTEMPTS = 20


@dataclass(frozen=True)
class Config:
    dsn: str
    schema: str = "pgflow"
    pool_size: int = 10
    notify: NotifyMode = "buffered"
    notify_interval: float = 0.005
    poll_interval: float = 1.0
    listen_idle: float = 30.0  # seconds without a waiter before the LISTEN connection is closed
    query_timeout: float = 10.0  # seconds without an answer before a connection is taken for dead
    retention: float | None = 7 * 24 * 3600.0  # seconds finished workflows are kept; None: for ever
    suspend_after: float = 5.0  # a wait longer than this (sleep, recv) gives the worker slot back
    listen_dsn: str | None = None  # the sessions (LISTEN, the fleet's service locks); None: dsn
    signal_key_period: float | None = 24 * 3600.0  # seconds a signal key is sealed with; None: until rotated by hand
    server_on_this_machine: bool | None = None  # whether the server shares this machine's cores; None: guessed

    @property
    def session_dsn(self) -> str:
        """Where the connections that need a server session of their own go: the LISTEN connection
        and the maintenance connection, whose advisory locks are held by its session."""
        return self.listen_dsn or self.dsn

    @property
    def pooled(self) -> bool:
        """Whether ``dsn`` may be a transaction-mode pooler: a ``listen_dsn`` of its own says so.
        Nothing then relies on the pool's connections keeping session state: no settings at
        connect time, no prepared statements."""
        return self.listen_dsn is not None and self.listen_dsn != self.dsn

    @property
    def channel(self) -> str:
        return self.channel_of(self.schema)

    @property
    def stream_channel(self) -> str:
        return self.stream_channel_of(self.schema)

    @staticmethod
    def channel_of(schema: str) -> str:
        """The NOTIFY channel of a schema's App."""
        return f"pgflow_{schema}"

    @staticmethod
    def stream_channel_of(schema: str) -> str:
        """The channel of a schema's stream news, apart from the rest: a batch of chunks sends a
        payload per few dozen chunks, which only the processes reading streams listen for (a
        fleet's workers would otherwise each receive every other worker's chunks). Spelled to fit
        PostgreSQL's 63 bytes beside the longest schema name, and never another schema's channel:
        ``pgflow_`` names a main channel, ``pgflows_`` a stream channel."""
        return f"pgflows_{schema}"


@dataclass(frozen=True)
class QueueLimits:
    concurrency: int | None
    rate_limit: int | None
    per: float
    key_concurrency: int | None = None  # per key (see engine/key_limits.py); ``per`` is both rates' period
    key_rate_limit: int | None = None


@dataclass(frozen=True, eq=False)
class StepSpec:
    """A step as the journal needs it: what to run, under which name, how to retry it."""

    fn: Callable[..., Any]
    name: str
    retry: RetryPolicy
    is_async: bool
    return_type: Any
    timeout: float | None = None  # seconds an attempt may run before it is cancelled and failed
    limit: int | None = None  # bytes of its encoded output

    @classmethod
    def of(cls, fn: Callable[..., Any], name: str, retry: RetryPolicy, timeout: float | None = None,
           limit: int | None = None) -> StepSpec:
        with setting_up():
            check_name(name, "a step name")
            if timeout is not None:
                timeout = check_positive_seconds(timeout, "a step's timeout")
        return cls(fn, name, retry, inspect.iscoroutinefunction(fn),
                   FunctionCodec(fn, f"step {name!r}").return_type, timeout, limit)


@dataclass(frozen=True, eq=False)
class WorkflowSpec:
    """A workflow as a worker needs it to claim, run and record it."""

    fn: Callable[..., Any]
    name: str
    queue: str
    priority: int
    max_attempts: int | None
    timeout: float | None
    schedule: Cron | None
    is_async: bool
    codec: FunctionCodec
    retry: RetryPolicy | None = None  # the body's own: run again from its journal after it raised
    key: KeyFunction | None = None  # the key of a start that gives none, from its arguments (key_options.py)

    @classmethod
    def of(cls, fn: Callable[..., Any], name: str, queue: str, priority: int, max_attempts: int | None,
           timeout: float | None, schedule: Cron | None, limit: int | None = None,
           retry: RetryPolicy | None = None, key: object = None) -> WorkflowSpec:
        with setting_up():
            check_name(name)
            check_queue(queue)  # both required here: None is no default
            check_priority(priority)
            timeout = check_run_options(max_attempts=max_attempts, timeout=timeout, timeout_what="a workflow's timeout")
            if schedule is not None:
                check_schedulable(fn, name)
            if retry is not None and not isinstance(retry, RetryPolicy):
                raise TypeError(f"a workflow's retry is a pgflow.RetryPolicy, got {retry!r}")
            key_function = check_key_function(key)
        return cls(fn, name, queue, priority, max_attempts, timeout, schedule,
                   inspect.iscoroutinefunction(fn), FunctionCodec(fn, f"workflow {name!r}", limit), retry,
                   key_function)

    @property
    def takes_tick(self) -> bool:
        return bool(inspect.signature(self.fn).parameters)


@dataclass
class Registry:
    value_limit: int = DEFAULT_VALUE_LIMIT  # bytes of any encoded value: arguments, results, outputs, events, messages
    workflows: dict[str, WorkflowSpec] = field(default_factory=dict)
    steps: dict[str, StepSpec] = field(default_factory=dict)
    queues: dict[str, QueueLimits] = field(default_factory=dict)

    def add_workflow(self, spec: WorkflowSpec) -> None:
        _refuse_twice(self.workflows, spec.name, "workflow")
        self.workflows[spec.name] = spec

    def add_step(self, spec: StepSpec) -> None:
        _refuse_twice(self.steps, spec.name, "step")
        self.steps[spec.name] = spec

    def decode_result(self, name: str, data: bytes) -> Any:
        """A workflow's recorded result, typed by its return hint when this process knows it."""
        spec = self.workflows.get(name)
        if spec is None:
            return decode(data)
        return spec.codec.decode_result(data)


def _refuse_twice(registered: dict[str, Any], name: str, what: str) -> None:
    """A second workflow or step under a name would silently take the first one's place: the journal
    knows entries by name, so recorded calls of the first would replay as the second's."""
    if name in registered:
        raise ConfigurationError(f"a {what} named {name!r} is already registered; pass name= to tell them apart")
