"""The dashboard's SQL (``pgflow dashboard``): every statement it runs against pgflow's tables.

Each one is planned once for any values (pgflow's connections force generic plans) and reads through
an index, and none counts more rows than a bound it is given: an open page must cost the database
about as much with ten million finished workflows as with ten (tests/test_dashboard_plans.py checks
the plans on a million). Values come back as stored bytes, and only when they are small enough to
show; the dashboard decodes them.
"""

from __future__ import annotations

from datetime import datetime
from itertools import combinations
from typing import Any, NamedTuple, TypedDict, cast

from .database import Port, Sql
from .overview import QueueRow
from .statement import ById


class ListedRow(NamedTuple):
    """The light columns of a workflow in a list, what a row of the table shows (``dashboard.data.Listed``)."""

    id: str
    name: str
    queue: str
    status: str
    attempt: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error_type: str | None
    error_message: str | None
    parent_id: str | None


# Each field of a listed row and the column that gives it.
_LISTED = {"attempt": "w.attempt - w.attempt_base", "error_type": "w.error->>'type'",
           "error_message": "left(w.error->>'message', 300)"}
LISTED_COLUMNS = tuple((field, _LISTED.get(field, f"w.{field}")) for field in ListedRow._fields)
LISTED_FIELDS = ListedRow._fields
LISTED = ", ".join(column for _, column in LISTED_COLUMNS)
# The list's filters. A page is read along the index of creation time alone, and its rows are then
# kept where the filters match (migration 0025 says why no filter has an index of its own).
FILTERS = ("name", "queue", "status")
FINISHED = "status IN ('succeeded', 'failed', 'cancelled')"  # the predicate of workflows_finished


def value_column(column: str, limit: str) -> str:
    """``column``'s size, and the column itself only when it is at most ``limit`` bytes."""
    return f"octet_length({column}), CASE WHEN octet_length({column}) <= {limit} THEN {column} END"


def _positions(since: bool) -> str:
    """The bound of a page's read of the index of creation time: before the cursor, and after ``since``."""
    return ("created_at > %(since)s AND " if since else "") + "(created_at, id) < (%(at)s, %(after)s)"


def list_statement(schema: str, filters: tuple[str, ...], since: bool) -> str:
    """The statement of one page of the list, newest first from the cursor on: the positions
    (created_at, id) come from the index of creation time alone, at most ``%(scan)s`` of them, and
    each row is then looked up by id and kept where the ``filters`` match. The inner LIMIT bounds
    the work of a page whose filters match rarely; the outer one stops the read as soon as the page
    is full. Only that index holds the positions' order, so the plan cannot read another one and
    filter it (which, for a rare queue, reads the whole table)."""
    matching = "".join(f" AND w.{name} = %({name})s" for name in filters)
    return (f"SELECT {LISTED} FROM (SELECT created_at, id FROM {schema}.workflows WHERE {_positions(since)}"
            " ORDER BY created_at DESC, id DESC LIMIT %(scan)s) page"
            f" JOIN {schema}.workflows w ON w.id = page.id{matching}"
            " ORDER BY page.created_at DESC, page.id DESC LIMIT %(limit)s")


def edge_statement(schema: str, since: bool) -> str:
    """Where a page's read of ``%(scan)s`` index entries stopped: the next page goes on from there."""
    return (f"SELECT created_at, id FROM {schema}.workflows WHERE {_positions(since)}"
            " ORDER BY created_at DESC, id DESC OFFSET %(scan)s - 1 LIMIT 1")


class Paging(TypedDict):
    """What a page of the list is read with: every filter (None: not given; a page's statement names
    only those given, and ``since`` only when it reads after a time), its cursor and its bounds."""

    name: str | None
    queue: str | None
    status: str | None
    since: datetime | None
    at: datetime
    after: str
    limit: int
    scan: int


# A page of the list for each set of filters given (in FILTERS' order) and whether it reads after a time;
# where a page's read stopped (created_at, id).
LISTING = {(given, since): Sql(list_statement("{s}", given, since), row=ListedRow, params=Paging)
           for n in range(len(FILTERS) + 1) for given in combinations(FILTERS, n) for since in (False, True)}
EDGE = {since: Sql(edge_statement("{s}", since), row=tuple[datetime, str], params=Paging) for since in (False, True)}


QUEUES = (
    # The queues with queued or running workflows, found by skipping along the partial indexes one
    # queue at a time (never reading a queue's rows), and those with limits or paused; at most %(queues)s.
    "WITH RECURSIVE waiting AS ("
    "  (SELECT queue, 1 AS n FROM {s}.workflows WHERE status = 'queued' ORDER BY queue LIMIT 1)"
    "  UNION ALL SELECT (SELECT w.queue FROM {s}.workflows w WHERE w.status = 'queued' AND w.queue > waiting.queue"
    "   ORDER BY w.queue LIMIT 1), n + 1 FROM waiting WHERE waiting.queue IS NOT NULL AND n < %(queues)s),"
    " busy AS ("
    "  (SELECT queue, 1 AS n FROM {s}.workflows WHERE status = 'running' ORDER BY queue LIMIT 1)"
    "  UNION ALL SELECT (SELECT w.queue FROM {s}.workflows w WHERE w.status = 'running' AND w.queue > busy.queue"
    "   ORDER BY w.queue LIMIT 1), n + 1 FROM busy WHERE busy.queue IS NOT NULL AND n < %(queues)s),"
    " named AS (SELECT queue FROM waiting WHERE queue IS NOT NULL UNION SELECT queue FROM busy"
    "  WHERE queue IS NOT NULL UNION SELECT name FROM (SELECT name FROM {s}.queues ORDER BY name"
    "  LIMIT %(queues)s) limited UNION SELECT name FROM (SELECT name FROM {s}.paused_queues ORDER BY name"
    "  LIMIT %(queues)s) paused)"
    # Counts read in index order, so each stops after %(cap)s entries (a bitmap scan would gather
    # every entry of a deep backlog before its limit applied).
    " SELECT n.queue,"
    "  (SELECT count(*) FROM (SELECT FROM {s}.workflows w WHERE w.status = 'queued' AND w.queue = n.queue"
    "   ORDER BY w.due_at LIMIT %(cap)s) c),"
    "  (SELECT count(*) FROM (SELECT FROM {s}.workflows w WHERE w.status = 'queued' AND w.queue = n.queue"
    "   AND w.due_at <= {s}.clock_now() ORDER BY w.due_at LIMIT %(cap)s) c),"
    "  (SELECT extract(epoch FROM {s}.clock_now() - w.due_at)::float8 FROM {s}.workflows w"
    "   WHERE w.status = 'queued' AND w.queue = n.queue AND w.due_at <= {s}.clock_now() ORDER BY w.due_at LIMIT 1),"
    "  (SELECT count(*) FROM (SELECT FROM {s}.workflows w WHERE w.status = 'running' AND w.queue = n.queue"
    "   ORDER BY w.queue LIMIT %(cap)s) c),"
    "  q.concurrency, q.rate_limit, q.rate_period, p.paused_at"
    " FROM (SELECT queue FROM named ORDER BY queue LIMIT %(queues)s) n"
    " LEFT JOIN {s}.queues q ON q.name = n.queue LEFT JOIN {s}.paused_queues p ON p.name = n.queue ORDER BY n.queue"
)


class WorkerLoad(NamedTuple):
    """A registered worker and what it runs, as ``WORKERS`` reads it (its columns, in order)."""

    id: str
    host: str
    pid: int
    queues: list[str]
    version: str
    names: list[str]  # the names it serves
    up: float  # seconds since it started
    heartbeat_age: float  # seconds since its heartbeat
    running: int  # workflows it runs
    expired: int  # of which leases expired
    running_names: list[str]
    running_counts: list[int]
    lease_seconds: float | None  # None: a worker of a version that did not record it


WORKERS = (
    # Each registered worker with what it runs: one pass over the running workflows (as many as the
    # fleet has slots, at most %(running)s read), grouped by the lease's owner and name.
    "WITH held AS (SELECT lease_owner, name, count(*) AS n,"
    "   count(*) FILTER (WHERE lease_expires_at < now()) AS expired"
    "  FROM (SELECT lease_owner, name, lease_expires_at FROM {s}.workflows WHERE status = 'running'"
    "   ORDER BY lease_expires_at LIMIT %(running)s) r GROUP BY lease_owner, name),"
    " per AS (SELECT lease_owner, sum(n)::int8 AS running, sum(expired)::int8 AS expired,"
    "  array_agg(name ORDER BY n DESC, name) AS names, array_agg(n::int8 ORDER BY n DESC, name) AS counts"
    "  FROM held GROUP BY lease_owner)"
    " SELECT w.id, w.host, w.pid, w.queues, w.version, w.names,"
    "  extract(epoch FROM now() - w.started_at)::float8, extract(epoch FROM now() - w.heartbeat_at)::float8,"
    "  coalesce(p.running, 0), coalesce(p.expired, 0), coalesce(p.names, '{}'), coalesce(p.counts, '{}'), w.lease"
    " FROM (SELECT * FROM {s}.workers ORDER BY started_at LIMIT %(workers)s) w"
    " LEFT JOIN per p ON p.lease_owner = w.id ORDER BY w.started_at"
)

THROUGHPUT = (
    # The most recent ends of the last %(window)s seconds, at most %(sample)s of them, read backwards
    # along workflows_finished; per queue and status, how many and the oldest end among them. When
    # the sample is full, the window it covers is shorter than asked, and rates are scaled from it.
    "SELECT queue, status, count(*), min(finished_at), {s}.clock_now() FROM (SELECT queue, status, finished_at"
    f" FROM {{s}}.workflows WHERE {FINISHED} AND finished_at > {{s}}.clock_now() - make_interval(secs => %(window)s)"
    " ORDER BY finished_at DESC LIMIT %(sample)s) recent GROUP BY queue, status ORDER BY queue, status"
)

def as_json(select: str, order: str) -> str:
    """A subquery's rows as one jsonb array (``[]`` for none), in ``order``."""
    return f"(SELECT coalesce(jsonb_agg(x ORDER BY {order}), '[]') FROM ({select}) x)"


def json_value(column: str, limit: str) -> str:
    """``column``'s size, and the column itself in base64 when it is at most ``limit`` bytes."""
    return (f"octet_length({column}) AS size,"
            f" CASE WHEN octet_length({column}) <= {limit} THEN encode({column}, 'base64') END AS value")


class WorkflowPage(NamedTuple):
    """A workflow's page as ``WORKFLOW`` reads it (``dashboard.data.detail_of`` reads it): its record, its
    arguments and result (their sizes, and themselves when at most ``%(big)s`` bytes), its error, the
    server's time, then each part as a list of JSON objects."""

    id: str
    name: str
    queue: str
    status: str
    attempt: int  # as pgflow.attempt() counts it
    claims: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    due_at: datetime | None
    priority: int
    max_attempts: int | None
    timeout: float | None
    deadline_at: datetime | None
    lease_owner: str | None
    lease_expires_at: datetime | None
    cancel_requested: bool
    waiting_for: str | None
    parent_id: str | None
    traceparent: str | None
    inputs_size: int
    inputs: bytes | None
    output_size: int | None
    output: bytes | None
    error: dict[str, Any] | None
    now: datetime
    steps: list[dict[str, Any]]
    tries: list[dict[str, Any]]
    retried: list[dict[str, Any]]
    events: list[dict[str, Any]]
    received: list[dict[str, Any]]
    sent: list[dict[str, Any]]
    streams: list[dict[str, Any]]
    ancestors: list[dict[str, Any]]
    descendants: list[dict[str, Any]]


# A workflow's page, in one statement (one snapshot, one round trip): its record, then each part as a
# jsonb array, every one read through an index and cut at a bound.
WORKFLOW = (
    "SELECT w.id, w.name, w.queue, w.status, w.attempt - w.attempt_base, w.attempt, w.created_at, w.started_at,"
    " w.finished_at, w.due_at, w.priority, w.max_attempts, w.timeout, w.deadline_at, w.lease_owner,"
    " w.lease_expires_at, w.cancel_requested, w.waiting_for, w.parent_id, w.traceparent,"
    f" {value_column('w.inputs', '%(big)s')}, {value_column('w.output', '%(big)s')}, w.error, now(),"
    + as_json(f"SELECT s.position, s.name, {json_value('s.output', '%(small)s')}, s.error, s.attempts,"
              " s.finished_at, s.wake_at, s.waiting, s.started_at FROM {s}.steps s WHERE s.workflow_id = w.id"
              " ORDER BY s.position LIMIT %(steps)s", "x.position") + ","
    + as_json("SELECT a.position, sum(a.tries)::int8 AS tries, min(a.started_at) AS started_at"
              " FROM {s}.step_attempts a WHERE a.workflow_id = w.id GROUP BY a.position", "x.position") + ","
    # The errors of the attempts that failed before each step's last (its record holds the last one's).
    + as_json("SELECT e.position, e.run, e.step_attempt, e.error, e.failed_at FROM {s}.step_errors e"
              " WHERE e.workflow_id = w.id ORDER BY e.position, e.run, e.step_attempt LIMIT %(rows)s",
              "x.position, x.run, x.step_attempt") + ","
    + as_json(f"SELECT e.key, {json_value('e.value', '%(small)s')}, e.set_at FROM {{s}}.events e"
              " WHERE e.workflow_id = w.id ORDER BY e.key LIMIT %(rows)s", "x.key") + ","
    + as_json(f"SELECT m.id, m.topic, {json_value('m.value', '%(small)s')}, m.idempotency_key, m.sent_at,"
              " m.consumed_at, m.consumed_position, m.workflow_id FROM {s}.messages m WHERE m.workflow_id = w.id"
              " ORDER BY m.id LIMIT %(rows)s", "x.id") + ","
    # Sent from the body without a key of their own: keyed "<this id>.<position>" ('/' follows '.').
    + as_json(f"SELECT m.id, m.topic, {json_value('m.value', '%(small)s')}, m.idempotency_key, m.sent_at,"
              " m.consumed_at, m.consumed_position, m.workflow_id FROM {s}.messages m"
              " WHERE m.idempotency_key IS NOT NULL"
              " AND (m.idempotency_key COLLATE \"C\") >= ((w.id || '.') COLLATE \"C\")"
              " AND (m.idempotency_key COLLATE \"C\") < ((w.id || '/') COLLATE \"C\")"
              " ORDER BY (m.idempotency_key COLLATE \"C\") LIMIT %(rows)s", "x.id") + ","
    # Each stream's length from its last chunk: one index entry, whatever its length.
    + as_json("SELECT i.key, i.id, last.position AS last, last.value IS NULL AS closed FROM {s}.stream_ids i"
              " LEFT JOIN LATERAL (SELECT c.position, c.value FROM {s}.chunks c WHERE c.stream_id = i.id"
              "  ORDER BY c.position DESC LIMIT 1) last ON true"
              " WHERE i.workflow_id = w.id ORDER BY i.key LIMIT %(rows)s", "x.key") + ","
    + "(WITH RECURSIVE up AS (SELECT p.id, p.name, p.status, p.parent_id, 1 AS depth FROM {s}.workflows p"
      "  WHERE p.id = w.parent_id"
      " UNION ALL SELECT p.id, p.name, p.status, p.parent_id, up.depth + 1 FROM {s}.workflows p"
      "  JOIN up ON p.id = up.parent_id WHERE up.depth < %(depth)s)"
      " SELECT coalesce(jsonb_agg(up ORDER BY up.depth DESC), '[]') FROM up),"
    # Breadth first and cut at %(rows)s: a parent of a hundred thousand children reads that many.
    # (Each generation's children looked up by their parent's id, a LIMIT apiece, so the planner
    # cannot join a generation to every workflow that has a parent.)
    # Listed generation by generation, each in the order its workflows were started.
    + "(WITH RECURSIVE down AS (SELECT c.id, c.name, c.status, c.parent_id, c.created_at, 1 AS depth"
      "  FROM {s}.workflows c WHERE c.parent_id = w.id"
      " UNION ALL SELECT c.id, c.name, c.status, c.parent_id, c.created_at, down.depth + 1 FROM down"
      "  CROSS JOIN LATERAL (SELECT k.id, k.name, k.status, k.parent_id, k.created_at FROM {s}.workflows k"
      "   WHERE k.parent_id = down.id LIMIT %(rows)s) c WHERE down.depth < %(depth)s)"
      " SELECT coalesce(jsonb_agg(d ORDER BY d.depth, d.created_at, d.id), '[]')"
      "  FROM (SELECT * FROM down LIMIT %(rows)s) d)"
    " FROM {s}.workflows w WHERE w.id = %(id)s"
)
FINGERPRINT = (
    # What changes while a workflow runs, read from index entries: the page re-reads itself when it does.
    "SELECT w.status, w.attempt, w.due_at, w.cancel_requested,"
    " (SELECT s.position FROM {s}.steps s WHERE s.workflow_id = w.id ORDER BY s.position DESC LIMIT 1),"
    " (SELECT sum(a.tries)::int8 FROM {s}.step_attempts a WHERE a.workflow_id = w.id),"
    " (SELECT max(e.set_at) FROM {s}.events e WHERE e.workflow_id = w.id),"
    " (SELECT m.id FROM {s}.messages m WHERE m.workflow_id = w.id ORDER BY m.id DESC LIMIT 1),"
    " (SELECT count(*) FROM (SELECT FROM {s}.stream_ids i WHERE i.workflow_id = w.id LIMIT 100) k)"
    " FROM {s}.workflows w WHERE w.id = %(id)s"
)
CHUNKS = (f"SELECT position, {value_column('value', '%(small)s')} FROM {{s}}.chunks WHERE stream_id = %(stream)s"
          " AND position >= %(offset)s ORDER BY position LIMIT %(rows)s")
ESTIMATE = "SELECT reltuples::float8 FROM pg_catalog.pg_class WHERE oid = %(table)s::regclass"


class Queues(TypedDict):
    queues: int
    cap: int


class Workers(TypedDict):
    workers: int
    running: int


class Sampling(TypedDict):
    window: float
    sample: int


class WorkflowRead(TypedDict):
    id: str
    big: int
    small: int
    steps: int
    rows: int
    depth: int


class ChunksRead(TypedDict):
    stream: int
    offset: int
    rows: int
    small: int


class Table(TypedDict):
    table: str  # quoted, with its schema


# A workflow's state as FINGERPRINT reads it; the ends of a queue and status (queue, status, ends, the
# oldest of them, now); a chunk (position, size, value when small).
Fingerprint = tuple[str, int, datetime | None, bool, int | None, int | None, datetime | None, int | None, int]
Ends = tuple[str, str, int, datetime, datetime]
Chunk = tuple[int, int | None, bytes | None]
# The statements above, as the executor runs them.
READ_QUEUES = Sql(QUEUES, row=QueueRow, params=Queues)
READ_WORKERS = Sql(WORKERS, row=WorkerLoad, params=Workers)
READ_THROUGHPUT = Sql(THROUGHPUT, row=cast("type[Ends]", Ends), params=Sampling)
READ_WORKFLOW = Sql(WORKFLOW, row=WorkflowPage, params=WorkflowRead)
READ_FINGERPRINT = Sql(FINGERPRINT, row=cast("type[Fingerprint]", Fingerprint), params=ById)
READ_CHUNKS = Sql(CHUNKS, row=cast("type[Chunk]", Chunk), params=ChunksRead)
READ_ESTIMATE = Sql(ESTIMATE, row=tuple[float], params=Table)


class Dashboard(Port):
    """The dashboard's reads. Each method is one statement (a workflow's page one snapshot)."""

    async def queues(self, queues: int, cap: int) -> list[QueueRow]:
        """The queues with work or limits, each count at most ``cap``; at most ``queues`` queues."""
        return await self.db.rows(READ_QUEUES, queues=queues, cap=cap)

    async def workers(self, workers: int, running: int) -> list[WorkerLoad]:
        """The registered workers (at most ``workers``) and what they run."""
        return await self.db.rows(READ_WORKERS, workers=workers, running=running)

    async def throughput(self, window: float, sample: int) -> list[Ends]:
        """(queue, status, ends, the oldest of them, now) over the last ``window`` seconds' ends, at
        most ``sample`` of them."""
        return await self.db.rows(READ_THROUGHPUT, window=window, sample=sample)

    async def estimated_workflows(self) -> float:
        """The planner's estimate of the workflows table's rows (-1: never analyzed)."""
        row = await self.db.row(READ_ESTIMATE, table=f"{self.db.quoted}.workflows")
        return row[0] if row else -1.0

    async def list_page(self, filters: dict[str, str], since: datetime | None, at: datetime, after: str,
                        limit: int, scan: int) -> tuple[list[ListedRow], tuple[datetime, str] | None]:
        """One page of the list, newest first: the rows older than (``at``, ``after``) that match
        ``filters`` (name, queue, status) and were created after ``since``; at most ``limit`` of
        them, from at most ``scan`` index entries. Also where a read that found fewer than
        ``limit`` stopped short (None: it reached the end)."""
        given = tuple(name for name in FILTERS if name in filters)
        page: Paging = {"name": filters.get("name"), "queue": filters.get("queue"), "status": filters.get("status"),
                        "since": since, "at": at, "after": after, "limit": limit, "scan": scan}
        async with self.db.session() as s:
            rows = await s.rows(LISTING[given, since is not None], **page)
            if len(rows) >= limit or not given:
                return rows, None
            return rows, await s.row(EDGE[since is not None], **page)

    async def workflow(self, workflow_id: str, big: int, small: int, steps: int, rows: int,
                       depth: int) -> WorkflowPage | None:
        """Everything a workflow's page shows, in one statement: its record (the arguments and the
        result only when at most ``big`` bytes), then as jsonb arrays its first ``steps`` steps, the
        tries of steps under way, the errors of attempts retried, events, messages received and sent,
        streams, ancestors and descendants (``rows`` of each at most, values only when at most
        ``small`` bytes, in base64); None when there is no such workflow."""
        return await self.db.row(READ_WORKFLOW, id=workflow_id, big=big, small=small, steps=steps, rows=rows,
                                 depth=depth)

    async def fingerprint(self, workflow_id: str) -> Fingerprint | None:
        """A workflow's state, changes of which the page shows: status, attempt, due time, cancel
        requested, last journal position, step tries under way, last event time, last message,
        streams; None when there is no such workflow."""
        return await self.db.row(READ_FINGERPRINT, id=workflow_id)

    async def chunks(self, stream_id: int, offset: int, rows: int, small: int) -> list[Chunk]:
        """(position, size, value when at most ``small`` bytes) of a stream's chunks from ``offset``."""
        return await self.db.rows(READ_CHUNKS, stream=stream_id, offset=offset, rows=rows, small=small)
