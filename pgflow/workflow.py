"""What ``@app.workflow`` and ``@app.step`` return: callables that know how to be durable.

Called outside any workflow, both are ordinary function calls. Inside a workflow, a step call is
journaled; a workflow is started with ``start``/``start_async``, which check and encode the arguments
before anything is written.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar

from .codec import FunctionCodec
from .context import journaling
from .cron import Cron
from .errors import ConfigurationError, WorkflowConflict
from .handle import WorkflowHandle
from .retry import RetryPolicy

if TYPE_CHECKING:
    from .app import App

P = ParamSpec("P")
R = TypeVar("R")


def qualified_name(fn: Callable[..., Any]) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


class Step(Generic[P, R]):
    """A function whose outcome, once recorded in a workflow's journal, is never produced again."""

    def __init__(self, fn: Callable[P, R], name: str, retry: RetryPolicy) -> None:
        self.fn = fn
        self.name = name
        self.retry = retry
        self.is_async = inspect.iscoroutinefunction(fn)
        self.return_type = FunctionCodec(fn, f"step {name!r}").return_type
        functools.update_wrapper(self, fn)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Any:
        execution = journaling()
        if execution is None:
            return self.fn(*args, **kwargs)
        position = execution.take_position()
        # Awaitable on an event loop (an async workflow, or async code anywhere in one); a plain
        # call in a thread (a sync workflow, or sync code an async workflow runs in a thread).
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return execution.call_step_from_thread(self, position, args, kwargs)
        return execution.call_step(self, position, args, kwargs)


@dataclass(frozen=True)
class StartOptions:
    id: str | None = None
    queue: str | None = None
    priority: int | None = None
    delay: float = 0.0


class Workflow(Generic[P, R]):
    """A durable function: started by id on a queue, run by any worker, resumed from its journal."""

    def __init__(self, app: App, fn: Callable[P, R], name: str, queue: str, priority: int,
                 max_attempts: int | None, timeout: float | None = None,
                 schedule: Cron | None = None) -> None:
        if max_attempts is not None and max_attempts < 1:
            raise ConfigurationError(f"max_attempts must be at least 1, got {max_attempts}")
        if timeout is not None and timeout <= 0:
            raise ConfigurationError(f"timeout must be a positive number of seconds, got {timeout}")
        self.app = app
        self.fn = fn
        self.name = name
        self.queue = queue
        self.priority = priority
        self.max_attempts = max_attempts
        self.timeout = timeout
        self.schedule = schedule
        self.is_async = inspect.iscoroutinefunction(fn)
        self.codec = FunctionCodec(fn, f"workflow {name!r}")
        if schedule is not None and len(inspect.signature(fn).parameters) > 1:
            raise ConfigurationError(
                f"scheduled workflow {name!r} takes no arguments or one (the tick's datetime)")
        functools.update_wrapper(self, fn)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """A plain call runs the function here and now; its steps join the caller's journal, if any."""
        return self.fn(*args, **kwargs)

    def with_options(self, *, id: str | None = None, queue: str | None = None,
                     priority: int | None = None, delay: float | None = None) -> Starter[P, R]:
        return Starter(self, StartOptions()).with_options(id=id, queue=queue, priority=priority, delay=delay)

    def start(self, *args: P.args, **kwargs: P.kwargs) -> WorkflowHandle[R]:
        return Starter(self, StartOptions()).start(*args, **kwargs)

    async def start_async(self, *args: P.args, **kwargs: P.kwargs) -> WorkflowHandle[R]:
        return await Starter(self, StartOptions()).start_async(*args, **kwargs)


class Starter(Generic[P, R]):
    """A workflow with options bound, as returned by ``with_options``."""

    def __init__(self, workflow: Workflow[P, R], options: StartOptions) -> None:
        self._workflow = workflow
        self._options = options

    def with_options(self, *, id: str | None = None, queue: str | None = None,
                     priority: int | None = None, delay: float | None = None) -> Starter[P, R]:
        if delay is not None and delay < 0:
            raise ValueError(f"delay must be >= 0 seconds, got {delay}")
        if id is not None and not id:
            raise ValueError("a workflow id must not be empty")
        changes: dict[str, Any] = {k: v for k, v in
                                   {"id": id, "queue": queue, "priority": priority, "delay": delay}.items()
                                   if v is not None}
        return Starter(self._workflow, replace(self._options, **changes))

    def start(self, *args: P.args, **kwargs: P.kwargs) -> WorkflowHandle[R]:
        """Enqueue the workflow; an id that exists returns its handle and starts nothing."""
        inputs = self._workflow.codec.encode_arguments(args, kwargs)
        id = self._id()
        return self._workflow.app.engine.call(self._enqueue, id, inputs)

    async def start_async(self, *args: P.args, **kwargs: P.kwargs) -> WorkflowHandle[R]:
        inputs = self._workflow.codec.encode_arguments(args, kwargs)
        return await self._enqueue(self._id(), inputs)

    def _id(self) -> str:
        """The given id, or one derived from the starting workflow's position, so that a parent
        replayed after a crash finds the child it started instead of starting a second one."""
        if self._options.id is not None:
            return self._options.id
        parent = journaling()
        if parent is not None:
            return f"{parent.workflow_id}.{parent.take_position()}"
        return str(uuid.uuid4())

    async def _enqueue(self, id: str, inputs: bytes) -> WorkflowHandle[R]:
        workflow, options = self._workflow, self._options
        engine = workflow.app.engine
        queue = options.queue or workflow.queue
        priority = workflow.priority if options.priority is None else options.priority
        created, name = await engine.db(lambda store: store.enqueue(
            id, workflow.name, queue, priority, inputs, options.delay, workflow.max_attempts,
            workflow.timeout,
        ))
        if name != workflow.name:
            raise WorkflowConflict(
                f"workflow id {id!r} already belongs to a workflow {name!r}, not {workflow.name!r}; "
                "choose another id"
            )
        if created:
            # Delayed ones too: an idle worker re-reads when the next workflow falls due.
            engine.ping(f"q:{queue}")
        return WorkflowHandle(workflow.app, id, workflow)


def make_step(fn: Callable[P, R], name: str | None, retry: RetryPolicy) -> Step[P, R]:
    return Step(fn, name or qualified_name(fn), retry)


def check_registrable(fn: object, what: str) -> None:
    if not callable(fn):
        raise ConfigurationError(f"@app.{what} decorates a function, got {fn!r}")
    if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
        raise ConfigurationError(f"@app.{what} cannot decorate a generator function: {fn!r}")

