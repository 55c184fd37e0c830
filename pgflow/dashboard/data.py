"""What the dashboard reads, and how often: decoded records over the statements of
``pgflow._core.engine.dashboard``, with the overview's parts shared by every open page.

The cost for the database is set here. The overview's queues and workers are read at most once per
``OVERVIEW_EVERY`` seconds, its health once per ``HEALTH_EVERY`` and its throughput once per
``THROUGHPUT_EVERY``, whatever the number of pages open (each live page is served from the shared
snapshot); a workflow's page costs one statement, and while it is open one small statement per
``WATCH_EVERY`` seconds to see whether it changed. ``statements`` counts what was sent.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

import anyio

from .._core.codec import decode
from .._core.engine.dashboard import Dashboard
from .._core.status import Status
from ..app import App
from ..records import Health, QueueInfo, WorkflowRecord

T = TypeVar("T")

OVERVIEW_EVERY = 4.0  # seconds between two reads of the queues and the workers
HEALTH_EVERY = 15.0
THROUGHPUT_EVERY = 15.0
WATCH_EVERY = 2.0  # seconds between two looks at whether an open workflow page changed

COUNT_CAP = 10_000  # a count over a queue stops here and reads "10,000+"
MAX_QUEUES = 200
MAX_WORKERS = 500
MAX_RUNNING = 20_000  # running workflows read to say what each worker runs
THROUGHPUT_WINDOW = 3600.0
THROUGHPUT_SAMPLE = 20_000  # ends read to measure the last hour's throughput; past it, a rate is scaled
LIVE_AFTER = 30.0  # seconds of heartbeat silence after which a worker counts as dead (as pgflow status)

BIG_VALUE = 256 * 1024  # bytes of arguments or a result shown decoded; a bigger one shows its size
SMALL_VALUE = 8 * 1024  # bytes of a step output, an event, a message or a chunk shown decoded
MAX_STEPS = 2000
MAX_ROWS = 200  # events, messages, streams, descendants shown
MAX_DEPTH = 8  # generations of ancestors and descendants followed
TAIL = 100  # chunks of a stream shown on its page before the live part takes over


@dataclass(frozen=True)
class Value:
    """A stored value as the page shows it: decoded when it was small enough to read (``shown``),
    else only its size."""

    size: int | None
    shown: bool
    value: Any = None

    @classmethod
    def of(cls, size: int | None, data: bytes | str | None) -> Value:
        if data is None:
            return cls(size, False)
        raw = base64.b64decode(data) if isinstance(data, str) else bytes(data)
        try:
            return cls(size, True, decode(raw))
        except Exception:  # noqa: BLE001 - rows are data: one that does not decode shows as bytes
            return cls(size, True, raw)


@dataclass(frozen=True)
class QueueRow(QueueInfo):
    """A queue as ``queues_overview`` tells it, with its ends over the last hour."""

    finished_last_hour: float = 0.0  # an estimate when ``estimated`` in the Throughput
    failed_last_hour: float = 0.0


@dataclass(frozen=True)
class WorkerRow:
    id: str
    host: str
    pid: int
    queues: list[str]
    version: str
    names: list[str]
    up_s: float
    heartbeat_age_s: float
    running: int
    expired_leases: int
    running_names: list[tuple[str, int]]
    lease_s: float | None = None

    @property
    def dead(self) -> bool:
        """A heartbeat older than its lease (LIVE_AFTER seconds for a worker that did not record its
        lease), or leases of its that have run out: its workflows are anybody's to take."""
        silent_after = self.lease_s if self.lease_s is not None else LIVE_AFTER
        return self.heartbeat_age_s > silent_after or self.expired_leases > 0


@dataclass(frozen=True)
class Throughput:
    window_s: float  # the span the counts cover: the hour, or less when the sample was full
    estimated: bool
    per_queue: dict[str, tuple[float, float]]  # queue -> (ends per hour, failures per hour)


@dataclass(frozen=True)
class Overview:
    queues: list[QueueRow]
    workers: list[WorkerRow]
    throughput: Throughput
    health: Health | None
    health_error: str | None
    listener: dict[str, Any]
    estimated_workflows: float
    read_at: float


@dataclass(frozen=True)
class Listed(WorkflowRecord):
    """A row of the list: the record ``list_workflows`` gives, with the start of the error's message.
    The list reads ``LISTED_FIELDS`` only; the record's other fields keep their defaults."""

    error_message: str | None = None


@dataclass(frozen=True)
class Page:
    rows: list[Listed]
    next_cursor: tuple[datetime, str] | None
    scanned_short: bool  # fewer rows than asked, and the read stopped at its bound: more may match


@dataclass(frozen=True)
class Step:
    position: int
    name: str
    output: Value
    error: dict[str, Any] | None
    attempts: int
    finished_at: datetime
    wake_at: datetime | None
    waiting: bool
    since_previous_s: float | None  # from the previous entry's end (or the start) to this one's
    started_at: datetime | None = None  # its first attempt's start (None: recorded before 0017)
    retried_errors: tuple[dict[str, Any], ...] = ()  # the attempts that failed before its last

    @property
    def duration_s(self) -> float | None:
        return None if self.started_at is None else (self.finished_at - self.started_at).total_seconds()


@dataclass(frozen=True)
class Message:
    id: int
    topic: str
    value: Value
    idempotency_key: str | None
    sent_at: datetime
    consumed_at: datetime | None
    consumed_position: int | None
    to: str


@dataclass(frozen=True)
class StreamRow:
    key: str
    stream_id: int
    length: int
    closed: bool


@dataclass(frozen=True)
class Relative:
    id: str
    name: str
    status: str
    depth: int
    parent_id: str | None = None


@dataclass(frozen=True)
class Detail:
    record: dict[str, Any]
    arguments: Value
    result: Value
    error: dict[str, Any] | None
    steps: list[Step]
    more_steps: bool
    tries_under_way: dict[int, tuple[int, datetime | None]]  # position -> (attempts started, first start)
    events: list[tuple[str, Value, datetime]]
    received: list[Message]
    sent: list[Message]
    streams: list[StreamRow]
    ancestors: list[Relative]
    descendants: list[Relative]
    now: datetime


RECORD_FIELDS = ("id", "name", "queue", "status", "attempt", "claims", "created_at", "started_at", "finished_at",
                 "due_at", "priority", "max_attempts", "timeout", "deadline_at", "lease_owner", "lease_expires_at",
                 "cancel_requested", "waiting_for", "parent_id", "traceparent")


def _time(text: str | None) -> datetime | None:
    return None if text is None else datetime.fromisoformat(text)


def _message(row: dict[str, Any]) -> Message:
    return Message(int(row["id"]), str(row["topic"]), Value.of(row["size"], row["value"]), row["idempotency_key"],
                   datetime.fromisoformat(row["sent_at"]), _time(row["consumed_at"]), row["consumed_position"],
                   str(row["workflow_id"]))


def detail_of(row: tuple[Any, ...]) -> Detail:
    """A workflow's page from the row of ``Dashboard.workflow``."""
    n = len(RECORD_FIELDS)
    record = dict(zip(RECORD_FIELDS, row[:n], strict=True))
    (in_size, inputs, out_size, output, error, now, steps, tries, retried, events, received, sent, streams,
     ancestors, descendants) = row[n:]
    errors: dict[int, list[dict[str, Any]]] = {}
    for e in retried:
        errors.setdefault(int(e["position"]), []).append(
            {**(e["error"] or {}), "run": e["run"], "step_attempt": e["step_attempt"], "failed_at": e["failed_at"]})
    previous = record["started_at"] or record["created_at"]
    timeline = []
    for s in steps[:MAX_STEPS]:
        finished = datetime.fromisoformat(s["finished_at"])
        timeline.append(Step(int(s["position"]), str(s["name"]), Value.of(s["size"], s["value"]), s["error"],
                             int(s["attempts"]), finished, _time(s["wake_at"]), bool(s["waiting"]),
                             (finished - previous).total_seconds() if previous is not None else None,
                             _time(s.get("started_at")), tuple(errors.get(int(s["position"]), ()))))
        previous = finished
    return Detail(
        record, Value.of(in_size, inputs), Value.of(out_size, output), error, timeline, len(steps) >= MAX_STEPS,
        {int(t["position"]): (int(t["tries"]), _time(t.get("started_at"))) for t in tries},
        [(str(e["key"]), Value.of(e["size"], e["value"]), datetime.fromisoformat(e["set_at"])) for e in events],
        [_message(m) for m in received], [_message(m) for m in sent],
        [StreamRow(str(s["key"]), int(s["id"]), 0 if s["last"] is None else int(s["last"]) + (0 if s["closed"] else 1),
                   bool(s["closed"])) for s in streams],
        [Relative(str(a["id"]), str(a["name"]), str(a["status"]), int(a["depth"])) for a in ancestors],
        [Relative(str(d["id"]), str(d["name"]), str(d["status"]), int(d["depth"]), d["parent_id"])
         for d in descendants],
        now)


class _Cached:
    """One value refreshed at most every ``every`` seconds, however many ask; concurrent askers
    share one read."""

    def __init__(self, every: float) -> None:
        self.every = every
        self.value: Any = None
        self.at = -float("inf")
        self.lock = anyio.Lock()

    def stale(self) -> None:
        """Read anew on the next ``get`` (after an action changed what it holds)."""
        self.at = -float("inf")

    async def get(self, read: Callable[[], Awaitable[T]]) -> T:
        if time.monotonic() - self.at < self.every:
            return self.value  # type: ignore[no-any-return]
        async with self.lock:
            if time.monotonic() - self.at >= self.every:
                self.value = await read()
                self.at = time.monotonic()
            return self.value  # type: ignore[no-any-return]


@dataclass
class Reader:
    """The dashboard's reads of one App, on the server's event loop."""

    app: App
    statements: int = 0  # statements sent to the database so far
    started: float = field(default_factory=time.monotonic)
    _overview: _Cached = field(default_factory=lambda: _Cached(OVERVIEW_EVERY))
    _health: _Cached = field(default_factory=lambda: _Cached(HEALTH_EVERY))
    _throughput: _Cached = field(default_factory=lambda: _Cached(THROUGHPUT_EVERY))
    _estimate: _Cached = field(default_factory=lambda: _Cached(60.0))
    _watched: dict[str, tuple[float, Any]] = field(default_factory=dict)

    async def _db(self, fn: Callable[[Dashboard], Awaitable[T]], cost: int = 1) -> T:
        runtime = self.app._internals().runtime()

        self.statements += cost
        return await runtime.db(lambda store: fn(store.dashboard))

    def changed(self) -> None:
        """An action of this dashboard changed the queues: the next overview reads them anew."""
        self._overview.stale()
        self._health.stale()

    def rate(self) -> float:
        """Statements per second since the server started."""
        return self.statements / max(1.0, time.monotonic() - self.started)

    async def overview(self) -> Overview:
        async def parts() -> tuple[list[QueueRow], list[WorkerRow]]:
            queues = await self._db(lambda d: d.queues(MAX_QUEUES, COUNT_CAP))
            workers = await self._db(lambda d: d.workers(MAX_WORKERS, MAX_RUNNING))
            return ([QueueRow(str(q.queue), int(q.queued), int(q.due), q.waited, int(q.running), q.concurrency,
                              q.rate_limit, q.rate_period, q.paused_at) for q in queues],
                    [WorkerRow(str(w.id), str(w.host), int(w.pid), list(w.queues), str(w.version), list(w.names),
                               float(w.up), float(w.heartbeat_age), int(w.running), int(w.expired),
                               list(zip(w.running_names, w.running_counts, strict=True)),
                               None if w.lease_seconds is None else float(w.lease_seconds))
                     for w in workers])

        queues, workers = await self._overview.get(parts)
        throughput = await self._throughput.get(self._read_throughput)
        health, health_error = await self._health.get(self._read_health)
        estimate = await self._estimate.get(lambda: self._db(lambda d: d.estimated_workflows()))
        by_queue = {q.name: q for q in queues}
        for name in throughput.per_queue:
            if name not in by_queue:
                by_queue[name] = QueueRow(name, 0, 0, None, 0, None, None, None)
        rows = [QueueRow(**{**q.__dict__, "finished_last_hour": throughput.per_queue.get(q.name, (0.0, 0.0))[0],
                            "failed_last_hour": throughput.per_queue.get(q.name, (0.0, 0.0))[1]})
                for q in sorted(by_queue.values(), key=lambda q: q.name)]
        stats = self.app.stats()
        listener = {"connected": stats.listeners_connected > 0, "reconnects": stats.listener_reconnects,
                    "pings_rejected": stats.pings_rejected, "queue_usage": stats.notification_queue_usage}
        return Overview(rows, workers, throughput, health, health_error, listener, estimate, time.time())

    async def _read_throughput(self) -> Throughput:
        rows = await self._db(lambda d: d.throughput(THROUGHPUT_WINDOW, THROUGHPUT_SAMPLE))
        total = sum(int(r[2]) for r in rows)
        estimated = total >= THROUGHPUT_SAMPLE
        window = THROUGHPUT_WINDOW
        if estimated and rows:
            oldest, now = min(r[3] for r in rows), rows[0][4]
            window = max(1.0, (now - oldest).total_seconds())
        scale = THROUGHPUT_WINDOW / window
        per: dict[str, tuple[float, float]] = {}
        for queue, status, n, _, _ in rows:
            ends, failed = per.get(queue, (0.0, 0.0))
            per[queue] = (ends + int(n) * scale, failed + (int(n) * scale if status == Status.FAILED else 0.0))
        return Throughput(window, estimated, per)

    async def _read_health(self) -> tuple[Health | None, str | None]:
        # pgflow status's own probe: the workers, the NOTIFY queue, unserved names, stuck sessions, the
        # NOTIFY queue's holders, the queues' waiting work, lock holders.
        self.statements += 7
        try:
            return await self.app.health_async(), None
        except Exception as exc:  # noqa: BLE001 - e.g. a role that may not read pg_locks: shown, not fatal
            return None, f"{type(exc).__name__}: {exc}"

    async def list_page(self, filters: dict[str, str], since: datetime | None, cursor: tuple[datetime, str],
                        limit: int, scan: int) -> Page:
        rows, edge = await self._db(lambda d: d.list_page(filters, since, cursor[0], cursor[1], limit, scan),
                                    cost=2 if filters else 1)  # a filtered page may read its edge too
        listed = [Listed(**r._asdict()) for r in rows]
        if len(listed) >= limit:
            return Page(listed, (listed[-1].created_at, listed[-1].id), False)
        return Page(listed, edge, edge is not None)

    async def workflow(self, workflow_id: str) -> Detail | None:
        row = await self._db(lambda d: d.workflow(workflow_id, BIG_VALUE, SMALL_VALUE, MAX_STEPS, MAX_ROWS,
                                                  MAX_DEPTH))
        return None if row is None else detail_of(row)

    async def fingerprint(self, workflow_id: str) -> Any:
        """What changes on a workflow's page, read at most once per WATCH_EVERY seconds per workflow
        however many pages watch it (None: no such workflow)."""
        seen = self._watched.get(workflow_id)
        if seen is not None and time.monotonic() - seen[0] < WATCH_EVERY * 0.75:
            return seen[1]
        value = await self._db(lambda d: d.fingerprint(workflow_id))
        if len(self._watched) > 1000:
            self._watched.clear()
        self._watched[workflow_id] = (time.monotonic(), value)
        return value

    async def tail(self, stream_id: int, offset: int) -> list[tuple[int, Value]]:
        rows = await self._db(lambda d: d.chunks(stream_id, offset, TAIL, SMALL_VALUE))
        return [(int(p), Value.of(size, value)) for p, size, value in rows]
