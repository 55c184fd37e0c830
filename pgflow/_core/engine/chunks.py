"""The SQL of streams: reading the ends once per execution, naming streams by id, group-committed
writes, shared reads.

A stream is named once in ``stream_ids`` (workflow, key) -> id, and its chunks are keyed (stream id,
position): a bigint key instead of two text columns in every index entry of the hot insert.
"""

from __future__ import annotations

from typing import NamedTuple, TypedDict, cast

from . import wire
from .channel import Pings, Riding, riding
from .database import Port, Sql
from .fencing import held
from .statement import Id

# The fence of a batch of chunks, the one place that says whose chunks may be written: the workflow
# rows the writers named (``asked``: ordinal i, id, lease, in id order, the order rows are locked in
# everywhere) that are still running under the same execution. Each row is locked FOR SHARE, so no
# claim can take the workflow over between this check and the commit, and then checked, on the row as
# it is once locked (fencing.held).
_FENCE = " " + held("fence", "asked", "a.i, w.id, w.cancel_requested", lock=" FOR SHARE") + ","


class Chunked(Riding):
    """What every batch of chunks is written with: each chunk's stream, position and value."""

    streams: wire.Int8s
    positions: wire.Int4s
    values: wire.Byteas


class Writing(Chunked):
    ids: wire.Texts  # the executions writing, in id order, with their claim's token
    leases: wire.Int8s
    owners: wire.Int8s  # each chunk's execution, by its place in ids (from 1)
    n: wire.Int4


class ByWorker(Chunked):
    worker: wire.Text
    epoch: wire.Int8


def _write(again: bool) -> str:
    """A batch of chunks from many executions, fenced, with its pings (``write_chunks``); a row for each
    execution fenced out or whose cancellation was requested: (id, lease, fenced out, cancelled)."""
    return (
        "WITH asked AS MATERIALIZED (SELECT * FROM unnest(%(ids)b::text[], %(leases)b::int8[])"
        "   WITH ORDINALITY AS a(id, lease, i) ORDER BY id),"
        + _FENCE +
        " written AS (INSERT INTO {s}.chunks (stream_id, position, value)"
        "   SELECT b.s, b.p, b.v FROM unnest(%(owners)b::int8[], %(streams)b::int8[], %(positions)b::int[],"
        "    %(values)b::bytea[]) AS b(o, s, p, v)"
        "   JOIN fence f ON f.i = b.o"
        f"  {'ON CONFLICT DO NOTHING' if again else ''} RETURNING 1)"
        " SELECT a.id, a.lease, f.id IS NULL, coalesce(f.cancel_requested, false)"
        " FROM asked a LEFT JOIN fence f ON f.i = a.i"
        " WHERE f.id IS NULL OR f.cancel_requested"
        + riding(4, "(SELECT count(*) FROM fence) = %(n)s"))


WRITING = wire.Statement(_write(again=False), row=tuple[str, int, bool, bool], params=Writing)
WRITING_AGAIN = wire.Statement(_write(again=True), row=tuple[str, int, bool, bool], params=Writing)


def _write_fenced_by_worker(again: bool) -> str:
    """A batch of chunks from executions that were all claimed under one worker fence (migration
    0026): one row locked, whatever the number of workflows; the answer is whether it held.

    Locked FOR NO KEY UPDATE, not FOR SHARE, though a share lock would do for the fence: a worker has
    two batches in flight, and two transactions that share-lock one row make a MultiXact, one for
    every pair of batches that overlapped (343 in a run of 102,400 chunks in 256 streams), which the
    server logs, stores and must freeze in time. Exclusive, a worker's batches take the row in turn, each
    waiting at most for the other's commit, and make none."""
    return (
        "WITH fence AS MATERIALIZED (SELECT epoch FROM {s}.worker_fences"
        "   WHERE worker = %(worker)s AND epoch = %(epoch)s FOR NO KEY UPDATE),"
        " written AS (INSERT INTO {s}.chunks (stream_id, position, value)"
        "   SELECT b.s, b.p, b.v FROM unnest(%(streams)b::int8[], %(positions)b::int[], %(values)b::bytea[])"
        "    AS b(s, p, v) WHERE EXISTS (SELECT FROM fence)"
        f"  {'ON CONFLICT DO NOTHING' if again else ''})"
        " SELECT EXISTS (SELECT FROM fence)"
        + riding(1, "EXISTS (SELECT FROM fence)"))


BY_WORKER = wire.Statement(_write_fenced_by_worker(again=False), row=tuple[bool], params=ByWorker)
BY_WORKER_AGAIN = wire.Statement(_write_fenced_by_worker(again=True), row=tuple[bool], params=ByWorker)


# The next free position of each of a workflow's streams.
STREAM_ENDS = Sql(
    "SELECT i.key, (SELECT max(position) + 1 FROM {s}.chunks WHERE stream_id = i.id)"
    " FROM {s}.stream_ids i WHERE i.workflow_id = %s", row=tuple[str, int | None], params=Id)


class Streams(NamedTuple):
    workflow_ids: list[str]
    keys: list[str]


# The ids of (workflow, key) streams, naming those that have none yet: (id, workflow id, key).
NAME_STREAMS = Sql(
    "WITH asked AS (SELECT * FROM unnest(%b::text[], %b::text[]) AS a(workflow_id, key)),"
    " named AS (INSERT INTO {s}.stream_ids (workflow_id, key) SELECT workflow_id, key FROM asked"
    "   ORDER BY workflow_id, key ON CONFLICT DO NOTHING RETURNING id, workflow_id, key)"
    " SELECT id, workflow_id, key FROM named"
    " UNION ALL SELECT i.id, i.workflow_id, i.key FROM asked a"
    "   JOIN {s}.stream_ids i ON i.workflow_id = a.workflow_id AND i.key = a.key",
    row=tuple[int, str, str], params=Streams, binary=True)


class Written(NamedTuple):
    """What a batch of chunks came to: the (workflow id, claim token) of the executions fenced out,
    the ids whose cancellation was requested, and whether the worker fence it was sent under held
    (False: it was written under the workflows' rows instead, which decided alone)."""

    fenced: set[tuple[str, int]]
    cancelled: set[str]
    fence_held: bool


class Chunks(Port):
    """The stream statements of ``Engine`` (which provides the pool and the schema)."""

    async def stream_ends(self, workflow_id: str) -> dict[str, int]:
        """The next free position of each of a workflow's streams: read once per execution, so
        positions are then assigned in memory rather than by a max()+1 query per write."""
        return {key: end for key, end in await self.db.rows(STREAM_ENDS, workflow_id) if end is not None}

    async def stream_ids(self, workflow_ids: list[str], keys: list[str]) -> dict[tuple[str, str], int]:
        """The ids of these (workflow, key) streams, naming those that have none yet. A stream named
        by a concurrent statement still uncommitted when this one began is missing from one answer;
        it is asked again (its row is committed by then: our insert waited for it)."""
        found: dict[tuple[str, str], int] = {}
        asked = sorted(set(zip(workflow_ids, keys, strict=True)))
        async with self.db.session() as s:
            while asked:
                for id, workflow_id, key in await s.rows(NAME_STREAMS, [w for w, _ in asked], [k for _, k in asked]):
                    found[(workflow_id, key)] = id
                asked = [stream for stream in asked if stream not in found]
        return found

    async def write_chunks(
        self, owners: list[tuple[str, int]], chunk_owners: list[int], stream_ids: list[int],
        positions: list[int], values: list[bytes | None], pings: Pings, again: bool = False,
        fence: tuple[str, int] | None = None,
    ) -> Written:
        """Insert a batch of chunks from many executions in one autocommit statement (no transaction
        left open around it, so a writer paused mid-batch holds no lock), and send the batch's
        ``pings`` with its commit: one NOTIFY per batch, no second transaction; but none when a
        chunk of the batch was fenced out (``pings`` may carry chunks, which must be written to be
        told of). ``owners`` are the (workflow id, claim token) of the executions writing, in id order;
        ``chunk_owners[n]`` is the index in ``owners`` (from 1) of the n-th chunk's.

        Each chunk is written only if its execution still holds its workflow. With ``fence`` (every
        execution of the batch was claimed under that worker fence) one row says so for all of them;
        otherwise, or when that fence no longer holds, each workflow's row does (fencing by the
        claim's token, in ``owners``), and the answer also names the cancellations requested.
        A position is only ever written by the execution holding the lease, so a first attempt is a
        plain insert; only ``again`` (a retry after a lost connection, which may have committed)
        skips chunks already there, at the price of a speculative insertion per row.
        """
        async with self.db.session() as s:
            if fence is not None:
                [(held,)] = await s.rows(
                    BY_WORKER_AGAIN if again else BY_WORKER, worker=fence[0], epoch=fence[1], streams=stream_ids,
                    positions=positions, values=values, pings_channels=pings.channels, pings=pings.payloads)
                if held:
                    return Written(set(), set(), True)
            rows = await s.rows(
                WRITING_AGAIN if again else WRITING, ids=[w for w, _ in owners], leases=[token for _, token in owners],
                owners=chunk_owners, streams=stream_ids, positions=positions, values=values, n=len(owners),
                pings_channels=pings.channels, pings=pings.payloads)
        return Written({(id, lease) for id, lease, fenced, _ in rows if fenced},
                       {id for id, _, _, cancelled in rows if cancelled}, fence is None)

    async def read_streams(
        self, stream_ids: list[int | None], workflow_ids: list[str], keys: list[str], offsets: list[int],
        limit: int, budget: int, whole: int,
    ) -> tuple[list[list[tuple[int, bytes | None]]], set[int], dict[int, int], dict[int, tuple[str | None, bool]]]:
        """For each (stream id if known, workflow, key, offset) asked, in one query: up to ``limit``
        chunks and ``budget`` bytes from the offset on (a first chunk up to ``whole`` bytes, however
        big ``budget`` is); the streams cut short (by index asked: chunks beyond were left for another
        read); the ids learnt of streams whose id was not known (by index asked); and for the streams
        with no chunks found, the workflow's status (None when there is no such workflow) and whether
        the stream is closed (by index asked).

        Status and chunks come from one snapshot: a workflow seen ended has every chunk it wrote
        visible too, so a reader that finds no chunks and an ended workflow knows the stream is over.
        """
        known = None not in stream_ids
        sizes: Sizes = {"limit": limit, "budget": budget, "whole": whole}
        if known:  # the usual read, of streams read before: by id alone
            rows = await self.db.rows(READING_BY_ID, sids=cast("list[int]", stream_ids), starts=offsets, **sizes)
        else:  # some have no id yet (or none written so far): by workflow and key (an id 0 is unknown)
            rows = await self.db.rows(READING_BY_NAME, sids=[sid or 0 for sid in stream_ids], workflow_ids=workflow_ids,
                                      keys=keys, starts=offsets, **sizes)
        return _sorted_reads(rows, len(stream_ids), learn=not known)


# Only a read that found nothing needs the workflow's status and whether the stream was closed before
# its offset (the close marker is always a stream's last chunk): scalar subqueries under CASE, so the
# others skip both lookups, and the planner cannot turn them into a scan of the whole workflows table.
_READ_ENDED = (
    " CASE WHEN c.position IS NULL THEN coalesce((SELECT value IS NULL FROM {s}.chunks"
    "  WHERE stream_id = r.sid ORDER BY position DESC LIMIT 1), false) ELSE false END,"
    " c.position, c.value, c.cut"
)
# Up to ``limit`` chunks and ``budget`` bytes of each stream, a first chunk up to ``whole`` bytes (a chunk
# may be 8 MiB: a read of one stream takes it whole, a read of many leaves it for one of its own), so one
# query holds a bounded batch however big the chunks of its streams are. The first chunk left out comes
# as a row of its own, ``cut``, without its value: the reader reads again from there, at once.
_READ_CHUNKS = (
    " LEFT JOIN LATERAL (SELECT f.position, CASE WHEN f.fits THEN f.value END AS value, NOT f.fits AS cut"
    "  FROM (SELECT w.position, w.value, w.fits, lag(w.fits, 1, true) OVER (ORDER BY w.position) AS went"
    "   FROM (SELECT position, value, sum(coalesce(octet_length(value), 0)) OVER (ORDER BY position)"
    "     <= %(budget)s OR (row_number() OVER (ORDER BY position) = 1"
    "      AND coalesce(octet_length(value), 0) <= %(whole)s) AS fits"
    "    FROM {s}.chunks WHERE stream_id = r.sid AND position >= r.start ORDER BY position LIMIT %(limit)s) w) f"
    "  WHERE f.went) c ON true"
    " ORDER BY r.i, c.position"
)
_READ_BY_ID = (
    "SELECT r.i, r.sid,"
    " CASE WHEN c.position IS NULL THEN (SELECT w.status FROM {s}.stream_ids i"
    "  JOIN {s}.workflows w ON w.id = i.workflow_id WHERE i.id = r.sid) END," + _READ_ENDED +
    " FROM unnest(%(sids)s::int8[], %(starts)s::int[]) WITH ORDINALITY AS r(sid, start, i)" + _READ_CHUNKS
)
_READ_BY_NAME = (
    "SELECT r.i, r.sid, CASE WHEN c.position IS NULL THEN"
    "  (SELECT status FROM {s}.workflows WHERE id = r.workflow_id) END," + _READ_ENDED +
    " FROM (SELECT q.i, q.workflow_id, q.start, coalesce(nullif(q.sid, 0), (SELECT id FROM"
    "   {s}.stream_ids WHERE workflow_id = q.workflow_id AND key = q.key)) AS sid"
    "  FROM unnest(%(sids)s::int8[], %(workflow_ids)s::text[], %(keys)s::text[], %(starts)s::int[])"
    "   WITH ORDINALITY AS q(sid, workflow_id, key, start, i)) r" + _READ_CHUNKS
)


class Sizes(TypedDict):
    limit: wire.Int8
    budget: wire.Int8
    whole: wire.Int8


class Reading(Sizes):
    sids: wire.Int8s  # (by name: 0, an id not known)
    starts: wire.Int4s


class ReadingByName(Reading):
    workflow_ids: wire.Texts
    keys: wire.Texts


# A row of a read: the index asked (from 1), the stream's id, the workflow's status and whether the stream
# is closed (for a stream with no chunks found), and a chunk found (position, value), or the first one left
# out (cut); plain tuples, as psycopg reads them (a NamedTuple would triple what a row costs the reader:
# benchmarks/row_types.py).
ReadRow = tuple[int, int | None, str | None, bool, int | None, bytes | None, bool | None]
READING_BY_ID = wire.Statement(_READ_BY_ID, row=cast("type[ReadRow]", ReadRow), params=Reading)
READING_BY_NAME = wire.Statement(_READ_BY_NAME, row=cast("type[ReadRow]", ReadRow), params=ReadingByName)


def _sorted_reads(rows: list[ReadRow], asked: int, learn: bool) -> tuple[
        list[list[tuple[int, bytes | None]]], set[int], dict[int, int], dict[int, tuple[str | None, bool]]]:
    """The rows of a read, by index asked (the rows count from 1): the chunks found, the reads cut
    short, the stream ids learnt (only when ``learn``: some were asked by name), and the status of
    the streams that had none."""
    found: list[list[tuple[int, bytes | None]]] = [[] for _ in range(asked)]
    cut: set[int] = set()
    learnt: dict[int, int] = {}
    states: dict[int, tuple[str | None, bool]] = {}
    for i, sid, status, closed, position, value, left_out in rows:
        if left_out:
            cut.add(i - 1)
        elif position is not None:
            found[i - 1].append((position, value))
        else:
            states[i - 1] = (status, closed)
        if learn and sid is not None:
            learnt[i - 1] = sid
    return found, cut, learnt, states
