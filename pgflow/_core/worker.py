"""A worker: claims workflows up to its free slots, runs them under a lease, and renews the lease.

The worker sleeps until something can change what it would claim: an enqueue ping on one of its
queues, a slot freeing up, the next delayed workflow falling due, or the slow poll that also finds
workflows whose lease expired because their worker died.

Those are suspects of a crash, run alone (``suspects.py``). A claim round over the worker's queues,
and when the loop looks again, are ``claim_rounds.py``'s; the parts a worker runs with (its writer,
finisher, slot, maintenance services) are made in ``worker_parts.py``.

Stopping is two-phase. ``stop(grace)`` stops claiming and lets running workflows finish for up to
``grace`` seconds; whatever still runs then is interrupted and given back to the queue at once, so
another worker resumes it from its journal without waiting for the lease to run out.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import socket
import uuid
from collections.abc import Callable, Sequence
from types import TracebackType

import anyio
import psycopg

from ..errors import ConfigurationError, ExecutionInterrupted
from ..version import __version__
from . import loops
from .checks import check_queue
from .claim_rounds import claim_round, next_look
from .connecting import where
from .engine import Claimed
from .executor import give_back_unrun, run_claimed
from .health import FleetVerdict, HealthServer, Liveness
from .registry import Registry
from .run_state import RunState
from .runtime import Runtimes
from .signals import keys as signal_keys
from .suspects import Suspects
from .worker_parts import Parts, assemble

log = logging.getLogger("pgflow.worker")


class Worker:
    """``async with app.worker(...)``: runs workflows until the block exits.

    Leaving the block stops the worker with ``grace`` seconds for running workflows to finish
    (default 0: they are interrupted at once and go back to the queue).
    """

    def __init__(self, registry: Registry, runtimes: Runtimes, concurrency: int = 16,
                 queues: Sequence[str] | None = None, lease: float = 10.0, heartbeat: float | None = None,
                 grace: float = 0.0, health_port: int | None = None, health_host: str = "0.0.0.0",
                 fleet_problems: Callable[[], int] | None = None) -> None:
        if concurrency < 1:
            raise ConfigurationError(f"concurrency must be at least 1, got {concurrency}")
        if lease <= 0:
            raise ConfigurationError(f"lease must be positive, got {lease}")
        if grace < 0:
            raise ConfigurationError(f"grace must be >= 0 seconds, got {grace}")
        if health_port is not None and (isinstance(health_port, bool) or not isinstance(health_port, int)
                                        or not 0 <= health_port <= 65535):
            raise ConfigurationError(f"health_port is a TCP port, 0 to 65535 (0: any free one), got {health_port!r}")
        self.health_port, self.health_host = health_port, health_host
        self._fleet = None if fleet_problems is None else FleetVerdict(fleet_problems)
        self.health: HealthServer | None = None  # the liveness probe's server, while the worker runs
        self._liveness: Liveness | None = None
        self.registry = registry
        self.runtimes = runtimes
        self.concurrency = concurrency
        # A queue named twice is served once (the claim reads each of its queues once, see Engine._claim).
        self.queues = list(dict.fromkeys(check_queue(queue) for queue in queues)) if queues else ["default"]
        self.lease_seconds = lease
        self.heartbeat = heartbeat if heartbeat is not None else lease / 3
        self.grace = grace
        self.id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        # Executions by workflow id. Two of one id can overlap after a server crash lost a claim: the
        # first, fenced out, runs on until it tries to write while this worker claims the id again.
        self.running: collections.Counter[str] = collections.Counter()
        self._runs_by_id: dict[str, RunState] = {}
        self._slot_wanted = True
        self._suspects = Suspects()  # of a crash: whether they wait, and the one run alone now
        self.interrupted = 0
        self._limiter = anyio.CapacityLimiter(concurrency)
        self._parts: Parts | None = None

    @property
    def lease(self) -> float:
        """Seconds a claim holds a workflow unrenewed: ``app.worker(lease=...)`` (``lease_seconds``)."""
        return self.lease_seconds

    @property
    def _on(self) -> Parts:
        if self._parts is None:
            raise RuntimeError("the worker is not running: use it as `async with app.worker(...)`")
        return self._parts

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
        runtime = self.runtimes.current()
        if self.health_port is not None:  # bound first: a port that is taken stops the worker before it starts
            self._liveness = Liveness(self.lease_seconds, lambda: bool(runtime.signals.listener
                                                              and runtime.signals.listener.connected))
            try:
                self.health = HealthServer(self._liveness, self.health_host, self.health_port, self._fleet)
            except OSError as exc:
                raise ConfigurationError(f"cannot serve the health probe on {self.health_host}:{self.health_port}:"
                                         f" {exc.strerror or exc}") from exc
        store = await runtime.store()
        for queue in self.queues:
            limits = self.registry.queues.get(queue)
            if limits is not None:
                await store.claims.declare_queue(queue, limits.concurrency, limits.rate_limit, limits.per,
                                                 limits.key_concurrency, limits.key_rate_limit)
        here = await runtime.server_on_this_machine()  # (before registering: nothing to undo if it fails)
        await store.workers.register_worker(self.id, socket.gethostname(), os.getpid(), self.queues, __version__,
                                    sorted(self.registry.workflows), self.lease_seconds)
        self._parts = parts = assemble(runtime, store, self.registry, self.queues, self.lease_seconds,
                                       self.heartbeat, self._limiter, self._runs_by_id, cohorts=not here)
        for queue in self.queues:
            runtime.signals.waiters.add(signal_keys.queue(queue), parts.wake)
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(self._left)  # last: once the group below is done
            await (await stack.enter_async_context(anyio.create_task_group())).start(self._main)
            self._parts = parts = dataclasses.replace(parts, stack=stack.pop_all())
        log.info("worker %s started: server %s, schema %s, queues %s, concurrency %d, loop %s", self.id,
                 where((await self.runtimes.config_async()).dsn), store.schema, ",".join(self.queues),
                 self.concurrency, loops.running())
        if self.health is not None:
            self.health.start()
            log.info("worker %s answers its liveness probe on http://%s:%d/healthz", self.id, self.health.host,
                     self.health.port)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        try:
            with anyio.CancelScope(shield=exc_type is None):
                await self.stop(0.0 if exc_type is not None else self.grace)
        finally:
            # Always exit the group, or the caller's cancel scopes unwind out of order. The
            # block's own exception propagates as it is, not wrapped in an ExceptionGroup.
            self._running_scope.cancel()
            await self._on.stack.aclose()

    async def _left(self) -> None:
        """What follows the worker's tasks: its registration given up, its probe closed."""
        with anyio.CancelScope(shield=True):
            try:
                await self._on.store.workers.unregister_worker(self.id)
            except Exception as exc:  # noqa: BLE001 - the maintenance service forgets it anyway
                log.warning("could not unregister worker %s: %s", self.id, exc)
        if self.health is not None:
            self.health.stop()
        self._parts = None
        log.info("worker %s stopped", self.id)

    @property
    def leading(self) -> set[str]:
        """The fleet-wide maintenance services this worker runs now (each runs on one worker)."""
        return set(self._parts.maintenance.leading) if self._parts is not None else set()

    async def stop(self, grace: float) -> bool:
        """Stop claiming, wait up to ``grace`` seconds for running workflows, then interrupt the
        rest (they go back to the queue). Returns True when nothing had to be interrupted."""
        on = self._on
        self._claiming.cancel()
        for queue in self.queues:
            on.runtime.signals.waiters.remove(signal_keys.queue(queue), on.wake)
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
        on = self._on
        with self._running_scope:
            try:
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(on.writer.run)
                    tasks.start_soon(on.finisher.run)
                    tasks.start_soon(on.starts.run)
                    tasks.start_soon(on.runs.serve)
                    tasks.start_soon(on.cancels.run)
                    tasks.start_soon(self._intake)
                    tasks.start_soon(self._heartbeat_loop)
                    if self._liveness is not None:
                        tasks.start_soon(self._pulse, self._liveness)
                    task_status.started()
            finally:
                on.runtime.retire(on.writer)

    async def _intake(self) -> None:
        """Everything that brings work in (claiming, the maintenance services such as schedules);
        ``stop`` cancels it first. Claimed workflows run in the worker's ``runs``."""
        with self._claiming:
            async with anyio.create_task_group() as group:
                group.start_soon(self._claim_loop)
                group.start_soon(self._on.maintenance.run)

    async def _claim_loop(self) -> None:
        on = self._on
        assert on.runtime.config is not None
        poll = on.runtime.config.poll_interval
        names = sorted(self.registry.workflows)
        limited = [q for q in self.queues if q in self.registry.queues]
        unlimited = [q for q in self.queues if q not in self.registry.queues]
        while True:
            on.wake.arm()
            draining = self._suspects.draining
            free = 0 if draining else self.concurrency - len(self.running)
            wait = poll
            # Until a claim finds fewer workflows than free slots, a slot freed by a finishing
            # workflow may have work waiting for it.
            self._slot_wanted = True
            if self._suspects.due(bool(self.running)):
                free = await self._claim_suspect(names)
                draining = free == 0
            if free > 0 or draining:
                try:
                    # Shielded: a claim cancelled halfway would leave rows leased to nobody.
                    with anyio.CancelScope(shield=True):
                        claimed, due, refill = await self._claim(unlimited, limited, names, free)
                    if self._claiming.cancel_called:  # a stop began while the claim ran: none run now
                        await give_back_unrun(on.slot, claimed)
                        return
                    self._slot_wanted = len(claimed) == free
                    if claimed and self._idle.is_set():
                        self._idle = anyio.Event()  # busy again: a drain waits for this one
                    unrun = [row for row in claimed if not self._start(row)]
                    if unrun:  # (the worker is stopping)
                        await give_back_unrun(on.slot, unrun)
                        return
                    wait = next_look(poll, free, len(claimed), due, refill) if free > 0 else poll
                    if self._suspects.wait and not self.running:
                        wait = 0.0  # empty: a suspect can be claimed now
                except (psycopg.Error, OSError) as exc:
                    log.warning("claim failed, trying again in %.1fs: %s", poll, exc)
            if wait > 0:
                await on.wake.wait(wait)

    async def _claim_suspect(self, names: list[str]) -> int:
        """With nothing running: claim one suspect of a crash and run it alone. Returns the free slots
        left to claim normally: none when a suspect was claimed (or the claim failed), all of them when
        no suspect was left to claim."""
        on = self._on
        suspect = await self._suspects.claim(on.store, self.id, self.queues, names, self.lease_seconds)
        if suspect is None:
            return 0 if self._suspects.wait else self.concurrency
        if self._claiming.cancel_called:
            await give_back_unrun(on.slot, [suspect])
            return 0
        self._suspects.run_alone(self.id, suspect)
        if self._idle.is_set():
            self._idle = anyio.Event()
        if not self._start(suspect):
            await give_back_unrun(on.slot, [suspect])
        return 0

    async def _claim(self, unlimited: list[str], limited: list[str], names: list[str],
                     free: int) -> tuple[list[Claimed], float | None, float | None]:
        """Claim up to ``free``; also say when the next delayed workflow falls due and when a
        rate-limited queue's bucket next has a token. Notes whether suspects wait."""
        found = await claim_round(self._on.store, self.id, unlimited, limited, names, free, self.lease_seconds)
        self._suspects.saw(found.suspects)
        return found.claimed, found.due, found.refill

    def _start(self, claimed: Claimed) -> bool:
        self.running[claimed.id] += 1
        if self._on.runs.start(self._run, claimed, f"pgflow workflow {claimed.id}"):
            return True
        self._ran(claimed.id)
        return False

    def _ran(self, id: str) -> None:
        self.running[id] -= 1
        if self.running[id] <= 0:
            del self.running[id]
            self._suspects.ended(id)
        if not self.running:
            self._idle.set()

    async def _run(self, claimed: Claimed, scope: anyio.CancelScope) -> None:
        on = self._on
        freed: tuple[str, ...] = ()
        try:
            workflow = self.registry.workflows[claimed.name]
            # (the queue it was claimed from: a start may have put it on another than its own)
            freed = (signal_keys.queue(claimed.queue),) if claimed.queue in self.registry.queues else ()
            await run_claimed(on.slot, workflow, claimed, scope, freed)
        except ExecutionInterrupted as exc:
            log.info("workflow %s interrupted: %s", claimed.id, exc)
        except Exception:
            log.exception("workflow %s could not be run; it goes back to the queue", claimed.id)
        finally:
            on.cancels.forget(claimed.id)
            self._ran(claimed.id)
            # Look again only when the freed slot can matter: the last claim left work unclaimed for
            # want of a slot, or the queue has limits that this finish relaxes. Otherwise a claim
            # now would find nothing (a ping brings new work), and costs a round trip per workflow.
            if self._slot_wanted or freed or self._suspects.wait:
                on.wake.wake()

    async def _heartbeat_loop(self) -> None:
        store = self._on.store
        # A renewal answered after the lease ran out is worth nothing: past half the lease, the link
        # is taken for dead and the next renewal goes over a fresh one.
        within = min(max(self.lease_seconds / 2, 1.0), store.pool.query_timeout)
        while True:
            await anyio.sleep(self.heartbeat)
            try:
                with anyio.CancelScope(shield=True):
                    leases = await store.workers.heartbeat(
                        self.id, self.lease_seconds, socket.gethostname(), os.getpid(), self.queues, __version__,
                        sorted(self.registry.workflows), sorted(self.running), within=within)
            except Exception as exc:  # noqa: BLE001 - keep renewing; fencing protects the data
                log.warning("lease renewal failed: %s", exc)
                continue
            if self._liveness is not None:
                self._liveness.renewed()
            # A cancelled workflow stops now, even one that never reaches another step or write.
            for held in leases:
                run = self._runs_by_id.get(held.id) if held.cancel_requested else None
                if run is not None:
                    log.info("workflow %s was cancelled; stopping it", held.id)
                    run.cancel()

    @staticmethod
    async def _pulse(liveness: Liveness) -> None:
        """Tell the liveness probe, every second, that the loop turns and whether the listener listens."""
        while True:
            liveness.pulse()
            await anyio.sleep(1.0)
