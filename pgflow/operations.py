"""The management API of an App: listing and looking into workflows, the fleet's queues, workers and
health, retention on demand, and the signal keyring's rotation. ``App`` inherits it; everything here
reaches the database through the App's client."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import msgspec

from ._core.checks import check_queue
from ._core.client import Client
from ._core.engine.details import DetailsRead
from ._core.engine.overview import WorkerRow
from ._core.maintenance import KEYS, NAMES, PARTITIONS, REAPER, RETENTION, ROTATION_OVERLAP, cron_service, lock_name
from ._core.pruning import PRUNE_BATCH, check_batch, check_older_than, prune_leftovers, prune_paced
from ._core.registry import Registry
from ._core.signals import News
from ._core.signals import keys as signal_keys
from ._core.status import Status
from ._core.twins import blocking
from .errors import UnknownWorkflow
from .records import (
    MAX_WAIT,
    SILENT_AFTER,
    AttemptError,
    ErrorDetails,
    Health,
    LockHolder,
    QueueInfo,
    Session,
    StepDetails,
    StepInProgress,
    StreamInfo,
    Undecodable,
    WorkerInfo,
    WorkflowDetails,
    WorkflowRecord,
    seconds_between,
)

STATUSES = tuple(status.value for status in Status)  # plain strings, for the CLI's choices
MAX_STEPS_SHOWN = 100_000  # steps_limit's bound: a journal read in full is this workflow's memory, once


class Operations:
    """What ``pgflow workflows|queues|workers|status|prune|keys`` call, with ``_async`` twins."""

    _client: Client
    _settings: dict[str, Any]
    registry: Registry

    @property
    def schema(self) -> str:
        return str(self._settings["schema"])

    async def list_workflows_async(
        self, status: str | None = None, name: str | None = None, queue: str | None = None,
        created_after: datetime | None = None, created_before: datetime | None = None, limit: int = 100,
        order: str = "desc",
    ) -> list[WorkflowRecord]:
        """Light records of the workflows that match every filter given, newest first (``order="asc"``:
        oldest first), at most ``limit`` of them."""
        if status is not None and status not in STATUSES:
            raise ValueError(f"status is one of {', '.join(STATUSES)}, got {status!r}")
        if order not in ("asc", "desc"):
            raise ValueError(f"order is 'asc' or 'desc', got {order!r}")
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 10_000:
            raise ValueError(f"limit is between 1 and 10000, got {limit!r}")
        for when in (created_after, created_before):
            if when is not None and (not isinstance(when, datetime) or when.tzinfo is None):
                raise ValueError(f"created_after and created_before are timezone-aware datetimes, got {when!r}")
        rows = await self._client.runtime().db(lambda store: store.management.list_workflows(
            status, name, check_queue(queue) if queue is not None else None, created_after, created_before,
            limit, order == "desc"))
        return [WorkflowRecord.of(row) for row in rows]

    list_workflows = blocking(list_workflows_async)

    async def workflow_details_async(self, workflow_id: str, steps_limit: int = 1000) -> WorkflowDetails:
        """Everything kept of one workflow, from one snapshot, for a person finding out what happened:
        its record, arguments and result decoded, its error with message and traceback, its first
        ``steps_limit`` journal entries with their start, duration, attempts, output and every kept
        attempt's error, the steps begun and not recorded, and its streams. Decoded without the
        workflow's code (as builtins): the process reading need not import it, and a stored value is
        data, never code. Raises UnknownWorkflow when there is no such workflow."""
        if not isinstance(workflow_id, str):
            raise TypeError(f"workflow_id is a str, got {type(workflow_id).__name__}")
        if isinstance(steps_limit, bool) or not isinstance(steps_limit, int) or \
                not 1 <= steps_limit <= MAX_STEPS_SHOWN:
            raise ValueError(f"steps_limit is between 1 and {MAX_STEPS_SHOWN}, got {steps_limit!r}")
        found = await self._client.runtime().db(lambda store: store.details.details(workflow_id, steps_limit))
        if found is None:
            raise UnknownWorkflow(f"no workflow with id {workflow_id!r}")
        return _details(found)

    workflow_details = blocking(workflow_details_async)

    async def queues_info_async(self) -> list[QueueInfo]:
        """Every queue with work or limits: depth, due now, oldest wait, running, limits."""
        rows = await self._client.runtime().db(lambda store: store.management.queues_overview())
        return [QueueInfo(str(r.queue), int(r.queued), int(r.due), None if r.waited is None else float(r.waited),
                          int(r.running), r.concurrency, r.rate_limit, r.rate_period, r.paused_at) for r in rows]

    queues_info = blocking(queues_info_async)

    async def workers_info_async(self) -> list[WorkerInfo]:
        """The registered workers: where they run, what they serve, their heartbeat's age, how many
        workflows each holds, and whether it is dead (its heartbeat older than its lease)."""
        rows = await self._client.runtime().db(lambda store: store.management.workers_overview())
        return [_worker(r) for r in rows]

    workers_info = blocking(workers_info_async)

    async def health_async(self, stuck_after: float = 60.0, max_wait: float = MAX_WAIT) -> Health:
        """A health probe (``pgflow status``): see Health for what counts as unhealthy. A worker is
        live while its heartbeat is younger than its lease (as ``pgflow workers`` has it); a queue
        fails once its oldest due workflow has waited over ``max_wait`` seconds."""
        if isinstance(max_wait, bool) or not isinstance(max_wait, int | float) or not max_wait >= 0:
            raise ValueError(f"max_wait is a number of seconds >= 0, got {max_wait!r}")
        runtime = self._client.runtime()
        workers = await self.workers_info_async()
        live = [w for w in workers if not w.dead]
        names = sorted({name for w in live for name in w.names})
        read = await runtime.db(lambda store: store.management.health(names, stuck_after))
        schedules = [cron_service(spec.name) for spec in self.registry.workflows.values() if spec.schedule is not None]
        services = [REAPER, RETENTION, PARTITIONS, NAMES, KEYS, *schedules]
        by_lock = {lock_name(self.schema, service): service for service in services}
        locks = await runtime.db(lambda store: store.management.lock_holders(list(by_lock)))
        served = {queue for w in live for queue in w.queues}
        paused = await runtime.db(lambda store: store.pausing.paused_queues())
        # A paused queue's work waits by the operator's choice: a note, not a problem.
        waiting = {row.queue: row for row in read.waiting if row.queue not in paused}
        return Health(len(live), read.notification_queue_usage, dict(read.unserved),
                      [Session.of(s) for s in read.stuck], [Session.of(s) for s in read.holders],
                      [LockHolder(by_lock[name], int(pid), user, app, float(age or 0.0))
                       for name, pid, user, app, age in locks],
                      unserved_queues={q: r.due + r.orphaned for q, r in waiting.items() if q not in served},
                      overdue={q: r.oldest_due_waited for q, r in waiting.items()
                               if r.oldest_due_waited is not None and r.oldest_due_waited > max_wait},
                      dead_workers=[w for w in workers if w.dead and any(q in waiting for q in w.queues)],
                      max_wait_s=float(max_wait), paused=paused)

    health = blocking(health_async)

    async def prune_async(self, older_than: float | timedelta, batch: int = PRUNE_BATCH,
                          progress: Callable[[int], None] | None = None) -> int:
        """Delete the workflows that finished more than ``older_than`` ago, with their steps and
        streams, ``batch`` at a time (each batch one short statement, so nothing holds locks for
        long); ``progress(deleted so far)`` after each batch. Returns how many went. Then, as the
        workers' retention does, expired free-standing streams, the debounce keys whose run began and
        the per-key buckets full again. Workers do all this by themselves for ``App(retention=...)``.
        A pruned stream's chunks become unreachable at once and their space is freed when their
        partition is dropped: once every stream begun in its period (a day by default) is pruned and
        the period is over, by this call or the workers."""
        seconds, batch = check_older_than(older_than), check_batch(batch)
        runtime = self._client.runtime()
        deleted = await prune_paced(lambda: runtime.db(lambda store: store.management.prune(seconds, batch)), batch,
                                    progress)
        await runtime.db(lambda store: prune_leftovers(store, batch))
        await runtime.db(lambda store: store.partitions.drop_chunk_partitions())
        return deleted

    prune = blocking(prune_async)

    async def rotate_signal_key_async(self, overlap: float = ROTATION_OVERLAP) -> int:
        """Add a new key to the keyring that seals pings, without downtime: processes seal with it
        from ``overlap`` seconds on (each reloads the keyring at least every 30 s, so every one knows
        it by then) and accept the older keys until ``overlap`` seconds after that. Returns the new
        key's id. Rotate after a role that could read ``signal_keys`` lost that right."""
        if isinstance(overlap, bool) or not isinstance(overlap, int | float) or not 60.0 <= overlap <= 86400.0:
            raise ValueError(f"overlap is between 60 and 86400 seconds (processes reload the keys every 30 s),"
                             f" got {overlap!r}")
        return await self._client.runtime().db(lambda store: store.channel.rotate_signal_key(float(overlap)))

    rotate_signal_key = blocking(rotate_signal_key_async)

    async def pause_queue_async(self, name: str) -> datetime:
        """Stop the fleet claiming ``name``'s workflows until ``resume_queue``: running ones finish,
        starts still queue. Pausing a paused queue changes nothing. Returns since when it is paused.
        A queue the fleet does not know (no work, limits or worker of its, and not this App's) is a
        ValueError: a misspelt name would stop nothing."""
        name = check_queue(name)
        runtime = self._client.runtime()
        if name not in self._queue_names() and not await runtime.db(lambda store: store.pausing.queue_known(name)):
            raise ValueError(f"no queue {name!r} is known: none of its workflows is queued or running, no worker"
                             " serves it and it has no limits (pgflow queues lists the queues)")
        return await runtime.db(lambda store: store.pausing.pause_queue(name))

    pause_queue = blocking(pause_queue_async)

    async def resume_queue_async(self, name: str) -> bool:
        """Let the fleet claim ``name``'s workflows again (its workers hear of it at once); whether it
        was paused."""
        name = check_queue(name)
        runtime = self._client.runtime()
        resumed = await runtime.db(lambda store: store.pausing.resume_queue(name))
        if resumed:
            runtime.signals.announce(News([signal_keys.queue(name)]))
        return resumed

    resume_queue = blocking(resume_queue_async)

    def _queue_names(self) -> set[str]:
        """The queues this App's workflows and limits name."""
        return {spec.queue for spec in self.registry.workflows.values()} | set(self.registry.queues)


def _worker(r: WorkerRow) -> WorkerInfo:
    lease, age = None if r.lease_seconds is None else float(r.lease_seconds), float(r.heartbeat_age)
    return WorkerInfo(str(r.id), str(r.host), int(r.pid), list(r.queues), str(r.version), age, int(r.running),
                      list(r.names), lease, age > (SILENT_AFTER if lease is None else lease))


def _details(read: DetailsRead) -> WorkflowDetails:
    w = read.workflow
    kept: dict[int, list[AttemptError]] = {}
    for e in read.attempt_errors:
        kept.setdefault(e.position, []).append(AttemptError(
            e.run, e.step_attempt, e.failed_at, ErrorDetails.of(e.error) or ErrorDetails("?", "", "")))
    return WorkflowDetails(
        id=w.id, name=w.name, queue=w.queue, status=w.status, attempt=w.attempt, priority=w.priority,
        created_at=w.created_at, started_at=w.started_at, finished_at=w.finished_at,
        duration_s=seconds_between(w.started_at, w.finished_at), due_at=w.due_at, waiting_for=w.waiting_for,
        parent_id=w.parent_id, lease_owner=w.lease_owner, lease_expires_at=w.lease_expires_at,
        cancel_requested=w.cancel_requested, max_attempts=w.max_attempts, timeout_s=w.timeout,
        deadline_at=w.deadline_at, arguments=_arguments(w.inputs),
        result=None if w.output is None else _value(w.output), error=ErrorDetails.of(w.error),
        steps=[StepDetails(s.position, s.name, s.started_at, s.finished_at,
                           seconds_between(s.started_at, s.finished_at), s.attempts,
                           None if s.output is None else _value(s.output), ErrorDetails.of(s.error),
                           kept.get(s.position, []), s.wake_at, bool(s.waiting))
               for s in read.steps],
        steps_total=read.steps_total,
        in_progress=[StepInProgress(b.position, int(b.tries or 0), b.started_at, kept.get(b.position, []))
                     for b in read.begun],
        streams=[StreamInfo(st.key, int(st.chunks), bool(st.closed)) for st in read.streams],
    )


def _value(data: bytes) -> Any:
    """A stored value as builtins, or an Undecodable saying why not. Only what also encodes as JSON
    passes (msgpack has extension types and keys of any type; ``--json`` must print what it gets)."""
    try:
        value = msgspec.msgpack.decode(data)
        msgspec.json.encode(value)
    except Exception as exc:  # noqa: BLE001 - any byte string at all may be in the row
        return Undecodable(len(data), f"{type(exc).__name__}: {exc}"[:200])
    return value


def _arguments(data: bytes) -> Any:
    """Arguments are stored as a map of parameter to value; a call started by name and not run yet
    as ``[args, kwargs]`` (see codec.encode_unchecked)."""
    value = _value(data)
    if isinstance(value, list) and len(value) == 2 and isinstance(value[0], list) and isinstance(value[1], dict):
        return {"args": value[0], "kwargs": value[1]}
    return value
