"""What a worker runs with once started, and how those parts are wired together.

Apart from ``worker.py``, which claims and runs workflows with them: this is only the making of the
parts (the stream writer, the finisher of ends, the batch of step-start notes, the slot every
execution borrows, the watch of cancellations, the maintenance services) and which of them shares
what. They are made on entry, not with the worker: anyio and the store need the running loop.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import anyio
import anyio.lowlevel

from .cancels import CancelWatch
from .chores import UnservedNames, chores
from .connecting import linked
from .engine import Engine
from .executor import Slot
from .finisher import Finisher
from .maintenance import Maintenance
from .registry import Registry
from .run_state import RunState
from .runs import Runs
from .runtime import Runtime
from .signals import Waiter
from .step_starts import StepStarts
from .streams.writer import StreamWriter


@dataclass(frozen=True)
class Parts:
    """What a worker runs with once started: made on entry (anyio and the store need the running
    loop), and gone with the stop."""

    runtime: Runtime
    store: Engine
    wake: Waiter  # woken by pings on the worker's queues and by slots freeing up
    writer: StreamWriter
    finisher: Finisher
    starts: StepStarts
    slot: Slot  # what every execution borrows from the worker
    cancels: CancelWatch  # cancellations of runs whose writes do not read their rows
    maintenance: Maintenance
    unserved: UnservedNames
    runs: Runs  # the tasks of the workflows it runs
    stack: contextlib.AsyncExitStack  # the worker's task group, and the leaving that follows it


def assemble(runtime: Runtime, store: Engine, registry: Registry, queues: list[str], lease: float, heartbeat: float,
             limiter: anyio.CapacityLimiter, runs_by_id: dict[str, RunState], *, cohorts: bool) -> Parts:
    """The parts of a worker serving ``queues`` (``runs_by_id``: the state of each workflow it runs,
    by id; ``limiter``: its slots)."""
    assert runtime.config is not None
    config = runtime.config
    writer = StreamWriter(store, runtime.signals, cohorts=cohorts)
    runtime.writers.add(writer)
    # A workflow whose body is done no longer takes a slot while its end waits for its batch: the
    # next claim goes out beside that batch instead of after it.
    finisher = Finisher(store, runtime.signals, recorded=runtime.count_ends)
    starts = StepStarts(store)
    unserved = UnservedNames(store, heartbeat)
    maintenance = Maintenance(linked(config.session_dsn, config.query_timeout), store.schema,
                              chores(runtime, store, registry, queues, lease, heartbeat, unserved),
                              interval=lease, query_timeout=config.query_timeout)
    # (the loop's token is for the executions' sync callbacks)
    cancels = CancelWatch(store, runtime.signals.waiters, runs_by_id)
    slot = Slot(runtime, store, limiter, writer, finisher, anyio.lowlevel.current_token(), runs_by_id, starts,
                cancels)
    return Parts(runtime, store, Waiter(), writer, finisher, starts, slot, cancels, maintenance, unserved, Runs(),
                 contextlib.AsyncExitStack())
