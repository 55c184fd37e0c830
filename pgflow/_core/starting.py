"""Putting a workflow on its queue: one place for ``start``, ``start_async`` and the cron service."""

from __future__ import annotations

from ..errors import WorkflowConflict
from .registry import WorkflowSpec
from .runtime import Runtime


async def enqueue(runtime: Runtime, workflow: WorkflowSpec, id: str, inputs: bytes, *, queue: str | None = None,
                  priority: int | None = None, delay: float = 0.0) -> bool:
    """Insert the workflow unless ``id`` exists; True when this call created it. An id taken by a
    workflow of another name raises WorkflowConflict."""
    queue = queue or workflow.queue
    priority = workflow.priority if priority is None else priority
    await runtime.store()
    keys = {f"q:{queue}"}
    pings = runtime.pings_to_carry(keys)
    created, name = await runtime.db(lambda store: store.enqueue(
        id, workflow.name, queue, priority, inputs, delay, workflow.max_attempts, workflow.timeout, pings,
    ))
    if name != workflow.name:
        raise WorkflowConflict(
            f"workflow id {id!r} already belongs to a workflow {name!r}, not {workflow.name!r}; choose another id"
        )
    if created:
        # Delayed ones too: an idle worker re-reads when the next workflow falls due.
        runtime.announced(keys, pings)
    return created
