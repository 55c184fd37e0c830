"""What ``@app.workflow`` and ``@app.step`` return: callables that know how to be durable.

Called outside any workflow, both are ordinary function calls. Inside a workflow, a step call is
journaled; a workflow is started with ``start``/``start_async``, which check and encode the arguments
before anything is written.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Generic, ParamSpec, TypeVar

from ._core import telemetry
from ._core.checks import (
    check_call,
    check_chosen_id,
    check_eta,
    check_expires,
    check_kwargs,
    check_many_ids,
    check_name,
    check_run_options,
    check_seconds,
)
from ._core.client import Client
from ._core.codec import encode_unchecked
from ._core.current import journaling
from ._core.debounce_options import (
    check_debounce_combination,
    check_debounce_key,
    check_debounce_max,
    check_debounce_window,
)
from ._core.engine.debounces import Debounce
from ._core.key_options import check_key, key_of
from ._core.registry import DEFAULT_MAX_ATTEMPTS, StepSpec, WorkflowSpec
from ._core.start_options import StartOptions
from ._core.starting import enqueue, enqueue_debounced, enqueue_many, enqueue_named, refuse_children
from ._core.sync import on_a_loop
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
        if not on_a_loop():
            return execution.call_step_from_thread(self.spec, args, kwargs)
        return execution.step_call(self.spec, args, kwargs)


@dataclass(frozen=True)
class Signature:
    """A workflow with (some of) its arguments, to be run as a canvas member (``wf.s(...)``): a
    chain prepends the previous member's result to ``args``, a chord's callback gets the group's.
    The arguments are checked to encode here; their types are checked where the member runs."""

    workflow: Workflow[Any, Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        encode_unchecked(self.args, self.kwargs, f"the arguments of {self.workflow.name}.s()",
                         self.workflow._client.registry.value_limit)


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

    def with_options(self, *, id: str | None = None, queue: str | None = None, priority: int | None = None,
                     delay: float | None = None, eta: datetime | None = None,
                     expires: datetime | timedelta | float | None = None, debounce: float | None = None,
                     debounce_key: str | None = None, debounce_max: float | None = None,
                     key: str | None = None) -> Starter[P, R]:
        """A starter with these options bound; see ``Starter.with_options``."""
        return Starter(self, StartOptions()).with_options(id=id, queue=queue, priority=priority, delay=delay,
                                                          eta=eta, expires=expires, debounce=debounce,
                                                          debounce_key=debounce_key, debounce_max=debounce_max,
                                                          key=key)

    def start(self, *args: P.args, **kwargs: P.kwargs) -> WorkflowHandle[R]:
        """Enqueue the workflow with its default options; see ``Starter.start``."""
        return Starter(self, StartOptions()).start(*args, **kwargs)

    def s(self, *args: Any, **kwargs: Any) -> Signature:
        """This workflow with (some of) its arguments, for ``pgflow.chain``, ``group`` and ``chord``."""
        return Signature(self, args, kwargs)

    async def start_async(self, *args: P.args, **kwargs: P.kwargs) -> WorkflowHandle[R]:
        """Async twin of ``start``."""
        return await Starter(self, StartOptions()).start_async(*args, **kwargs)

    def start_many(self, calls: Iterable[Sequence[Any]], *, ids: Sequence[str] | None = None,
                   ) -> list[WorkflowHandle[R]]:
        """Start one workflow per item of ``calls`` (each a tuple of positional arguments) in one
        statement; see ``Starter.start_many``."""
        return Starter(self, StartOptions()).start_many(calls, ids=ids)

    async def start_many_async(self, calls: Iterable[Sequence[Any]], *, ids: Sequence[str] | None = None,
                               ) -> list[WorkflowHandle[R]]:
        """Async twin of ``start_many``."""
        return await Starter(self, StartOptions()).start_many_async(calls, ids=ids)


class Starter(Generic[P, R]):
    """A workflow with options bound, as returned by ``with_options``."""

    def __init__(self, workflow: Workflow[P, R], options: StartOptions) -> None:
        self._workflow = workflow
        self._options = options

    def with_options(self, *, id: str | None = None, queue: str | None = None, priority: int | None = None,
                     delay: float | None = None, eta: datetime | None = None,
                     expires: datetime | timedelta | float | None = None, debounce: float | None = None,
                     debounce_key: str | None = None, debounce_max: float | None = None,
                     key: str | None = None) -> Starter[P, R]:
        """Options for the starts made through the result. ``eta`` (a timezone-aware datetime) is
        when it may start, instead of ``delay`` seconds from now; ``expires`` (an aware datetime, or
        seconds from the start call) is when a workflow that has not started yet is cancelled instead
        of run.

        ``debounce`` (seconds) with ``debounce_key`` (a string): the starts of this workflow with the
        same key collapse into one run, with the arguments of the latest, that begins once the key has
        had no start for ``debounce`` seconds, or at the latest ``debounce_max`` seconds after the
        burst's first start (default: 10 windows), so a key that never goes quiet still runs. Every
        start of the burst returns a handle of that run (the same id). A start made once the run was
        claimed begins the next burst: debouncing trades a run per start for at most one run waiting
        per key, never for a lost start. The run keeps the queue and priority of the start that
        created it; its arguments and expiry are the latest start's. Not with ``id``, ``delay`` or
        ``eta`` (the key names the run, the window says when it is due), not in ``start_many``, and
        not from a workflow's body (from a step, it is). Every refusal is a ValueError before
        anything is written.

        ``key`` (a non-empty string): what the start counts against in a queue with per-key limits
        (``app.queue(..., key_concurrency=, key_rate_limit=)``), in place of the key the workflow's key
        function would give. In a queue without them it changes nothing."""
        if id is not None:
            check_chosen_id(id)
        check_run_options(queue=queue, priority=priority)
        if delay is not None:
            delay = check_seconds(delay, "delay")
        if eta is not None:
            eta = check_eta(eta)
        expiry = None if expires is None else check_expires(expires)
        window = None if debounce is None else check_debounce_window(debounce)
        debounce_key_ = None if debounce_key is None else check_debounce_key(debounce_key)
        most = None if debounce_max is None else check_debounce_max(debounce_max)
        counted = None if key is None else check_key(key)
        changes: dict[str, Any] = {k: v for k, v in
                                   {"id": id, "queue": queue, "priority": priority, "delay": delay, "eta": eta,
                                    "expires": expiry, "debounce": window, "debounce_key": debounce_key_,
                                    "debounce_max": most, "key": counted}.items()
                                   if v is not None}
        options = replace(self._options, **changes)
        check_debounce_combination(window=options.debounce, most=options.debounce_max, id=options.id,
                                   delay=options.delay, eta=options.eta)
        options.timing()  # refuses delay with eta, and an expiry before the start
        return Starter(self._workflow, options)

    def start(self, *args: P.args, **kwargs: P.kwargs) -> WorkflowHandle[R]:
        """Enqueue the workflow; an id that exists returns its handle and starts nothing. A
        debounced start (see ``with_options``) returns the handle of its key's run."""
        # The span is the calling thread's, where the caller's trace is; the insert runs on a loop.
        debounce = self._debounced()
        with telemetry.starting(self._workflow.name, self._queue()) as span:
            inputs = self._workflow.spec.codec.encode_arguments(args, kwargs)
            key = self._key(args, kwargs)
            id, parent = new_id(self._options.id)
            span.set_attribute(telemetry.WORKFLOW_ID, id)
            if debounce is not None:
                return self._workflow._client.call(self._enqueue_debounced, id, inputs, debounce,
                                                   telemetry.traceparent(), key)
            return self._workflow._client.call(self._enqueue, id, parent, inputs, telemetry.traceparent(), key)

    async def start_async(self, *args: P.args, **kwargs: P.kwargs) -> WorkflowHandle[R]:
        """Async twin of ``start``."""
        debounce = self._debounced()
        with telemetry.starting(self._workflow.name, self._queue()) as span:
            inputs = self._workflow.spec.codec.encode_arguments(args, kwargs)
            key = self._key(args, kwargs)
            id, parent = new_id(self._options.id)
            span.set_attribute(telemetry.WORKFLOW_ID, id)
            if debounce is not None:
                return await self._enqueue_debounced(id, inputs, debounce, telemetry.traceparent(), key)
            return await self._enqueue(id, parent, inputs, telemetry.traceparent(), key)

    def _debounced(self) -> Debounce | None:
        """The start's debounce, checked; refused in a workflow's body. A body's starts are replayed
        after a crash, and a child's id comes from its journal position so that the replay finds the
        child it started; a debounced start's run is whichever the key has pending when the start is
        made, which a replay cannot find again. In a step the start is an effect like any other,
        repeated only if the step is (and a repeat joins the pending run, if it is still pending)."""
        debounce = self._options.debounced()
        if debounce is not None and journaling() is not None:
            raise ValueError(f"a debounced start of {self._workflow.name!r} cannot be made from a workflow's "
                             "body (a replay could not find the run it joined): make it from a step")
        return debounce

    def _queue(self) -> str:
        return self._options.queue or self._workflow.queue

    def _key(self, args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
        """The start's key: the one given, else the workflow's key function's (checked), else none."""
        if self._options.key is not None:
            return self._options.key
        function = self._workflow.spec.key
        return None if function is None else key_of(function, self._workflow.name, args, kwargs)

    def start_many(self, calls: Iterable[Sequence[Any]], *, ids: Sequence[str] | None = None,
                   ) -> list[WorkflowHandle[R]]:
        """Start one workflow per item of ``calls`` (each a tuple of positional arguments) in one
        statement, with this starter's queue, priority and delay; handles come back in order. Every
        argument is checked before anything is written. ``ids`` (one per call) make the starts
        idempotent as ``start`` is: an id that exists starts nothing and its handle comes back."""
        ids_, inputs, keys = self._many(calls, ids)
        with telemetry.starting(self._workflow.name, self._queue(), count=len(ids_)):
            return self._workflow._client.call(self._enqueue_many, ids_, inputs, parent_id(), telemetry.traceparent(),
                                               ids is not None, keys)

    async def start_many_async(self, calls: Iterable[Sequence[Any]], *, ids: Sequence[str] | None = None,
                               ) -> list[WorkflowHandle[R]]:
        """Async twin of ``start_many``."""
        ids_, inputs, keys = self._many(calls, ids)
        with telemetry.starting(self._workflow.name, self._queue(), count=len(ids_)):
            return await self._enqueue_many(ids_, inputs, parent_id(), telemetry.traceparent(), ids is not None, keys)

    def _many(self, calls: Iterable[Sequence[Any]], ids: Sequence[str] | None,
              ) -> tuple[list[str], list[bytes], list[str | None]]:
        """The ids, encoded arguments and keys of ``start_many``'s calls, all checked."""
        if self._options.id is not None:
            raise ValueError("start_many takes its ids from ids=, not from with_options(id=)")
        if self._options.debounce is not None or self._options.debounce_key is not None:
            raise ValueError("start_many cannot debounce: it makes one run per call, and debounced starts of "
                             "one key collapse into a single run (with the last call's arguments alone); call "
                             "start() for each item, or start_many without debounce")
        encode = self._workflow.spec.codec.encode_arguments
        inputs: list[bytes] = []
        keys: list[str | None] = []
        for call in calls:
            inputs.append(encode(check_call(call), {}))
            keys.append(self._key(call, {}))
        if ids is None:
            parent = journaling()
            if parent is not None:
                # One journal position for the whole call, as ``start`` takes one per child: a parent
                # replayed after a crash or a resume finds the children it started.
                position = parent.journal.take()
                return [f"{parent.workflow_id}.{position}.{n}" for n in range(len(inputs))], inputs, keys
            return [str(uuid.uuid4()) for _ in inputs], inputs, keys
        return check_many_ids(ids, len(inputs)), inputs, keys

    async def _enqueue_many(self, ids: list[str], inputs: list[bytes], parent: str | None,
                            traceparent: str | None, chosen: bool = False, keys: list[str | None] | None = None,
                            ) -> list[WorkflowHandle[R]]:
        workflow, options = self._workflow, self._options
        if ids and chosen:
            await refuse_children(workflow._client.runtime(), [check_chosen_id(id) for id in ids])
        if ids:
            await enqueue_many(workflow._client.runtime(), workflow.spec, ids, inputs, queue=options.queue,
                               priority=options.priority, delay=options.delay, parent=parent,
                               traceparent=traceparent, when=options.timing(), keys=keys)
        return [WorkflowHandle(workflow._client, id) for id in ids]

    async def _enqueue_debounced(self, id: str, inputs: bytes, debounce: Debounce, traceparent: str | None,
                                 key: str | None = None) -> WorkflowHandle[R]:
        """``id``: the run's, should this start begin one; the handle is of the run the key has."""
        workflow, options = self._workflow, self._options
        run = await enqueue_debounced(workflow._client.runtime(), workflow.spec, id, inputs, debounce,
                                      queue=options.queue, priority=options.priority, traceparent=traceparent,
                                      when=options.timing(), key=key)
        return WorkflowHandle(workflow._client, run)

    async def _enqueue(self, id: str, parent: str | None, inputs: bytes, traceparent: str | None,
                       key: str | None = None) -> WorkflowHandle[R]:
        workflow, options = self._workflow, self._options
        if options.id is not None:
            await refuse_children(workflow._client.runtime(), [check_chosen_id(id)])
        await enqueue(workflow._client.runtime(), workflow.spec, id, inputs, queue=options.queue,
                      priority=options.priority, delay=options.delay, parent=parent, traceparent=traceparent,
                      when=options.timing(), key=key)
        return WorkflowHandle(workflow._client, id)


def new_id(given: str | None) -> tuple[str, str | None]:
    """The id of a workflow about to start, and its parent (the workflow whose body starts it, if
    any). The id is the given one, or one derived from the parent's journal position, so that a
    parent replayed after a crash finds the child it started instead of starting a second one."""
    parent = journaling()
    if given is not None:
        return given, parent.workflow_id if parent is not None else None
    if parent is not None:
        return f"{parent.workflow_id}.{parent.journal.take()}", parent.workflow_id
    return str(uuid.uuid4()), None


def parent_id() -> str | None:
    """The workflow whose body is starting workflows here, if any."""
    parent = journaling()
    return parent.workflow_id if parent is not None else None


def start_by_name(client: Client, name: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None, *,
                  queue: str | None, id: str | None, priority: int | None, delay: float,
                  max_attempts: int | None, timeout: float | None) -> Callable[[], Awaitable[WorkflowHandle[Any]]]:
    """``App.start_by_name``: enqueue a workflow this process need not import. The arguments are
    stored unchecked (anything msgpack encodes); the worker that runs it checks them against the
    function's hints and records a failure when they do not fit. Options this process does not give
    come from the workflow's registration here, if it has one, else from the defaults.

    Everything is checked, and the id taken, here in the caller (a child's id comes from its parent's
    journal position, which only the caller's context knows); the enqueue is returned, to be awaited
    on the caller's loop or run for a sync caller."""
    check_name(name)
    spec = client.registry.workflows.get(name)
    timeout = check_run_options(queue=queue, priority=priority, max_attempts=max_attempts, timeout=timeout)
    inputs = encode_unchecked(args, check_kwargs(kwargs), f"the arguments of start_by_name({name!r})",
                              client.registry.value_limit)
    # (the registration's key function, as its other options: of the arguments as given)
    key = None if spec is None or spec.key is None else key_of(spec.key, name, args, kwargs or {})
    workflow_id, parent = new_id(None if id is None else check_chosen_id(id)[0])
    delay = check_seconds(delay, "delay")

    async def start() -> WorkflowHandle[Any]:
        if id is not None:
            await refuse_children(client.runtime(), [check_chosen_id(workflow_id)])
        await enqueue_named(
            client.runtime(), name, workflow_id, inputs,
            queue=queue or (spec.queue if spec else "default"),
            priority=priority if priority is not None else (spec.priority if spec else 0),
            delay=delay, max_attempts=max_attempts if max_attempts is not None else (
                spec.max_attempts if spec else DEFAULT_MAX_ATTEMPTS),
            timeout=timeout if timeout is not None else (spec.timeout if spec else None), parent=parent, key=key,
        )
        return WorkflowHandle(client, workflow_id)

    return start
