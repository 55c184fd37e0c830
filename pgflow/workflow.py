"""What ``@app.workflow`` and ``@app.step`` return: callables that know how to be durable.

Called outside any workflow, both are ordinary function calls. Inside a workflow, a step call is
journaled; a workflow is started with ``start``/``start_async``, which check and encode the arguments
before anything is written.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, ParamSpec, TypeVar

from . import telemetry
from ._core.checks import check_delay, check_id, check_priority, check_queue
from ._core.client import Client
from ._core.execution import journaling
from ._core.registry import StepSpec, WorkflowSpec
from ._core.starting import enqueue, enqueue_many
from .handle import WorkflowHandle

P = ParamSpec("P")
R = TypeVar("R")


def qualified_name(fn: Callable[..., Any]) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


class Step(Generic[P, R]):
    """A function whose outcome, once recorded in a workflow's journal, is never produced again."""

    def __init__(self, spec: StepSpec) -> None:
        self.spec = spec
        self.fn = spec.fn
        self.name = spec.name
        self.retry = spec.retry
        functools.update_wrapper(self, spec.fn)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Any:
        execution = journaling()
        if execution is None:
            return self.fn(*args, **kwargs)
        # Awaitable on an event loop (an async workflow, or async code anywhere in one); a plain
        # call in a thread (a sync workflow, or sync code an async workflow runs in a thread).
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return execution.call_step_from_thread(self.spec, args, kwargs)
        return execution.step_call(self.spec, args, kwargs)


@dataclass(frozen=True)
class StartOptions:
    id: str | None = None
    queue: str | None = None
    priority: int | None = None
    delay: float = 0.0


class Workflow(Generic[P, R]):
    """A durable function: started by id on a queue, run by any worker, resumed from its journal."""

    def __init__(self, spec: WorkflowSpec, client: Client) -> None:
        self.spec = spec
        self.fn = spec.fn
        self.name = spec.name
        self.queue = spec.queue
        self.schedule = spec.schedule
        self._client = client
        functools.update_wrapper(self, spec.fn)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """A plain call runs the function here and now; its steps join the caller's journal, if any."""
        return self.fn(*args, **kwargs)  # type: ignore[no-any-return]

    def with_options(self, *, id: str | None = None, queue: str | None = None,
                     priority: int | None = None, delay: float | None = None) -> Starter[P, R]:
        return Starter(self, StartOptions()).with_options(id=id, queue=queue, priority=priority, delay=delay)

    def start(self, *args: P.args, **kwargs: P.kwargs) -> WorkflowHandle[R]:
        return Starter(self, StartOptions()).start(*args, **kwargs)

    async def start_async(self, *args: P.args, **kwargs: P.kwargs) -> WorkflowHandle[R]:
        return await Starter(self, StartOptions()).start_async(*args, **kwargs)

    def start_many(self, calls: Iterable[Sequence[Any]], *, ids: Sequence[str] | None = None,
                   ) -> list[WorkflowHandle[R]]:
        """Start one workflow per item of ``calls`` (each a tuple of positional arguments) in one
        statement; see ``Starter.start_many``."""
        return Starter(self, StartOptions()).start_many(calls, ids=ids)

    async def start_many_async(self, calls: Iterable[Sequence[Any]], *, ids: Sequence[str] | None = None,
                               ) -> list[WorkflowHandle[R]]:
        return await Starter(self, StartOptions()).start_many_async(calls, ids=ids)


class Starter(Generic[P, R]):
    """A workflow with options bound, as returned by ``with_options``."""

    def __init__(self, workflow: Workflow[P, R], options: StartOptions) -> None:
        self._workflow = workflow
        self._options = options

    def with_options(self, *, id: str | None = None, queue: str | None = None,
                     priority: int | None = None, delay: float | None = None) -> Starter[P, R]:
        if id is not None:
            check_id(id)
        if queue is not None:
            check_queue(queue)
        if priority is not None:
            check_priority(priority)
        if delay is not None:
            delay = check_delay(delay)
        changes: dict[str, Any] = {k: v for k, v in
                                   {"id": id, "queue": queue, "priority": priority, "delay": delay}.items()
                                   if v is not None}
        return Starter(self._workflow, replace(self._options, **changes))

    def start(self, *args: P.args, **kwargs: P.kwargs) -> WorkflowHandle[R]:
        """Enqueue the workflow; an id that exists returns its handle and starts nothing."""
        # The span is the calling thread's, where the caller's trace is; the insert runs on a loop.
        with telemetry.starting(self._workflow.name, self._queue()) as span:
            inputs = self._workflow.spec.codec.encode_arguments(args, kwargs)
            id = self._id()
            span.set_attribute(telemetry.WORKFLOW_ID, id)
            return self._workflow._client.call(self._enqueue, id, inputs, telemetry.traceparent())

    async def start_async(self, *args: P.args, **kwargs: P.kwargs) -> WorkflowHandle[R]:
        with telemetry.starting(self._workflow.name, self._queue()) as span:
            inputs = self._workflow.spec.codec.encode_arguments(args, kwargs)
            id = self._id()
            span.set_attribute(telemetry.WORKFLOW_ID, id)
            return await self._enqueue(id, inputs, telemetry.traceparent())

    def _queue(self) -> str:
        return self._options.queue or self._workflow.queue

    def start_many(self, calls: Iterable[Sequence[Any]], *, ids: Sequence[str] | None = None,
                   ) -> list[WorkflowHandle[R]]:
        """Start one workflow per item of ``calls`` (each a tuple of positional arguments) in one
        statement, with this starter's queue, priority and delay; handles come back in order. Every
        argument is checked before anything is written. ``ids`` (one per call) make the starts
        idempotent as ``start`` is: an id that exists starts nothing and its handle comes back."""
        ids_, inputs = self._many(calls, ids)
        with telemetry.starting(self._workflow.name, self._queue(), count=len(ids_)):
            return self._workflow._client.call(self._enqueue_many, ids_, inputs, telemetry.traceparent())

    async def start_many_async(self, calls: Iterable[Sequence[Any]], *, ids: Sequence[str] | None = None,
                               ) -> list[WorkflowHandle[R]]:
        ids_, inputs = self._many(calls, ids)
        with telemetry.starting(self._workflow.name, self._queue(), count=len(ids_)):
            return await self._enqueue_many(ids_, inputs, telemetry.traceparent())

    def _many(self, calls: Iterable[Sequence[Any]], ids: Sequence[str] | None) -> tuple[list[str], list[bytes]]:
        if self._options.id is not None:
            raise ValueError("start_many takes its ids from ids=, not from with_options(id=)")
        encode = self._workflow.spec.codec.encode_arguments
        inputs: list[bytes] = []
        for call in calls:
            if not isinstance(call, tuple | list):
                raise TypeError(f"start_many takes one tuple of arguments per workflow, e.g. [(1,), (2,)]; "
                                f"got {call!r:.80}")
            inputs.append(encode(tuple(call), {}))
        if ids is None:
            return [str(uuid.uuid4()) for _ in inputs], inputs
        if isinstance(ids, str) or len(ids) != len(inputs):
            raise ValueError(f"ids= gives one id per call: {len(inputs)} calls, got {ids!r:.80}")
        return [check_id(id) for id in ids], inputs

    async def _enqueue_many(self, ids: list[str], inputs: list[bytes], traceparent: str | None,
                            ) -> list[WorkflowHandle[R]]:
        workflow, options = self._workflow, self._options
        if ids:
            await enqueue_many(workflow._client.runtime(), workflow.spec, ids, inputs, queue=options.queue,
                               priority=options.priority, delay=options.delay, traceparent=traceparent)
        return [WorkflowHandle(workflow._client, id) for id in ids]

    def _id(self) -> str:
        """The given id, or one derived from the starting workflow's position, so that a parent
        replayed after a crash finds the child it started instead of starting a second one."""
        if self._options.id is not None:
            return self._options.id
        parent = journaling()
        if parent is not None:
            return f"{parent.workflow_id}.{parent.take_position()}"
        return str(uuid.uuid4())

    async def _enqueue(self, id: str, inputs: bytes, traceparent: str | None) -> WorkflowHandle[R]:
        workflow, options = self._workflow, self._options
        await enqueue(workflow._client.runtime(), workflow.spec, id, inputs, queue=options.queue,
                      priority=options.priority, delay=options.delay, traceparent=traceparent)
        return WorkflowHandle(workflow._client, id)
