"""One test's pgflow: the App pointed at a fresh schema, an in-process worker, a virtual clock, and
the reads a test asserts on.

The App is the application's own (its workflows and steps as registered), pointed for the test at a
schema of its own and back afterwards; nothing of the engine is replaced. The worker is a real one
(``app.worker()``) on an event loop in a thread of its own, so sync and async tests alike reach it
through the App's ordinary API. Waits that are longer than nothing give their slot back
(``suspend_after=0``): a sleeping or waiting workflow is then a queued row with a due time, and
"idle" is a question the rows answer. Retention is off, so finished workflows stay to be read.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import anyio
import psycopg

from .._core.codec import decode
from .._core.connecting import CONNECT_TIMEOUT, unconnectable
from .._core.engine import Engine
from .._core.internals import Pointing
from .._core.maintenance import cron_service
from .._core.signals import News
from .._core.signals import keys as signal_keys
from .._core.worker import Worker
from ..app import App
from ..canvas import CANVAS_QUEUE
from ..handle import WorkflowHandle
from ..records import StepInfo, WorkflowRecord
from .clock import VirtualClock

T = TypeVar("T")
IDLE_LOOK = 0.01  # seconds between two looks at whether the worker has anything left to do


@dataclass(frozen=True)
class Message:
    """A message sent to a workflow, as its table holds it."""

    topic: str
    value: Any
    sent_at: datetime
    consumed_at: datetime | None  # None while nobody has received it


class PgflowEnv:
    """What the ``pgflow_env`` fixture gives a test (see ``pgflow.testing``)."""

    def __init__(self, app: App, dsn: str, *, schema: str | None = None, concurrency: int = 8,
                 queues: list[str] | None = None) -> None:
        self.app = app
        self.dsn = dsn
        self.schema = schema or f"pgflow_test_{uuid.uuid4().hex[:12]}"
        self.concurrency = concurrency
        # And the canvas's queue: a test may build its first canvas once the worker runs, and its
        # pgflow.canvas must be served then (the worker registers it, see pgflow.canvas).
        served = {spec.queue for spec in app.registry.workflows.values()} | set(app.registry.queues) | {CANVAS_QUEUE}
        self.queues = sorted(queues or served)
        self.names = sorted(app.registry.workflows)  # (the worker's, once it runs: with pgflow.canvas if it serves it)
        self.worker: Worker | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._saved: Pointing | None = None
        self._created = False  # this start made the schema, so stop drops it
        self._internals = app._internals()
        self.clock = VirtualClock(self, self._internals.clock)

    # -- life -------------------------------------------------------------------------------------------

    def start(self) -> PgflowEnv:
        """Point the App at the test's schema, migrate it and start the worker; on any failure,
        undo what was done (the App points back) and raise."""
        try:
            return self._start()
        except BaseException:
            self._teardown(after_failure=True)
            raise

    def _start(self) -> PgflowEnv:
        app, internals = self.app, self._internals
        app.close()
        self._saved = saved = internals.pointing()
        # Finished workflows stay readable for the test's assertions, however far the clock moves.
        internals.point(Pointing(self.dsn, {**saved.settings, "schema": self.schema, "suspend_after": 0.0,
                                            "retention": None}))
        clock = internals.clock
        clock.virtual = True
        self.clock = VirtualClock(self, clock)
        # Only a schema this start makes is dropped at the end (one a migration that fails half-way left
        # behind, too): a schema that was there before the test is somebody's, with what it holds.
        self._created = not self._schema_exists()
        app.migrate()
        self._thread = threading.Thread(target=self._serve, name=f"pgflow-test-worker-{self.schema}", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise self._failure
        return self

    def _schema_exists(self) -> bool:
        try:
            conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=CONNECT_TIMEOUT)
        except (psycopg.ProgrammingError, psycopg.OperationalError) as exc:
            raise unconnectable(self.dsn, exc) from None
        with conn:
            return conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (self.schema,)).fetchone() is not None

    def stop(self) -> None:
        """Stop the worker, close the App, drop the schema if the start made it, and point the App back
        where it was."""
        self._teardown(after_failure=False)

    def _teardown(self, after_failure: bool) -> None:
        loop, stop, thread = self._loop, self._stop, self._thread
        if loop is not None and stop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(stop.set)
        if thread is not None:
            thread.join(30)
        self.app.close()
        try:
            if self._created:
                try:
                    with psycopg.connect(self.dsn, autocommit=True) as conn:
                        conn.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')
                except psycopg.Error:
                    if not after_failure:
                        raise
                    # (the start's own error, which says what is wrong with the server, is raised)
                self._created = False
        finally:
            if self._saved is not None:
                self._internals.point(self._saved)
                self._saved = None

    def _serve(self) -> None:
        try:
            asyncio.run(self._work())
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            self._failure = exc
        finally:
            self._ready.set()

    async def _work(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            async with self.app.worker(concurrency=self.concurrency, queues=self.queues) as worker:
                self.worker = worker
                self.names = sorted(self.app.registry.workflows)
                await self._schedules_armed(worker)
                self._ready.set()
                await self._stop.wait()
        finally:
            await self._internals.close_here()

    async def _schedules_armed(self, worker: Worker, within: float = 30.0) -> None:
        """Wait until the worker runs the schedule of each cron workflow it serves and each has
        armed its timer for the next tick: a clock moved before that would skip the ticks between."""
        crons = {cron_service(spec.name) for spec in self.app.registry.workflows.values()
                 if spec.schedule is not None and spec.queue in self.queues}
        clock = self._internals.clock
        with anyio.fail_after(within):
            while not (crons <= worker.leading and clock.timers() >= len(crons)):
                await anyio.sleep(IDLE_LOOK)

    def _alive(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"the test's pgflow worker stopped: {self._failure!r}") from self._failure

    # -- running ----------------------------------------------------------------------------------------

    def run_until_idle(self, timeout: float = 30.0) -> None:
        """Wait until nothing can happen before the clock moves: no workflow of the worker's queues
        due now, and every running one waiting on the clock or on another workflow. ``TimeoutError``
        after ``timeout`` seconds of wall time, naming what is still busy."""
        self._call(lambda: self.run_until_idle_async(timeout))

    async def run_until_idle_async(self, timeout: float = 30.0) -> None:
        clock = self._internals.clock
        deadline = time.monotonic() + timeout
        calm: int | None = None
        while True:
            self._alive()
            seen = clock.activity
            due, running, _ = await (await self._store()).testing.activity(self.queues, self.names)
            parked = clock.parked_owners()
            busy = [id for id in running if id not in parked]
            working = clock.working()  # a schedule woken by the clock, its tick not started yet
            if not due and not busy and not working and seen == clock.activity:
                if calm == seen:  # idle at two looks in a row, nothing woken between them
                    return
                calm = seen
            else:
                calm = None
            if time.monotonic() > deadline:
                raise TimeoutError(f"pgflow did not become idle within {timeout} seconds: {due} workflows due, running"
                                   f" and not waiting: {busy[:10]}, services busy: {sorted(working)}")
            await anyio.sleep(IDLE_LOOK)

    async def next_due_async(self) -> float | None:
        """Seconds until the next queued workflow of the worker's queues falls due."""
        return (await (await self._store()).testing.activity(self.queues, self.names))[2]

    async def set_schema_clock(self, offset: float) -> None:
        await (await self._store()).testing.set_clock(offset)

    def wake_worker(self) -> None:
        """Tell the worker (and any other listener) to look at its queues now."""
        runtime = self._internals.runtime()
        runtime.signals.announce(News([signal_keys.queue(queue) for queue in self.queues]))

    # -- reading what happened --------------------------------------------------------------------------

    def workflows(self, status: str | None = None, name: str | None = None) -> list[WorkflowRecord]:
        """The test's workflows, newest first (``app.list_workflows``)."""
        return self.app.list_workflows(status=status, name=name, limit=1000)

    async def workflows_async(self, status: str | None = None, name: str | None = None) -> list[WorkflowRecord]:
        return await self.app.list_workflows_async(status=status, name=name, limit=1000)

    def steps(self, workflow: WorkflowHandle[Any] | str) -> list[StepInfo]:
        """Its journal: steps, sleeps, receives, events set, in order (``handle.steps()``)."""
        return self._handle(workflow).steps()

    async def steps_async(self, workflow: WorkflowHandle[Any] | str) -> list[StepInfo]:
        return await self._handle(workflow).steps_async()

    def events(self, workflow: WorkflowHandle[Any] | str) -> dict[str, Any]:
        """Every event the workflow has set, its last value under each key."""
        return self._call(lambda: self.events_async(workflow))

    async def events_async(self, workflow: WorkflowHandle[Any] | str) -> dict[str, Any]:
        rows = await (await self._store()).testing.events_of(self._handle(workflow).id)
        return {key: decode(value) for key, value in rows}

    def messages(self, workflow: WorkflowHandle[Any] | str) -> list[Message]:
        """Every message sent to the workflow, oldest first, with when it was received."""
        return self._call(lambda: self.messages_async(workflow))

    async def messages_async(self, workflow: WorkflowHandle[Any] | str) -> list[Message]:
        rows = await (await self._store()).testing.messages_of(self._handle(workflow).id)
        return [Message(topic, decode(bytes(value)), sent, consumed) for topic, value, sent, consumed in rows]

    def stream(self, workflow: WorkflowHandle[Any] | str, key: str) -> list[Any]:
        """Every chunk the stream holds now, in order, without waiting for more."""
        return self._call(lambda: self.stream_async(workflow, key))

    async def stream_async(self, workflow: WorkflowHandle[Any] | str, key: str) -> list[Any]:
        values, _ = await (await self._store()).testing.chunks_of(self._handle(workflow).id, key)
        return [decode(value) for value in values]

    # -- plumbing ---------------------------------------------------------------------------------------

    def _handle(self, workflow: WorkflowHandle[Any] | str) -> WorkflowHandle[Any]:
        return workflow if isinstance(workflow, WorkflowHandle) else self.app.handle(workflow)

    async def _store(self) -> Engine:
        return await self._internals.runtime().store()

    def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        return self._internals.call(fn)

    @staticmethod
    def wall_deadline(timeout: float) -> float:
        return time.monotonic() + timeout

    @staticmethod
    def wall_left(deadline: float) -> float:
        return max(0.0, deadline - time.monotonic())
