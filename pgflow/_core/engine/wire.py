"""The statements pgflow runs for every workflow and every batch of chunks (a start, a claim, a batch
of ends, a batch of chunks, the readers' shared read), sent through libpq directly rather than
through psycopg's cursor.

psycopg's async ``execute`` is general: a cursor per call, every parameter adapted by a dumper looked
up for its Python type (a list element by element), the query re-read for its placeholders, and the
connection's socket registered with the event loop and taken off again for each wait. For a statement
pgflow runs thousands of times a second with the same parameter types, that was most of the client's
CPU per statement (benchmarks/README.md). Here a statement declares its parameters' types once
(``Param``: a type OID and a function that packs a value in PostgreSQL's binary format), is prepared
once per connection with them, and is then sent with the values packed and read back in binary;
psycopg's own compiled loaders turn the result into rows, so every column type psycopg knows is read
as psycopg reads it.

The connection is still psycopg's, checked out of the pool as any other: the pool checks it, severs a
dead link and throws a broken one away. A statement interrupted mid-way (a cancelled task, a lost
link) leaves the connection with a statement in flight, which the pool closes on its return rather
than hand it out. Through a transaction-mode pooler nothing is prepared (a prepared statement lives
on one server session, and the pooler may send the next transaction to another): each call sends
the statement with its types, unnamed.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import struct
import typing
import weakref
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Annotated, Any, Generic, NamedTuple, Never, ParamSpec, TypedDict, TypeVar, overload

import psycopg
from psycopg import AsyncConnection, pq
from psycopg.adapt import Transformer

from . import arrays
from .statement import Statement as Declared

R = TypeVar("R")
P = ParamSpec("P")


class Param(NamedTuple):
    """A parameter's type: its OID, and how a value of it is packed (None stays NULL)."""

    oid: int
    pack: Callable[[Any], bytes]


_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)  # PostgreSQL's, for timestamps
_I4, _I8, _F8 = struct.Struct(">i").pack, struct.Struct(">q").pack, struct.Struct(">d").pack


def _microseconds(at: datetime) -> int:
    delta = at - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


TEXT = Param(25, str.encode)
BYTEA = Param(17, bytes)
BOOL = Param(16, lambda value: b"\x01" if value else b"\x00")
INT4 = Param(23, _I4)
INT8 = Param(20, _I8)
FLOAT8 = Param(701, lambda value: _F8(float(value)))
TIMESTAMPTZ = Param(1184, lambda at: _I8(_microseconds(at)))
TEXTS = Param(1009, lambda values: bytes(values) if isinstance(values, arrays.TextArray) else arrays.texts(values))
INT4S = Param(1007, lambda values: bytes(values) if isinstance(values, arrays.Int4Array) else arrays.int4s(values))
INT8S = Param(1016, lambda values: bytes(values) if isinstance(values, arrays.Int8Array) else arrays.int8s(values))
BYTEAS = Param(1001, lambda values: bytes(values) if isinstance(values, arrays.ByteaArray) else arrays.byteas(values))
BOOLS = Param(1000, arrays.bools)
TIMESTAMPTZS = Param(1185, lambda values: arrays.timestamptzs(
    [None if at is None else _microseconds(at) for at in values]))

# A parameter's type as a statement's ``params=`` (a TypedDict) declares it: the Python type its callers
# give, annotated with how it is sent (``key: Int8``; ``key: Text | None``, which may be NULL).
Text = Annotated[str, TEXT]
Bytea = Annotated[bytes, BYTEA]
Bool = Annotated[bool, BOOL]
Int4 = Annotated[int, INT4]
Int8 = Annotated[int, INT8]
Float8 = Annotated[float, FLOAT8]
Timestamptz = Annotated[datetime, TIMESTAMPTZ]
Texts = Annotated[Sequence[str | None] | arrays.TextArray, TEXTS]
Int4s = Annotated[Sequence[int] | arrays.Int4Array, INT4S]
Int8s = Annotated[Sequence[int] | arrays.Int8Array, INT8S]
Byteas = Annotated[Sequence[bytes | None] | arrays.ByteaArray, BYTEAS]
Bools = Annotated[Sequence[bool], BOOLS]
Timestamptzs = Annotated[Sequence[datetime | None], TIMESTAMPTZS]

_PLACEHOLDER = re.compile(r"%\((\w+)\)[sb]|%%")
_names = itertools.count(1)


def declared(params: Callable[..., object]) -> dict[str, Param]:
    """The type of each parameter a ``params=`` TypedDict declares (``Text``, ``Int8 | None``, ...)."""
    found = {}
    for name, hint in typing.get_type_hints(params, include_extras=True).items():
        kinds = [arg for arg in typing.get_args(hint) if typing.get_origin(arg) is Annotated] or [hint]
        marks = [mark for kind in kinds for mark in getattr(kind, "__metadata__", ()) if isinstance(mark, Param)]
        if len(marks) != 1:
            raise TypeError(f"parameter {name!r} of {params.__name__} is no wire type (Text, Int8, ...): {hint!r}")
        found[name] = marks[0]
    return found


class Statement(Declared[R, P]):
    """One statement: its SQL, with ``{s}`` for the schema and ``%(name)s`` placeholders; the type of
    its rows (``row=``: a NamedTuple, or a ``tuple[...]`` for rows left as psycopg reads them) and of
    each parameter it names (``params=``: a TypedDict of the types above)."""

    __slots__ = ("_template", "_names", "_types", "_packs", "_formats", "_by_schema")

    @overload
    def __init__(self: Statement[Never, P], template: str, *, row: None, params: Callable[P, object]) -> None: ...
    @overload
    def __init__(self: Statement[R, P], template: str, *, row: type[R], params: Callable[P, object]) -> None: ...

    def __init__(self, template: str, *, row: Any, params: Callable[P, object]) -> None:
        super().__init__(row, params)
        types = declared(params)
        order: list[str] = []

        def number(match: re.Match[str]) -> str:
            name = match.group(1)
            if name is None:
                return "%"
            if name not in types:
                raise TypeError(f"the statement names %({name})s, whose type is not given")
            if name not in order:
                order.append(name)
            return f"${order.index(name) + 1}"

        self._template = _PLACEHOLDER.sub(number, template)
        if unused := set(types) - set(order):
            raise TypeError(f"parameters given that the statement does not name: {sorted(unused)}")
        self._names = order
        self._types = [types[name].oid for name in order]
        self._packs = [types[name].pack for name in order]
        self._formats = [1] * len(order)
        self._by_schema: dict[str, tuple[bytes, bytes]] = {}  # quoted schema -> (SQL, prepared name)

    def for_schema(self, schema: str) -> tuple[bytes, bytes]:
        """The SQL for the (quoted) ``schema``, and the name it is prepared under."""
        found = self._by_schema.get(schema)
        if found is None:
            found = self._by_schema[schema] = (self._template.replace("{s}", schema).encode(),
                                               f"_pgflow_{next(_names)}".encode())
        return found

    def values(self, given: Mapping[str, Any]) -> list[bytes | None]:
        return [None if (value := given[name]) is None else pack(value)
                for name, pack in zip(self._names, self._packs, strict=True)]

    def step(self, *args: P.args, **kwargs: P.kwargs) -> Step[R]:
        """The statement with the values it is to run with, as one step of a ``pipeline``
        (``LOCK.step(paths=...)``, checked against its parameters as a call of ``Session.rows`` is)."""
        return Step(self, kwargs)


class Nothing(TypedDict):
    """The parameters of a statement that takes none (``BEGIN``)."""


class Step(Generic[R]):
    """A statement and its values, one of a ``pipeline``'s (``Statement.step``)."""

    __slots__ = ("statement", "given")

    def __init__(self, statement: Statement[R, Any], given: Mapping[str, Any]) -> None:
        self.statement = statement
        self.given = given


# The statements prepared on each connection, by prepared name.
_prepared: weakref.WeakKeyDictionary[AsyncConnection[Any], set[bytes]] = weakref.WeakKeyDictionary()


async def fetch(conn: AsyncConnection[Any], statement: Statement[R, Any], schema: str, given: Mapping[str, Any],
                *, prepare: bool = True) -> list[R]:
    """Run ``statement`` on ``conn`` (checked out, idle) with the ``given`` values; its rows."""
    sql, name = statement.for_schema(schema)
    values = statement.values(given)
    pgconn = conn.pgconn
    if not prepare:
        pgconn.send_query_params(sql, values, statement._types, statement._formats, 1)
        return _rows(conn, await _results(pgconn), statement.make_row)
    for _ in _ONCE_MORE:
        await _prepare(conn, statement, sql, name)
        pgconn.send_query_prepared(name, values, statement._formats, 1)
        results = await _results(pgconn)
        if not _forgotten(conn, results):
            break
    return _rows(conn, results, statement.make_row)


_ONCE_MORE = range(2)  # a statement the server forgot is prepared again and sent once more
_FORGOTTEN = b"26000"  # invalid_sql_statement_name: "prepared statement ... does not exist"


def _forgotten(conn: AsyncConnection[Any], results: Sequence[pq.abc.PGresult]) -> bool:
    """Whether the server no longer had the prepared statement, and so ran nothing. psycopg sends
    ``DEALLOCATE ALL`` on a connection where it prepared statements of its own once a transaction
    there rolled back or a DROP or ALTER ran (its own cache may be stale then): that takes ours too.
    The connection's record of what is prepared is dropped, to be made again."""
    if any(r.status == pq.ExecStatus.FATAL_ERROR and r.error_field(pq.DiagnosticField.SQLSTATE) == _FORGOTTEN
           for r in results):
        _prepared.pop(conn, None)
        return True
    return False


async def _prepare(conn: AsyncConnection[Any], statement: Statement[Any, Any], sql: bytes, name: bytes) -> None:
    """Prepare ``statement`` on ``conn`` under ``name``, once per connection."""
    done = _prepared.get(conn)
    if done is None:
        done = _prepared[conn] = set()
    if name not in done:
        conn.pgconn.send_prepare(name, sql, statement._types)
        _rows(conn, await _results(conn.pgconn))  # (raises what the server said, if it refused)
        done.add(name)


# A transaction that commits with the session's ``synchronous_commit``: its commit record is written
# after everything committed before it, so once it is answered all of that is on disk (and on the
# synchronous standbys, when there are any) too. It must write to the log for its commit to wait for
# the disk (a transaction that only took an id commits as if asynchronously): a logical decoding
# message of its own, prefixed "pgflow" and empty, which a decoder that asks for messages sees.
_DURABLE = b"SELECT pg_catalog.pg_logical_emit_message(true, 'pgflow', '')"
# Whether the connection's role may send it (a server may have revoked it from PUBLIC; PostgreSQL 17
# gave it a fourth argument, with a default).
CAN_BE_DURABLE_AFTER = ("SELECT coalesce(bool_and(has_function_privilege(oid, 'EXECUTE')), false)"
                        " FROM pg_catalog.pg_proc WHERE proname = 'pg_logical_emit_message'"
                        "  AND pronamespace = 'pg_catalog'::regnamespace")


async def fetch_then_durable(conn: AsyncConnection[Any], statement: Statement[R, Any], schema: str,
                             given: Mapping[str, Any]) -> list[R]:
    """``fetch`` for a ``statement`` whose own commit does not wait for the disk (it sets
    ``synchronous_commit`` off for itself), followed in the same round trip, pipelined, by a commit
    that does wait: the statement's rows come back only once what it wrote, and what it read that
    others had committed, is as durable as a plain commit would have made it. Meanwhile its writes
    (and its pings) were visible to every other session from its own commit on, a disk flush earlier.
    A connection left halfway (an error, a cancelled task) is in pipeline mode with results pending,
    which the pool sees as a statement in flight: it closes it rather than hand it out."""
    sql, name = statement.for_schema(schema)
    values = statement.values(given)
    pgconn = conn.pgconn
    for _ in _ONCE_MORE:
        await _prepare(conn, statement, sql, name)
        pgconn.enter_pipeline_mode()
        pgconn.send_query_prepared(name, values, statement._formats, 1)
        pgconn.pipeline_sync()
        pgconn.send_query_params(_DURABLE, None, result_format=1)
        pgconn.pipeline_sync()
        results = await _results(pgconn, syncs=2)
        pgconn.exit_pipeline_mode()
        if not _forgotten(conn, results[:-1]):  # (then nothing ran, and the durable commit was an empty one)
            break
    rows = _rows(conn, results[:-1], statement.make_row)  # (the statement's error first, if it failed)
    _rows(conn, results[-1:])
    return rows


class Forgotten(Exception):
    """The server no longer had a prepared statement of a ``pipeline``: it ran nothing from there on
    (and a transaction the pipeline was in is aborted). The connection's record of what is prepared
    was dropped, so a new try prepares them again."""


async def pipeline(conn: AsyncConnection[Any], steps: Sequence[Step[Any]], schema: str,
                   *, prepare: bool = True) -> list[list[Any]]:
    """Run ``steps``, each a statement and its values (``Statement.step``), on ``conn`` (checked out,
    idle) in one round trip, pipelined, one after the other as if sent one at a time: the rows of each
    (as its ``row=`` declares them). When one fails, those after it do not run (the server skips them up
    to the pipeline's end), and its error is raised once the round trip is over, ``Forgotten`` for a
    prepared statement the server had forgotten. Used for a transaction whose ``BEGIN`` goes out with
    its first statements and whose ``COMMIT`` with its last, so that neither costs a round trip of its
    own. A connection left halfway (a cancelled task, a lost link) is in pipeline mode with results
    pending, which the pool sees as a statement in flight: it closes it rather than hand it out."""
    pgconn = conn.pgconn
    sent = [(step.statement, step.statement.for_schema(schema), step.statement.values(step.given)) for step in steps]
    if prepare:
        for statement, (sql, name), _ in sent:
            await _prepare(conn, statement, sql, name)
    pgconn.enter_pipeline_mode()
    for statement, (sql, name), values in sent:
        if prepare:
            pgconn.send_query_prepared(name, values, statement._formats, 1)
        else:
            pgconn.send_query_params(sql, values, statement._types, statement._formats, 1)
    pgconn.pipeline_sync()
    results = await _results(pgconn, syncs=1)
    pgconn.exit_pipeline_mode()
    if _forgotten(conn, results):
        raise Forgotten("the server had forgotten a statement prepared on this connection")
    # (the first error raised: the others came after it)
    return [_rows(conn, [result], statement.make_row) for (statement, _, _), result in zip(sent, results, strict=True)]


async def _results(pgconn: pq.abc.PGconn, syncs: int = 0) -> list[pq.abc.PGresult]:
    """Every result of the statement just sent, read as they come in; the connection is idle after."""
    loop = asyncio.get_running_loop()
    fd = pgconn.socket
    while pgconn.flush():  # a statement bigger than the socket's buffer goes out as it drains
        await _ready(loop, fd, loop.add_writer, loop.remove_writer)
    results: list[pq.abc.PGresult] = []
    while True:
        while pgconn.is_busy():
            await _ready(loop, fd, loop.add_reader, loop.remove_reader)
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is None:
            if not syncs:
                return results
        elif result.status == pq.ExecStatus.PIPELINE_SYNC:
            syncs -= 1
            if not syncs:
                return results
        else:
            results.append(result)


async def _ready(loop: asyncio.AbstractEventLoop, fd: int, add: Callable[..., None],
                 remove: Callable[[int], object]) -> None:
    ready = loop.create_future()
    add(fd, _set, ready)
    try:
        await ready
    finally:
        remove(fd)


def _set(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


_OK = (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK)  # (a pipeline's later statements, once
# one has failed, come back PIPELINE_ABORTED: an error too, after the failed statement's own)


def _rows(conn: AsyncConnection[Any], results: Sequence[pq.abc.PGresult],
          make_row: Callable[[Any], Any] = tuple) -> list[Any]:
    """The rows of ``results``, each made by ``make_row`` of the tuple psycopg read (``tuple``: that tuple)."""
    rows: list[Any] = []
    for result in results:
        if result.status not in _OK:
            raise psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
        if result.ntuples:
            loader = Transformer.from_context(conn)
            loader.set_pgresult(result, format=pq.Format.BINARY)
            rows += loader.load_rows(0, result.ntuples, make_row)
    return rows
