"""The fleet-wide chores a worker can take on, each run by one worker of the fleet at a time
(``maintenance.py`` elects who): forgetting dead workers, deleting finished workflows past the
retention, making and dropping stream chunk partitions, warning of queued workflows nobody runs,
rotating the signal keys, and starting the ticks of the scheduled workflows the worker serves."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime

from .engine import Engine
from .maintenance import (
    KEYS,
    NAMES,
    PARTITIONS,
    REAPER,
    RETENTION,
    ROTATION_OVERLAP,
    Service,
    cron_service,
    every,
    schedule,
)
from .pruning import PARTITIONS_EVERY, prune, tend_chunk_partitions
from .registry import Registry, WorkflowSpec
from .runtime import Runtime
from .starting import enqueue

log = logging.getLogger("pgflow.worker")

MAX_WARNED_NAMES = 1000  # names of queued workflows nobody runs, warned of once each (then again)


def chores(runtime: Runtime, store: Engine, registry: Registry, queues: Sequence[str], lease_seconds: float,
           heartbeat: float, unserved: UnservedNames) -> dict[str, Service]:
    """The services a worker serving ``queues`` with the workflows of ``registry`` can take on, by name."""
    forget_after = max(60.0, 10 * lease_seconds)
    services = {REAPER: every(heartbeat, lambda: store.workers.forget_workers(forget_after), "forgetting dead workers")}
    assert runtime.config is not None
    retention = runtime.config.retention
    if retention is not None:
        services[RETENTION] = every(max(1.0, min(60.0, retention / 10, 10 * lease_seconds)),
                                    lambda: prune(store, retention), "deleting old finished workflows",
                                    shielded=False)
    services[PARTITIONS] = every(PARTITIONS_EVERY, lambda: tend_chunk_partitions(store),
                                 "making and dropping stream chunk partitions")
    services[NAMES] = every(max(5.0, 3 * lease_seconds), unserved, "looking for queued workflows nobody runs")
    key_period = runtime.config.signal_key_period
    if key_period is not None:
        overlap = min(ROTATION_OVERLAP, key_period)
        services[KEYS] = every(min(3600.0, max(1.0, key_period / 10)),
                               lambda: store.channel.rotate_signal_key_when_due(key_period, overlap),
                               "rotating the signal keys")
    for spec in registry.workflows.values():
        if spec.schedule is not None and spec.queue in queues:
            services[cron_service(spec.name)] = schedule(spec.schedule, _start_tick(runtime, spec),
                                                         catch_up=3 * lease_seconds, clock=runtime.hub.clock)
    return services


class UnservedNames:
    """Warns, once per name, of queued workflows whose name no live worker registered: they would
    wait forever, silently (a deploy that renamed a workflow, a worker serving the wrong module).
    ``pgflow status`` reports the same names."""

    def __init__(self, store: Engine, heartbeat: float) -> None:
        self._store = store
        self._silent_for = max(30.0, 3 * heartbeat)  # a worker unheard of for this long is not live
        self.warned: set[str] = set()

    async def __call__(self) -> None:
        for name, count in await self._store.management.unserved(self._silent_for):
            if name not in self.warned:
                if len(self.warned) >= MAX_WARNED_NAMES:  # bounded: names are anybody's to make up
                    self.warned.clear()
                self.warned.add(name)
                log.warning("%d queued workflows are named %r, which no live worker runs: they wait until a"
                            " worker that registers that name starts (a renamed workflow? a worker serving"
                            " another module?)", count, name)


def _start_tick(runtime: Runtime, spec: WorkflowSpec) -> Callable[[datetime], Awaitable[object]]:
    async def start(tick: datetime) -> object:
        inputs = spec.codec.encode_arguments((tick,) if spec.takes_tick else (), {})
        return await enqueue(runtime, spec, f"{spec.name}@{tick.isoformat()}", inputs)

    return start
