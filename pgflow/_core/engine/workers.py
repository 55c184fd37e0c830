"""The worker registry: who is alive, which leases their heartbeats keep, and each worker's fence."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, TypedDict

from .database import Port, Sql
from .fencing import held


class Held(NamedTuple):
    """A lease a heartbeat extended: on the workflow ``id``, claim number ``attempt``."""

    id: str
    attempt: int
    cancel_requested: bool


def new_fence(worker: str) -> str:
    """The worker's fence (migration 0026) if it has none, with a new epoch; ``worker``: its id's parameter."""
    return (f"INSERT INTO {{s}}.worker_fences (worker, epoch) VALUES (%({worker})s, (random() * 4e18)::int8)"
            " ON CONFLICT (worker) DO NOTHING")


class Registering(TypedDict):
    """A worker as the registry records it (``REGISTER``; its heartbeat's upsert, ``HEARTBEAT``)."""

    host: str
    pid: int
    queues: list[str]
    version: str
    names: list[str]
    lease: float | None


class Register(Registering):
    id: str


class Beating(Registering):
    owner: str  # the worker's id
    running: list[str]  # the workflows it runs, sorted


class OfWorker(TypedDict):
    id: str


# A worker registered, with a fence of its own.
REGISTER = Sql(
    "WITH fence AS (" + new_fence("id") + ")"
    " INSERT INTO {s}.workers (id, host, pid, queues, version, names, lease)"
    " VALUES (%(id)s, %(host)s, %(pid)s, %(queues)s, %(version)s, %(names)s, %(lease)s)",
    row=None, params=Register)
# A worker forgotten with its fence.
UNREGISTER = Sql(
    "WITH gone AS (DELETE FROM {s}.worker_fences WHERE worker = %(id)s)"
    " DELETE FROM {s}.workers WHERE id = %(id)s", row=None, params=OfWorker)
# A heartbeat (``Workers.heartbeat``): the worker alive, its fence there, the leases it names extended.
HEARTBEAT = Sql(
    # An upsert: a worker the others forgot (it was cut off for a while) comes back.
    "WITH alive AS (INSERT INTO {s}.workers (id, host, pid, queues, version, names, lease)"
    "   VALUES (%(owner)s, %(host)s, %(pid)s, %(queues)s, %(version)s, %(names)s, %(lease)s)"
    "   ON CONFLICT (id) DO UPDATE SET heartbeat_at = now()),"
    # (a fence lost with a crash or a failover is made anew, with another epoch)
    " fence AS (" + new_fence("owner") + "),"
    " lazy AS (SELECT set_config('synchronous_commit', 'off', true)),"
    # (``running`` comes sorted: the rows are locked in id order)
    " " + held("renewed", "(SELECT unnest(%(running)s::text[]) AS id)", "w.id", lock=" FOR UPDATE",
               by="w.lease_owner = %(owner)s") +
    " UPDATE {s}.workflows SET lease_expires_at = now() + make_interval(secs => %(lease)s)"
    " WHERE id IN (SELECT id FROM renewed) AND EXISTS (SELECT FROM lazy)"
    " RETURNING id, attempt, cancel_requested", row=Held, params=Beating)


class Silent(NamedTuple):
    seconds: float


# The workers silent for a while forgotten, with their fences; how many.
FORGET = Sql(
    "WITH forgotten AS (DELETE FROM {s}.workers WHERE heartbeat_at < now() - make_interval(secs => %s)"
    "  RETURNING id),"
    # (their fences locked in the order claims lock them: see claims.CLAIM)
    " doomed AS (SELECT worker FROM {s}.worker_fences WHERE worker IN (SELECT id FROM forgotten)"
    "  ORDER BY worker FOR UPDATE),"
    " gone AS (DELETE FROM {s}.worker_fences WHERE worker IN (SELECT worker FROM doomed))"
    " SELECT count(*) FROM forgotten", row=tuple[int], params=Silent)


class Workers(Port):
    """The port that registers workers, takes their heartbeats and forgets the silent ones."""

    async def register_worker(self, id: str, host: str, pid: int, queues: Sequence[str],
                              version: str, names: Sequence[str], lease_seconds: float | None = None) -> None:
        await self.db.run(REGISTER, id=id, host=host, pid=pid, queues=list(queues), version=version,
                          names=list(names), lease=lease_seconds)

    async def unregister_worker(self, id: str) -> None:
        await self.db.run(UNREGISTER, id=id)

    async def heartbeat(self, owner: str, lease_seconds: float, host: str, pid: int, queues: Sequence[str],
                        version: str, names: Sequence[str], running: Sequence[str],
                        within: float) -> list[Held]:
        """Say this worker lives and extend the leases ``owner`` holds on the workflows it is still
        ``running``, in one statement; return each lease extended. (Not every
        lease it holds: one on a workflow it gave up, whose release failed, must run out.)

        A heartbeat lost in a crash harms nothing (the leases simply run out), so it does not wait
        for the disk. One not answered ``within`` seconds is abandoned with its connection: the next
        one, on a fresh link, may still come in time."""
        async with self.db.session(within=within) as s:
            return await s.rows(HEARTBEAT, owner=owner, lease=lease_seconds, host=host, pid=pid, queues=list(queues),
                                version=version, names=list(names), running=list(running))

    async def forget_workers(self, silent_for: float) -> int:
        """Forget the workers whose heartbeat has been silent for ``silent_for`` seconds."""
        row = await self.db.row(FORGET, silent_for)
        return row[0] if row else 0
