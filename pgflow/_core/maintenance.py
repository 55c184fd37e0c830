"""Maintenance services, each run by one worker of the fleet at a time.

Work that must happen once for the whole fleet (starting a schedule's ticks, forgetting dead workers)
runs as a small service on whichever worker holds that service's advisory lock. Every worker keeps one
connection for these locks and tries, every ``interval`` seconds, to take the locks of the services it
can run; when the holder dies its session ends, the lock is free, and another worker takes the service
over within an interval. Each schedule has a lock of its own, so workers that register different
scheduled workflows each serve theirs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta

import anyio
import psycopg

from ..cron import Cron
from .clock import Clock
from .connecting import users_application_name
from .engine import sessions
from .pool import answered_within

log = logging.getLogger("pgflow.maintenance")

Service = Callable[[], Awaitable[None]]

# The fleet's services besides the schedules.
REAPER, RETENTION, PARTITIONS, NAMES, KEYS = "reaper", "retention", "partitions", "names", "keys"
ROTATION_OVERLAP = 120.0  # seconds between a new signal key's arrival and its use (four keyring reloads)
APPLICATION = "pgflow-maintenance-"  # + the pid: the application name of a worker's lock connection


def cron_service(workflow_name: str) -> str:
    """The service that starts the ticks of a scheduled workflow."""
    return f"cron:{workflow_name}"


def lock_name(schema: str, service: str) -> str:
    """What the advisory lock of a service is taken by (``hashtext`` of it): one lock per schema and
    service. Any role can take an advisory lock, so ``pgflow status`` names who holds each."""
    return f"pgflow.{schema}.{service}"


def lock_connection_name(dsn: str) -> str:
    """The application name of a worker's lock connection: ``pgflow status`` tells a worker's hold on a
    service's lock from anybody else's by its ``pgflow-maintenance-<pid>`` start (any role may take an
    advisory lock), so that comes first, and the user's own name, when the DSN or ``PGAPPNAME`` gives
    one, follows in brackets for their monitoring (the server keeps 63 bytes)."""
    own = f"{APPLICATION}{os.getpid()}"
    users = users_application_name(dsn)
    return own if users is None else f"{own} ({users})"


class Maintenance:
    """Elects this worker for the services it offers and runs those it wins."""

    def __init__(self, conninfo: str, schema: str, services: dict[str, Service], interval: float,
                 query_timeout: float) -> None:
        self._conninfo = conninfo
        self._query_timeout = query_timeout
        self._schema = schema
        self._services = services
        self._interval = interval
        self.leading: set[str] = set()

    async def run(self) -> None:
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(
                    self._conninfo, autocommit=True, application_name=lock_connection_name(self._conninfo))
                async with conn:
                    await self._lead(conn)
            except* (psycopg.Error, OSError) as lost:  # from the task group of the services, too
                log.warning("maintenance connection lost (%s); its services move to another worker",
                            lost.exceptions[0])
            finally:
                self.leading.clear()
            await anyio.sleep(self._interval)

    async def _lead(self, conn: psycopg.AsyncConnection[tuple[object, ...]]) -> None:
        async with anyio.create_task_group() as services:
            while True:
                for name, service in self._services.items():
                    if name in self.leading:
                        continue
                    with answered_within(conn, self._query_timeout):
                        won = await sessions.try_lock(conn, lock_name(self._schema, name))
                    if won:
                        log.info("this worker now runs the %s service", name)
                        self.leading.add(name)
                        services.start_soon(_keep_running, name, service)
                if len(self.leading) == len(self._services):
                    with answered_within(conn, self._query_timeout):  # a dead or frozen session must
                        await sessions.answer(conn)  # end the services it holds
                await anyio.sleep(self._interval)


async def _keep_running(name: str, service: Service) -> None:
    while True:
        try:
            await service()
            return
        except Exception:
            log.exception("maintenance service %s failed; restarting it", name)
            await anyio.sleep(1.0)


def every(seconds: float, chore: Callable[[], Awaitable[object]], what: str, *, shielded: bool = True) -> Service:
    """A service that does ``chore`` every ``seconds``, logging (not stopping on) database errors.
    A ``shielded`` chore (one statement) is not cut short when the worker stops; a long one (many
    statements, each complete in itself) is."""

    async def service() -> None:
        while True:
            try:
                with anyio.CancelScope(shield=shielded):
                    await chore()
            except (psycopg.Error, OSError) as exc:
                log.warning("%s failed: %s", what, exc)
            await anyio.sleep(seconds)

    return service


def schedule(cron: Cron, start_tick: Callable[[datetime], Awaitable[object]], catch_up: float,
             clock: Clock | None = None) -> Service:
    """A service that starts a workflow at every tick of ``cron``. A tick that fell in the last
    ``catch_up`` seconds before the service started (while the previous holder was dying) is started
    too; the tick's workflow id makes a second start of it a no-op. Ticks follow ``clock`` (the App's)."""
    clock = clock or Clock()
    name = f"schedule {cron.expression!r} {id(start_tick):x}"

    async def service() -> None:
        tick = cron.next_after(clock.now() - timedelta(seconds=catch_up))
        while True:
            await clock.sleep(max(0.0, (tick - clock.now()).total_seconds()), service=name)
            try:
                with anyio.CancelScope(shield=True):
                    await start_tick(tick)
            except (psycopg.Error, OSError) as exc:
                log.warning("could not start the tick %s: %s", tick.isoformat(), exc)
            tick = cron.next_after(max(tick, clock.now() - timedelta(seconds=catch_up)))

    return service
