"""Putting a workflow on its queue: one place for ``start``, ``start_async`` and the cron service."""

from __future__ import annotations

from ..errors import WorkflowConflict
from . import telemetry
from .current import journaling
from .engine.debounces import Debounce
from .engine.starts import NO_TIMING, NewWorkflows, Timing
from .registry import WorkflowSpec
from .runtime import Runtime
from .signals import News
from .signals import keys as signal_keys


async def enqueue(runtime: Runtime, workflow: WorkflowSpec, id: str, inputs: bytes, *, queue: str | None = None,
                  priority: int | None = None, delay: float = 0.0, parent: str | None = None,
                  traceparent: str | None = None, when: Timing | None = None, key: str | None = None) -> bool:
    """Insert the workflow unless ``id`` exists; True when this call created it. An id taken by a
    workflow of another name raises WorkflowConflict. ``traceparent``: the caller's trace, stored."""
    return await enqueue_named(runtime, workflow.name, id, inputs, queue=queue or workflow.queue,
                               priority=workflow.priority if priority is None else priority, delay=delay,
                               max_attempts=workflow.max_attempts, timeout=workflow.timeout, parent=parent,
                               traceparent=traceparent, when=when, key=key)


async def enqueue_named(runtime: Runtime, name: str, id: str, inputs: bytes, *, queue: str, priority: int,
                        delay: float, max_attempts: int | None, timeout: float | None,
                        parent: str | None = None, traceparent: str | None = None,
                        when: Timing | None = None, key: str | None = None) -> bool:
    """``enqueue`` for a workflow known by its name only (``start_by_name``). ``parent``: the
    workflow whose body starts it, cancelled with it. ``key``: what it counts against in a queue
    with per-key limits (None: no key)."""
    starter = journaling()
    if starter is not None and not await starter.before_child_start([id], name):
        return False
    await runtime.store()
    signals = runtime.signals
    news = News([signal_keys.queue(queue)])  # delayed ones too: idle workers re-read when the next falls due
    hearing = signals.hearing()
    new = NewWorkflows(name=name, queue=queue, priority=priority, delay=delay, max_attempts=max_attempts,
                       timeout=timeout, parent=parent, traceparent=traceparent, when=when or NO_TIMING, key=key)
    started, rode = await runtime.db(lambda store: signals.ride(
        news, lambda pings: store.starts.enqueue(id, inputs, new, pings), when_quiet=True))
    if started.name != name:
        raise WorkflowConflict(
            f"workflow id {id!r} already belongs to a workflow {started.name!r}, not {name!r}; choose another id"
        )
    created = started.created
    if created:
        signals.waiters.ends.started([(id, started.born)], hearing)
        signals.told(news, rode)
        telemetry.workflows_started.add(1, {telemetry.WORKFLOW_NAME: name, telemetry.QUEUE: queue})
    return created


async def enqueue_debounced(runtime: Runtime, workflow: WorkflowSpec, id: str, inputs: bytes, debounce: Debounce, *,
                            queue: str | None = None, priority: int | None = None, traceparent: str | None = None,
                            when: Timing | None = None, key: str | None = None) -> str:
    """A debounced start (``with_options(debounce=..., debounce_key=...)``): join the pending run of
    the workflow's name and ``debounce.key`` with these arguments, or begin one under ``id``; the run's
    id either way, which every starter of the burst hands out.

    The run is a queued workflow whose due time each start pushes on to ``window`` seconds from now
    (at most ``most`` seconds after the burst's first start), not a timer held in some process: a
    worker that dies while it waits loses nothing, and the run is claimed as any due workflow is,
    once. The same queue ping as ``enqueue``'s rides on the commit: a worker that learnt an earlier
    due time looks again and finds the new one. ``when``: the expiry only (see ``checks``)."""
    queue = queue or workflow.queue
    await runtime.store()
    signals = runtime.signals
    news = News([signal_keys.queue(queue)])
    hearing = signals.hearing()
    new = NewWorkflows(name=workflow.name, queue=queue, priority=workflow.priority if priority is None else priority,
                       delay=0.0, max_attempts=workflow.max_attempts, timeout=workflow.timeout,
                       traceparent=traceparent, when=when or NO_TIMING, key=key)
    found, rode = await runtime.db(lambda store: signals.ride(
        news, lambda pings: store.debounces.enqueue_debounced(id, inputs, new, debounce, pings)))
    # (A joined run was queued and unclaimed under this statement's lock: it ends after the commit,
    # as a run created here would, so its end news is this loop's to hear either way.)
    signals.waiters.ends.started([(found.id, found.born)], hearing)
    if found.created:
        telemetry.workflows_started.add(1, {telemetry.WORKFLOW_NAME: workflow.name, telemetry.QUEUE: queue})
    signals.told(news, rode)
    return found.id


async def refuse_children(runtime: Runtime, chosen: list[tuple[str, list[str]]]) -> None:
    """Refuse ids a caller chose that are the id of a child of an existing workflow (``(id, the
    parents it could be a child of)`` pairs from ``checks.check_chosen_id``): only the parent's replay
    may start it, and a caller that took it first (with a far delay, say) would stop it from ever
    running. (One query, and only for ids of that form.)"""
    parents = sorted({parent for _, candidates in chosen for parent in candidates})
    if not parents:
        return
    existing = await runtime.db(lambda store: store.workflows.existing(parents))
    for id, candidates in chosen:
        for parent in (p for p in candidates if p in existing):
            raise ValueError(f"workflow id {id!r} is reserved: it is the id pgflow gives a child that workflow"
                             f" {parent!r} starts from its body; choose another id (app.handle({id!r}) reaches"
                             " the child itself)")


async def enqueue_many(runtime: Runtime, workflow: WorkflowSpec, ids: list[str], inputs: list[bytes], *,
                       queue: str | None = None, priority: int | None = None, delay: float = 0.0,
                       parent: str | None = None, traceparent: str | None = None, when: Timing | None = None,
                       keys: list[str | None] | None = None) -> None:
    """Insert many workflows in one statement, skipping ids that exist; ids taken by a workflow of
    another name raise WorkflowConflict (after the others were started). ``keys``: each one's key."""
    queue = queue or workflow.queue
    priority = workflow.priority if priority is None else priority
    starter = journaling()
    if starter is not None and not await starter.before_child_start(ids, workflow.name):
        return
    await runtime.store()
    signals = runtime.signals
    news = News([signal_keys.queue(queue)])
    hearing = signals.hearing()
    new = NewWorkflows(name=workflow.name, queue=queue, priority=priority, delay=delay,
                       max_attempts=workflow.max_attempts, timeout=workflow.timeout, parent=parent,
                       traceparent=traceparent, when=when or NO_TIMING)
    found, rode = await runtime.db(lambda store: signals.ride(
        news, lambda pings: store.starts.enqueue_many(ids, inputs, new, pings, keys), when_quiet=True))
    created = sum(1 for started in found if started.created)
    signals.waiters.ends.started(((id, started.born) for id, started in zip(ids, found, strict=True)
                                  if started.created), hearing)
    if created:
        signals.told(news, rode)
        telemetry.workflows_started.add(created, {telemetry.WORKFLOW_NAME: workflow.name, telemetry.QUEUE: queue})
    taken = [(id, started.name) for id, started in zip(ids, found, strict=True) if started.name != workflow.name]
    if taken:
        id, name = taken[0]
        raise WorkflowConflict(
            f"{len(taken)} of the ids already belong to other workflows (first: {id!r} is a {name!r}, not "
            f"{workflow.name!r}); the others were started. Choose other ids."
        )
