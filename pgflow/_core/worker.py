"""A worker: claims workflows up to its free slots, runs them under a lease, and renews the lease.

The worker sleeps until something can change what it would claim: an enqueue ping on one of its
queues, a slot freeing up, the next delayed workflow falling due, or the slow poll that also finds
workflows whose lease expired because their worker died.

Stopping is two-phase. ``stop(grace)`` stops claiming and lets running workflows finish for up to
``grace`` seconds; whatever still runs then is interrupted and given back to the queue at once, so
another worker resumes it from its journal without waiting for the lease to run out.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from types import TracebackType

import anyio
import anyio.lowlevel
import psycopg
from anyio.abc import TaskGroup

from ..errors import ConfigurationError, ExecutionInterrupted
from ..version import __version__
from .checks import check_queue
from .connecting import linked, where
from .executor import execute
from .finisher import Finisher
from .health import HealthServer, Liveness
from .maintenance import NAMES, REAPER, RETENTION, Maintenance, Service, cron_service, every, schedule
from .pruning import PRUNE_BATCH, prune_paced
from .registry import Registry, WorkflowSpec
from .runtime import Runtime, Runtimes
from .signals import Waiter
from .signals import keys as signal_keys
from .starting import enqueue
from .starts import StepStarts
from .store import Claimed, Store
from .streams.writer import StreamWriter

log = logging.getLogger("pgflow.worker")

MAX_WARNED_NAMES = 1000  # names of queued workflows nobody runs, warned of once each (then again)


class Worker:
    """``async with app.worker(...)``: runs workflows until the block exits.

    Leaving the block stops the worker with ``grace`` seconds for running workflows to finish
    (default 0: they are interrupted at once and go back to the queue).
    """

    def __init__(self, registry: Registry, runtimes: Runtimes, concurrency: int = 16,
                 queues: Sequence[str] | None = None, lease: float = 10.0, heartbeat: float | None = None,
                 grace: float = 0.0, health_port: int | None = None, health_host: str = "0.0.0.0") -> None:
        if concurrency < 1:
            raise ConfigurationError(f"concurrency must be at least 1, got {concurrency}")
        if lease <= 0:
            raise ConfigurationError(f"lease must be positive, got {lease}")
        if grace < 0:
            raise ConfigurationError(f"grace must be >= 0 seconds, got {grace}")
        if health_port is not None and (isinstance(health_port, bool) or not isinstance(health_port, int)
                                        or not 0 <= health_port <= 65535):
            raise ConfigurationError(f"health_port is a TCP port, 0 to 65535 (0: any free one), got {health_port!r}")
        self.health_port = health_port
        self.health_host = health_host
        self.health: HealthServer | None = None  # the liveness probe's server, while the worker runs
        self._liveness: Liveness | None = None
        self.registry = registry
        self.runtimes = runtimes
        self.concurrency = concurrency
        self.queues = [check_queue(queue) for queue in queues] if queues else ["default"]
        self.lease = lease
        self.heartbeat = heartbeat if heartbeat is not None else lease / 3
        self.grace = grace
        self.id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        # Executions by workflow id. Two of one id can overlap after a server crash lost a claim: the
        # first, fenced out, runs on until it tries to write while this worker claims the id again.
        self.running: collections.Counter[str] = collections.Counter()
        self._cancellers: dict[str, Callable[[], None]] = {}
        self._slot_wanted = True
        self.interrupted = 0
        self._limiter = anyio.CapacityLimiter(concurrency)
        self._group: TaskGroup | None = None
        self._tasks: TaskGroup | None = None
        self._runtime: Runtime | None = None
        self._store: Store | None = None
        self._wake: Waiter | None = None
        self._writer: StreamWriter | None = None
        self._finisher: Finisher | None = None
        self._starts: StepStarts | None = None
        self._maintenance: Maintenance | None = None
        self._warned_names: set[str] = set()

    async def __aenter__(self) -> Worker:
        try:
            return await self._enter()
        except BaseException:
            if self.health is not None:  # bound, and the worker did not start: the port is let go
                self.health.stop()
                self.health = None
            raise

    async def _enter(self) -> Worker:
        # Made here, not in __init__: anyio needs a running loop to make them.
        self._running_scope = anyio.CancelScope()
        self._claiming = anyio.CancelScope()
        self._idle = anyio.Event()
        runtime = self._runtime = self.runtimes.current()
        if self.health_port is not None:  # bound first: a port that is taken stops the worker before it starts
            self._liveness = Liveness(self.lease, lambda: bool(runtime.signals.listener
                                                              and runtime.signals.listener.connected))
            try:
                self.health = HealthServer(self._liveness, self.health_host, self.health_port)
            except OSError as exc:
                raise ConfigurationError(f"cannot serve the health probe on {self.health_host}:{self.health_port}:"
                                         f" {exc.strerror or exc}") from exc
        self._store = await runtime.store()
        for queue in self.queues:
            limits = self.registry.queues.get(queue)
            if limits is not None:
                await self._store.declare_queue(queue, limits.concurrency, limits.rate_limit, limits.per)
        await self._store.register_worker(self.id, socket.gethostname(), os.getpid(), self.queues, __version__,
                                          sorted(self.registry.workflows), self.lease)
        assert runtime.config is not None
        self._writer = StreamWriter(self._store, runtime.signals)
        runtime.writers.add(self._writer)
        # A workflow whose body is done no longer takes a slot while its end waits for its batch: the
        # next claim goes out beside that batch instead of after it.
        self._finisher = Finisher(self._store, runtime.signals, recorded=runtime.count_ends)
        self._starts = StepStarts(self._store)
        config = runtime.config
        self._maintenance = Maintenance(linked(config.session_dsn, config.query_timeout), self._store.schema,
                                        self._services(), interval=self.lease, query_timeout=config.query_timeout)
        self._wake = Waiter()
        self._token = anyio.lowlevel.current_token()  # the loop's, for every execution's sync callbacks
        for queue in self.queues:
            runtime.signals.waiters.add(signal_keys.queue(queue), self._wake)
        self._group = anyio.create_task_group()
        await self._group.__aenter__()
        await self._group.start(self._main)
        log.info("worker %s started: server %s, schema %s, queues %s, concurrency %d", self.id,
                 where((await self.runtimes.config_async()).dsn), self._store.schema,
                 ",".join(self.queues), self.concurrency)
        if self.health is not None:
            self.health.start()
            log.info("worker %s answers its liveness probe on http://%s:%d/healthz", self.id, self.health.host,
                     self.health.port)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        assert self._group is not None
        try:
            try:
                with anyio.CancelScope(shield=exc_type is None):
                    await self.stop(0.0 if exc_type is not None else self.grace)
            finally:
                # Always exit the group, or the caller's cancel scopes unwind out of order. The
                # block's own exception propagates as it is, not wrapped in an ExceptionGroup.
                self._running_scope.cancel()
                await self._group.__aexit__(None, None, None)
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await self._store.unregister_worker(self.id)  # type: ignore[union-attr]
                except Exception as exc:  # noqa: BLE001 - the maintenance service forgets it anyway
                    log.warning("could not unregister worker %s: %s", self.id, exc)
            if self.health is not None:
                self.health.stop()
            log.info("worker %s stopped", self.id)

    @property
    def leading(self) -> set[str]:
        """The fleet-wide maintenance services this worker runs now (each runs on one worker)."""
        return set(self._maintenance.leading) if self._maintenance is not None else set()

    async def stop(self, grace: float) -> bool:
        """Stop claiming, wait up to ``grace`` seconds for running workflows, then interrupt the
        rest (they go back to the queue). Returns True when nothing had to be interrupted."""
        assert self._wake is not None and self._runtime is not None
        self._claiming.cancel()
        for queue in self.queues:
            self._runtime.signals.waiters.remove(signal_keys.queue(queue), self._wake)
        if self.running and grace > 0:
            log.info("worker %s draining %d running workflows (up to %.1fs)", self.id,
                     len(self.running), grace)
            with anyio.move_on_after(grace):
                await self._idle.wait()
        # (Workflows whose bodies are done are no longer running: their ends wait in the finisher,
        # which records them when it stops.)
        running = len(self.running)  # (a workflow whose end waits in the finisher runs no more)
        if running > 0 and not self._running_scope.cancel_called:
            self.interrupted = running
            log.warning("worker %s interrupting %d workflows; they go back to the queue", self.id,
                        self.interrupted)
        self._running_scope.cancel()
        return not self.interrupted

    async def _main(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Own every task of the worker under one scope that ``stop`` cancels. (Cancelling the outer
        group's scope instead would also cancel the code inside the caller's ``async with``.)"""
        assert self._writer is not None and self._finisher is not None and self._maintenance is not None
        assert self._starts is not None
        with self._running_scope:
            try:
                async with anyio.create_task_group() as tasks:
                    self._tasks = tasks
                    tasks.start_soon(self._writer.run)
                    tasks.start_soon(self._finisher.run)
                    tasks.start_soon(self._starts.run)
                    tasks.start_soon(self._intake)
                    tasks.start_soon(self._heartbeat_loop)
                    if self._liveness is not None:
                        tasks.start_soon(self._pulse, self._liveness)
                    task_status.started()
            finally:
                assert self._runtime is not None
                self._runtime.retire(self._writer)

    async def _intake(self) -> None:
        """Everything that brings work in (claiming, the maintenance services such as schedules);
        ``stop`` cancels it first."""
        assert self._maintenance is not None
        with self._claiming:
            async with anyio.create_task_group() as group:
                group.start_soon(self._claim_loop)
                group.start_soon(self._maintenance.run)

    def _services(self) -> dict[str, Service]:
        """The fleet-wide chores this worker can take on: forgetting dead workers, deleting finished
        workflows past the retention, and the schedules of the workflows it serves."""
        assert self._store is not None
        store, forget_after = self._store, max(60.0, 10 * self.lease)
        services = {REAPER: every(self.heartbeat, lambda: store.forget_workers(forget_after),
                                    "forgetting dead workers")}
        assert self._runtime is not None and self._runtime.config is not None
        retention = self._runtime.config.retention
        if retention is not None:
            services[RETENTION] = every(max(1.0, min(60.0, retention / 10, 10 * self.lease)),
                                          lambda: prune(store, retention),
                                          "deleting old finished workflows", shielded=False)
        services[NAMES] = every(max(5.0, 3 * self.lease), self._warn_unserved,
                                  "looking for queued workflows nobody runs")
        for spec in self.registry.workflows.values():
            if spec.schedule is not None and spec.queue in self.queues:
                services[cron_service(spec.name)] = schedule(spec.schedule, self._start_tick(spec),
                                                         catch_up=3 * self.lease, clock=self.runtimes.clock)
        return services

    async def _warn_unserved(self) -> None:
        """Warn, once per name, of queued workflows whose name no live worker registered: they would
        wait forever, silently (a deploy that renamed a workflow, a worker serving the wrong module).
        ``pgflow status`` reports the same names."""
        assert self._store is not None
        for name, count in await self._store.unserved(max(30.0, 3 * self.heartbeat)):
            if name not in self._warned_names:
                if len(self._warned_names) >= MAX_WARNED_NAMES:  # bounded: names are anybody's to make up
                    self._warned_names.clear()
                self._warned_names.add(name)
                log.warning("%d queued workflows are named %r, which no live worker runs: they wait until a"
                            " worker that registers that name starts (a renamed workflow? a worker serving"
                            " another module?)", count, name)

    def _start_tick(self, spec: WorkflowSpec) -> Callable[[datetime], Awaitable[object]]:
        async def start(tick: datetime) -> object:
            assert self._runtime is not None
            inputs = spec.codec.encode_arguments((tick,) if spec.takes_tick else (), {})
            return await enqueue(self._runtime, spec, f"{spec.name}@{tick.isoformat()}", inputs)

        return start

    async def _claim_loop(self) -> None:
        assert self._store is not None and self._wake is not None and self._tasks is not None
        assert self._finisher is not None
        assert self._runtime is not None and self._runtime.config is not None
        poll = self._runtime.config.poll_interval
        names = sorted(self.registry.workflows)
        limited = [q for q in self.queues if q in self.registry.queues]
        unlimited = [q for q in self.queues if q not in self.registry.queues]
        while True:
            self._wake.arm()
            free = self.concurrency - len(self.running)
            wait = poll
            # Until a claim finds fewer workflows than free slots, a slot freed by a finishing
            # workflow may have work waiting for it.
            self._slot_wanted = True
            if free > 0:
                try:
                    # Shielded: a claim cancelled halfway would leave rows leased to nobody.
                    with anyio.CancelScope(shield=True):
                        claimed, due, refill = await self._claim(unlimited, limited, names, free)
                    self._slot_wanted = len(claimed) == free
                    if claimed and self._idle.is_set():
                        self._idle = anyio.Event()  # busy again: a drain waits for this one
                    for row in claimed:
                        self.running[row.id] += 1
                        self._tasks.start_soon(self._run, row, name=f"pgflow workflow {row.id}")
                    wait = self._next_look(poll, free, len(claimed), due, refill)
                except (psycopg.Error, OSError) as exc:
                    log.warning("claim failed, trying again in %.1fs: %s", poll, exc)
            if wait > 0:
                await self._wake.wait(wait)

    async def _claim(self, unlimited: list[str], limited: list[str], names: list[str],
                     free: int) -> tuple[list[Claimed], float | None, float | None]:
        """Claim up to ``free``; also say when the next delayed workflow falls due and when a
        rate-limited queue's bucket next has a token."""
        assert self._store is not None
        claimed: list[Claimed] = []
        due: float | None = None
        refill: float | None = None
        if unlimited:
            claimed, due = await self._store.claim(self.id, unlimited, names, free, self.lease)
        for queue in limited:
            if len(claimed) < free:
                more, more_due, wait = await self._store.claim_limited(self.id, queue, names, free - len(claimed),
                                                                       self.lease)
                claimed += more
                due = _earliest(due, more_due)
                refill = _earliest(refill, wait)
        return claimed, due, refill

    @staticmethod
    def _next_look(poll: float, free: int, claimed: int, due: float | None, refill: float | None) -> float:
        """Seconds until the claim loop looks again (woken earlier by pings). At once when every
        free slot was filled (there may be more); when due workflows were left (others hold them, or
        a queue's limit does), at the poll, a ping (a limited queue's workflow finishing sends one)
        or a rate-limited queue's next token, not at once, which would spin."""
        if claimed == free:
            return 0.0
        wait = poll if due is None or due <= 0 else min(poll, due)
        return wait if refill is None else min(wait, refill)

    async def _run(self, claimed: Claimed) -> None:
        assert self._store is not None and self._wake is not None and self._runtime is not None
        freed: tuple[str, ...] = ()
        try:
            workflow = self.registry.workflows[claimed.name]
            freed = (signal_keys.queue(workflow.queue),) if workflow.queue in self.registry.queues else ()
            assert self._writer is not None and self._finisher is not None
            await execute(self._runtime, self._store, workflow, claimed, self._limiter, self._writer,
                          self._finisher, freed, self._cancellers, self._starts, self._token)
        except ExecutionInterrupted as exc:
            log.info("workflow %s interrupted: %s", claimed.id, exc)
        except Exception:
            log.exception("workflow %s could not be run; it goes back to the queue", claimed.id)
        finally:
            self.running[claimed.id] -= 1
            if self.running[claimed.id] <= 0:
                del self.running[claimed.id]
            if not self.running:
                self._idle.set()
            # Look again only when the freed slot can matter: the last claim left work unclaimed for
            # want of a slot, or the queue has limits that this finish relaxes. Otherwise a claim
            # now would find nothing (a ping brings new work), and costs a round trip per workflow.
            if self._slot_wanted or freed:
                self._wake.wake()

    async def _heartbeat_loop(self) -> None:
        assert self._store is not None
        # A renewal answered after the lease ran out is worth nothing: past half the lease, the link
        # is taken for dead and the next renewal goes over a fresh one.
        within = min(max(self.lease / 2, 1.0), self._store.pool.query_timeout)
        while True:
            await anyio.sleep(self.heartbeat)
            try:
                with anyio.CancelScope(shield=True):
                    leases = await self._store.heartbeat(self.id, self.lease, socket.gethostname(), os.getpid(),
                                                         self.queues, __version__, sorted(self.registry.workflows),
                                                         sorted(self.running), within=within)
            except Exception as exc:  # noqa: BLE001 - keep renewing; fencing protects the data
                log.warning("lease renewal failed: %s", exc)
                continue
            if self._liveness is not None:
                self._liveness.renewed()
            # A cancelled workflow stops now, even one that never reaches another step or write.
            for workflow_id, _, cancel_requested in leases:
                cancel = self._cancellers.get(workflow_id) if cancel_requested else None
                if cancel is not None:
                    log.info("workflow %s was cancelled; stopping it", workflow_id)
                    cancel()


    @staticmethod
    async def _pulse(liveness: Liveness) -> None:
        """Tell the liveness probe, every second, that the loop turns and whether the listener listens."""
        while True:
            liveness.pulse()
            await anyio.sleep(1.0)


def _earliest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


async def prune(store: Store, older_than: float, batch: int = PRUNE_BATCH) -> int:
    """The retention service's pass: small batches, paced so the pruning never crowds out the work
    it runs beside."""
    deleted = await prune_paced(lambda: store.prune(older_than, batch), batch)
    if deleted:
        log.info("retention: deleted %d workflows finished over %.0f s ago", deleted, older_than)
    return deleted
