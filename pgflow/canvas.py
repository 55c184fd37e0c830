"""Celery's canvas, durably: ``chain``, ``group`` and ``chord`` of workflow signatures (``wf.s(...)``).

A canvas runs as a workflow of its own, ``pgflow.canvas``: its body starts each member as a child
workflow and waits for it. A child's id comes from the canvas's journal position
(``<canvas id>.<position>``), so a canvas replayed after its worker died finds the members it had
started, running or ended, and starts none twice; a member that was cut off is taken over by another
worker and replays its own journal. The plan travels as the canvas's argument, so any worker of its
queue runs it, whether or not it imports the members' code (members run on their own queues).

An App registers ``pgflow.canvas`` only when it is used, not as a workflow of every App: when this process
first builds a canvas of its workflows (``chain``, ``group``, ``chord``), and when a worker starts serving
the canvas's queue, ``"default"`` (``App.worker``). The second is for the usual deployment, where the
process that starts canvases (a web handler) is not the worker that runs them, and the worker's module
never touches the canvas: as a Celery worker runs the chains and chords a caller sends, with nothing
declared, any worker serving "default" runs canvases. An App that never builds a canvas, served by workers
of other queues, has no ``pgflow.canvas`` anywhere. A canvas sent to another queue
(``with_options(queue=...)``) needs a worker of that queue whose App has built a canvas before it started.

- ``chain(a.s(x), b.s(), c.s())``: a, then b with a's result as its first argument, then c with b's;
  the chain's result is the last one's.
- ``group(a.s(1), a.s(2))``: all at once; the result is the list of theirs, in order.
- ``chord(group(...), callback.s())``: the group, then the callback with the list of its results.

A member that fails fails its canvas with ``WorkflowFailed`` (the members already running go on; a
chord's callback does not run). Members may nest: a chain inside a group runs as a child canvas.

Each member's arguments are checked against its workflow's type hints at ``start``, as
``Workflow.start`` checks its own: a bad one raises ``SerializationError`` naming the workflow and the
argument, before anything is written. (A member's first argument that is an earlier member's result
is known only when it runs, and checked there.)
"""

from __future__ import annotations

import inspect
import threading
import typing
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Union

import msgspec

from ._core.checks import check_chosen_id, check_queue
from ._core.codec import checked
from ._core.registry import DEFAULT_MAX_ATTEMPTS, Registry, WorkflowSpec
from .errors import SerializationError
from .workflow import Signature, start_by_name

if TYPE_CHECKING:
    from ._core.client import Client
    from .handle import WorkflowHandle

__all__ = ["Canvas", "Signature", "chain", "chord", "group"]

CANVAS = "pgflow.canvas"  # the name of the workflow that runs a canvas
CANVAS_QUEUE = "default"  # the queue a canvas runs on unless with_options(queue=) says otherwise
_registering = threading.Lock()  # two threads building their first canvases register it once


class Call(msgspec.Struct, tag="call", frozen=True):
    """One member: a workflow by name, its arguments, and the options it is started with."""

    name: str
    args: list[Any]
    kwargs: dict[str, Any]
    queue: str
    priority: int
    max_attempts: int | None
    timeout: float | None


class Chain(msgspec.Struct, tag="chain", frozen=True):
    links: list[Node]


class Group(msgspec.Struct, tag="group", frozen=True):
    members: list[Node]


class Chord(msgspec.Struct, tag="chord", frozen=True):
    header: Group
    callback: Node


Node = Union[Call, Chain, Group, Chord]  # noqa: UP007 - msgspec resolves the recursive alias by name


def _call(signature: Signature) -> Call:
    spec = signature.workflow.spec
    return Call(spec.name, list(signature.args), dict(signature.kwargs), spec.queue, spec.priority,
                spec.max_attempts, spec.timeout)


@dataclass(frozen=True)
class Canvas:
    """A chain, group or chord ready to start: ``start``/``start_async`` give the handle of the
    ``pgflow.canvas`` workflow that runs it (its result is the canvas's); ``with_options`` takes the
    id and queue of that workflow. Arguments given to ``start`` are prepended to the first link of a
    chain, and to every member of a group."""

    plan: Node
    client: Client
    id: str | None = None
    queue: str | None = None

    def with_options(self, *, id: str | None = None, queue: str | None = None) -> Canvas:
        if id is not None:
            check_chosen_id(id)
        if queue is not None:
            check_queue(queue)
        return replace(self, id=self.id if id is None else id, queue=self.queue if queue is None else queue)

    def _starting(self, args: tuple[Any, ...]) -> Callable[[], Awaitable[WorkflowHandle[Any]]]:
        register(self.client)  # (made by chain/group/chord, which registered it; a Canvas made by hand too)
        check_plan(self.plan, list(args), self.client.registry)
        return start_by_name(self.client, CANVAS, (self.plan, list(args)), None, queue=self.queue, id=self.id,
                             priority=None, delay=0.0, max_attempts=None, timeout=None)

    async def start_async(self, *args: Any) -> WorkflowHandle[Any]:
        return await self._starting(args)()

    def start(self, *args: Any) -> WorkflowHandle[Any]:
        return self.client.call(self._starting(args))


Member = Signature | Canvas

_LATER = object()  # stands for a member's first argument that an earlier member's result gives


def check_plan(node: Node, given: list[Any] | None, registry: Registry) -> None:
    """Check every member's arguments against its workflow's hints, with ``given`` prepended, as the
    canvas will start it; ``given`` None: one value known only when the canvas runs (the previous
    link's result, or a chord's results) goes first. Raises SerializationError naming the workflow
    and the argument: at ``start``, not later in the canvas as a failure of a call the user never made."""
    if isinstance(node, Call):
        spec = registry.workflows.get(node.name)
        if spec is not None:  # (a member of this App's canvas is registered in it)
            _check_call(spec, node, given)
    elif isinstance(node, Chain):
        for n, link in enumerate(node.links):
            check_plan(link, given if n == 0 else None, registry)
    elif isinstance(node, Group):
        for member in node.members:
            check_plan(member, given, registry)
    else:
        check_plan(node.header, given, registry)
        check_plan(node.callback, None, registry)


def _check_call(spec: WorkflowSpec, call: Call, given: list[Any] | None) -> None:
    if given is not None:  # every argument known: the check of Workflow.start itself
        spec.codec.encode_arguments((*given, *call.args), call.kwargs)
        return
    label = f"workflow {spec.name!r}"
    signature = inspect.signature(spec.fn)
    try:
        bound = signature.bind(_LATER, *call.args, **call.kwargs)
    except TypeError as exc:
        raise SerializationError(f"{label} (its first argument an earlier member's result): {exc}") from exc
    hints = _hints(spec.fn)
    for name, value in bound.arguments.items():
        kind, hint = signature.parameters[name].kind, hints.get(name, Any)
        if kind is inspect.Parameter.VAR_POSITIONAL:
            value, hint = tuple(v for v in value if v is not _LATER), tuple[hint, ...]  # type: ignore[valid-type]
        elif kind is inspect.Parameter.VAR_KEYWORD:
            hint = dict[str, hint]  # type: ignore[valid-type]
        elif value is _LATER:
            continue
        checked(value, hint, f"argument {name!r} of {label}", spec.codec.limit)


def _hints(fn: Callable[..., Any]) -> dict[str, Any]:
    """The type hints the workflow's codec checks by (none where they do not resolve, as there)."""
    try:
        return typing.get_type_hints(fn, include_extras=True)
    except Exception:  # noqa: BLE001 - unresolvable forward references: no checking, as the codec does
        return {}


def _nodes(members: Iterable[Member], what: str) -> tuple[list[Node], Client]:
    if isinstance(members, Signature | Canvas):
        members = [members]
    nodes: list[Node] = []
    clients: set[int] = set()
    client: Client | None = None
    for member in members:
        if isinstance(member, Signature):
            nodes.append(_call(member))
            client = member.workflow._client
        elif isinstance(member, Canvas):
            nodes.append(member.plan)
            client = member.client
        else:
            raise TypeError(f"{what} takes signatures (my_workflow.s(...)) or other canvases, got {member!r:.80}")
        clients.add(id(client))
    if client is None:
        raise ValueError(f"{what} needs at least one member")
    if len(clients) > 1:
        raise ValueError(f"the members of a {what} belong to different Apps; a canvas runs in one")
    register(client)  # the first use of the canvas API: this App's workers run canvases from now on
    return nodes, client


def chain(*links: Member) -> Canvas:
    """Run ``links`` one after the other, each given the previous one's result as its first argument."""
    nodes, client = _nodes(links, "chain")
    return Canvas(Chain(nodes), client)


def group(*members: Member | Iterable[Member]) -> Canvas:
    """Run ``members`` at once; the result is the list of their results, in order. Takes the members
    as arguments or as one iterable (``group(add.s(i, i) for i in range(10))``)."""
    flat: list[Member] = []
    for member in members:
        flat.extend([member] if isinstance(member, Signature | Canvas) else list(member))
    nodes, client = _nodes(flat, "group")
    return Canvas(Group(nodes), client)


def chord(header: Canvas | Iterable[Member], callback: Member) -> Canvas:
    """Run the group ``header``, then ``callback`` with the list of its results as first argument."""
    if not isinstance(header, Canvas):
        header = group(*header)
    if not isinstance(header.plan, Group):
        raise TypeError("a chord's header is a group: chord(group(...), callback.s()) or chord([a.s(), b.s()], cb.s())")
    [done], client = _nodes([callback], "chord callback")
    if client is not header.client:
        raise ValueError("the header and the callback of a chord belong to different Apps; a canvas runs in one")
    return Canvas(Chord(header.plan, done), client)


def register(client: Client) -> None:
    """Register the workflow that runs canvases in ``client``'s registry, where workers find it, unless
    it is there already; not among the App's own ``workflows``, which are the user's. Called on the
    first use of the canvas API and by ``App.worker`` for a worker serving ``CANVAS_QUEUE``."""
    with _registering:
        if CANVAS not in client.registry.workflows:
            client.registry.add_workflow(workflow(client))


def workflow(client: Client) -> WorkflowSpec:
    """The workflow that runs canvases, starting their members through ``client``; registered by
    ``register``, and lent to ``check-replay``, which checks canvases' journals whether or not the App
    it checks has used the canvas."""

    async def start(node: Node, extra: list[Any]) -> WorkflowHandle[Any]:
        """Start one member as a child: a workflow, or a nested canvas."""
        if isinstance(node, Call):
            return await start_by_name(client, node.name, (*extra, *node.args), node.kwargs, queue=node.queue,
                                       id=None, priority=node.priority, delay=0.0, max_attempts=node.max_attempts,
                                       timeout=node.timeout)()
        return await start_by_name(client, CANVAS, (node, extra), None, queue=None, id=None, priority=None,
                                   delay=0.0, max_attempts=None, timeout=None)()

    async def run(node: Node, extra: list[Any]) -> Any:
        if isinstance(node, Call):
            return await (await start(node, extra)).result_async()
        if isinstance(node, Chain):
            value: Any = None
            for n, link in enumerate(node.links):
                value = await run(link, extra if n == 0 else [value])
            return value
        if isinstance(node, Group):
            handles = [await start(member, extra) for member in node.members]  # all running, then gathered
            return [await handle.result_async() for handle in handles]
        results = await run(node.header, extra)
        return await run(node.callback, [results])

    async def canvas(plan: Node, extra: list[Any]) -> Any:
        return await run(plan, extra)

    return WorkflowSpec.of(canvas, CANVAS, CANVAS_QUEUE, 0, DEFAULT_MAX_ATTEMPTS, None, None,
                           client.registry.value_limit)
