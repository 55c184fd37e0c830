"""The engine's one way to run a statement: a ``Database`` (a pool of autocommit connections and one
schema) runs every statement of every port, on a connection of its own or in a ``Session``.

A statement is one of two kinds, both named in their port's module (the catalogue):

- ``wire.Statement``: the statements run for every workflow and every batch (a start, a claim, a batch
  of ends or chunks), whose parameters declare their types once; sent through libpq, binary both
  ways, prepared once per connection (``wire.py`` says what that buys);
- ``Sql``: every other statement, whose parameters psycopg adapts; psycopg prepares one after it ran a
  few times on a connection.

Either is prepared where the connection allows it and sent plain through a transaction-mode pooler
(the pool turns psycopg's preparing off there, and ``Pool.prepares`` tells ``wire`` to do the same).

Either declares the type of its rows and of its parameters (``row=``, ``params=``: ``statement.py``), so
that what runs it is typed: ``await db.rows(WORKERS_OVERVIEW)`` is a ``list[WorkerRow]``, and
``await db.run(REGISTER, id=..., host=...)`` is checked against REGISTER's parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from typing import Any, Never, ParamSpec, TypeVar, overload

import psycopg
from psycopg import AsyncConnection, AsyncCursor, pq, sql

from .. import connecting
from ..pool import Checkout, Pool
from . import wire
from .statement import UNDECLARED, Params, Statement, Untyped

R = TypeVar("R")
R2 = TypeVar("R2")
R3 = TypeVar("R3")
P = ParamSpec("P")
Row = tuple[Any, ...]
T = TypeVar("T")


def quote_identifier(name: str) -> str:
    """``name`` as an SQL identifier, quoted by psycopg (not by a template: the schema name is safe
    today only because App checks it against a pattern)."""
    return sql.Identifier(name).as_string()


class Sql(Statement[R, P]):
    """A statement whose parameters psycopg adapts: its template, with ``{s}`` for the schema and
    psycopg's placeholders (``%s``, ``%(name)s``, ``%b``); ``binary``: its rows come back in binary;
    ``row=`` and ``params=``: its types (``statement.py``)."""

    __slots__ = ("template", "binary", "_by_schema", "_cursor")

    @overload
    def __init__(self: Sql[Untyped, ...], template: str, *, binary: bool = ...) -> None: ...
    @overload
    def __init__(self: Sql[Never, []], template: str, *, row: None, binary: bool = ...) -> None: ...
    @overload
    def __init__(self: Sql[Never, P], template: str, *, row: None, params: Callable[P, object],
                 binary: bool = ...) -> None: ...
    @overload
    def __init__(self: Sql[R, []], template: str, *, row: type[R], binary: bool = ...) -> None: ...
    @overload
    def __init__(self: Sql[R, P], template: str, *, row: type[R], params: Callable[P, object],
                 binary: bool = ...) -> None: ...

    def __init__(self, template: str, *, row: Any = UNDECLARED, params: Any = None, binary: bool = False) -> None:
        super().__init__(row, params)
        self.template = template
        self.binary = binary
        self._by_schema: dict[str, str] = {}
        # (a cursor that makes the declared rows, for a statement whose rows are no plain tuples)
        make_row = self.make_row
        self._cursor = None if make_row is tuple else lambda conn: conn.cursor(row_factory=lambda _: make_row)

    def for_schema(self, schema: str) -> str:
        """The statement for the (quoted) ``schema``."""
        found = self._by_schema.get(schema)
        if found is None:
            found = self._by_schema[schema] = self.template.replace("{s}", schema)
        return found

    def __repr__(self) -> str:
        return f"Sql({self.template[:60]!r}...)"


# The first statement of a transaction whose reads all come from one snapshot and that writes nothing.
SNAPSHOT = Sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY", row=None)
# A transaction's ends, when they ride in its pipelines (``Database.pipelined``).
BEGIN = wire.Statement("BEGIN", row=None, params=wire.Nothing)
COMMIT = wire.Statement("COMMIT", row=None, params=wire.Nothing)
ROLLBACK = wire.Statement("ROLLBACK", row=None, params=wire.Nothing)
_OPEN = (pq.TransactionStatus.INTRANS, pq.TransactionStatus.INERROR)


def _rows(conn: AsyncConnection[Any], statement: Statement[R, Any], params: Params, schema: str,
          prepare: bool) -> Coroutine[Any, Any, list[R]]:
    """What every statement of the engine runs through: ``statement`` on ``conn`` (checked out, idle).
    (It hands back the statement's coroutine rather than awaiting it: no frame of its own on the hot path.)"""
    if isinstance(statement, wire.Statement):
        assert params is None or isinstance(params, dict), "a wire statement takes its parameters by name"
        return wire.fetch(conn, statement, schema, params or _NONE, prepare=prepare)
    assert isinstance(statement, Sql)
    return _adapted(conn, statement, statement.for_schema(schema), params)


async def _adapted(conn: AsyncConnection[Any], statement: Sql[R, Any], text: str, params: Params) -> list[R]:
    cursor = statement._cursor
    cur: AsyncCursor[Any] = await (conn if cursor is None else cursor(conn)).execute(
        text, params, binary=statement.binary)
    # (Its status, not ``cur.description``, which makes a Column of every column to say the same.)
    return await cur.fetchall() if (done := cur.pgresult) is not None and done.status == _TUPLES else []


_TUPLES = pq.ExecStatus.TUPLES_OK
_NONE: dict[str, Any] = {}  # (the values of a wire statement that takes none)


def _run(conn: AsyncConnection[Any], statement: Statement[Any, Any], params: Params, schema: str,
         prepare: bool) -> Coroutine[Any, Any, object]:
    """``_rows`` for a statement run for what it does: what psycopg read of its rows is left unread."""
    if isinstance(statement, Sql):
        return conn.execute(statement.for_schema(schema), params, binary=statement.binary)
    return _rows(conn, statement, params, schema, prepare)


class Session:
    """One connection: statements that must share it (a transaction, a snapshot, a lock) run here, in
    order. ``Database.session`` makes one over a connection of the pool's; the few connections pgflow
    keeps apart from the pool (the listener's, the maintenance leader's, check-replay's read-only one,
    a migration's) are used through one made over them, with their ``schema`` (quoted; none: statements
    that name no table of it).

    A statement's parameters follow it, as its ``params=`` declares them (``statement.py``): by keyword,
    in order, or (a statement not typed yet) in one mapping or sequence."""

    __slots__ = ("conn", "_schema", "_prepares")

    def __init__(self, conn: AsyncConnection[Any], schema: str = "", *, prepares: bool = True) -> None:
        self.conn = conn
        self._schema = schema
        self._prepares = prepares

    def rows(self, statement: Statement[R, P], /, *args: P.args,
             **kwargs: P.kwargs) -> Coroutine[Any, Any, list[R]]:
        """The rows ``statement`` returns (none for one that returns no rows)."""
        params = kwargs if kwargs and statement.named else statement.given(args, kwargs)
        return _rows(self.conn, statement, params, self._schema, self._prepares)

    async def row(self, statement: Statement[R, P], /, *args: P.args, **kwargs: P.kwargs) -> R | None:
        """The first row ``statement`` returns, or None."""
        rows = await _rows(self.conn, statement, statement.given(args, kwargs), self._schema, self._prepares)
        return rows[0] if rows else None

    async def run(self, statement: Statement[Any, P], /, *args: P.args, **kwargs: P.kwargs) -> None:
        """Run ``statement`` for what it does, not for rows."""
        await _run(self.conn, statement, statement.given(args, kwargs), self._schema, self._prepares)

    @overload
    async def pipeline(self, a: wire.Step[R], /) -> tuple[list[R]]: ...
    @overload
    async def pipeline(self, a: wire.Step[R], b: wire.Step[R2], /) -> tuple[list[R], list[R2]]: ...
    @overload
    async def pipeline(self, a: wire.Step[R], b: wire.Step[R2], c: wire.Step[R3], /) -> tuple[
        list[R], list[R2], list[R3]]: ...
    @overload
    async def pipeline(self, *steps: wire.Step[Any]) -> tuple[list[Any], ...]: ...

    async def pipeline(self, *steps: wire.Step[Any]) -> tuple[list[Any], ...]:
        """The rows of each statement of ``steps`` (``STATEMENT.step(**values)``), run in order in one
        round trip (``wire.pipeline``): one that fails raises its error, and those after it did not run."""
        return tuple(await wire.pipeline(self.conn, steps, self._schema, prepare=self._prepares))

    async def end(self, statement: wire.Statement[Never, []]) -> None:
        """``COMMIT`` or ``ROLLBACK`` the transaction the session is in, if it is in one and idle (a
        connection left with a statement in flight is the pool's to close)."""
        pgconn = self.conn.pgconn
        if pgconn.transaction_status in _OPEN and pgconn.pipeline_status == pq.PipelineStatus.OFF:
            await self.pipeline(statement.step())

    def rows_then_durable(self, statement: wire.Statement[R, P], /, *args: P.args,
                          **kwargs: P.kwargs) -> Coroutine[Any, Any, list[R]]:
        """``rows``, then a commit that waits for the disk, in the same round trip (``wire.fetch_then_durable``)."""
        return wire.fetch_then_durable(self.conn, statement, self._schema, kwargs)

    async def script(self, text: bytes) -> None:
        """Run a script of many commands as it is (a migration's file, its schema filled in): no
        parameters, no rows. Bytes, as read: no statement of the catalogue, and none that a look at
        what the engine sends as statements (``str``) should take for one."""
        await self.conn.execute(text)

    def transaction(self) -> AbstractAsyncContextManager[psycopg.AsyncTransaction]:
        return self.conn.transaction()


class _Checkout(Session):
    """``async with db.session() as s``: a ``Session`` over a connection of the pool's, taken as it is
    entered and given back as it is left."""

    __slots__ = ("_checkout",)

    def __init__(self, checkout: Checkout, schema: str, prepares: bool) -> None:
        self._checkout = checkout
        self._schema = schema
        self._prepares = prepares

    async def __aenter__(self) -> Session:
        self.conn = await self._checkout.__aenter__()
        return self

    def __aexit__(self, *exc: object) -> Coroutine[Any, Any, None]:
        return self._checkout.__aexit__(*exc)


class Database:
    """One schema's tables behind one pool: what every port runs its statements through, each on a
    connection of its own (``session``: several on one), with its parameters as ``Session`` takes them."""

    def __init__(self, pool: Pool, schema: str) -> None:
        self.pool = pool
        self.schema = schema
        self.quoted = quote_identifier(schema)

    def session(self, *, within: float | None = None) -> _Checkout:
        """A connection of the pool's, whose use must be over ``within`` seconds (``Pool.connection``)."""
        return _Checkout(self.pool.connection(within=within), self.quoted, self.pool.prepares)

    async def pipelined(self, body: Callable[[Session], Awaitable[T]]) -> T:
        """``body``'s answer, run in a transaction on a connection of its own whose ``BEGIN`` and
        ``COMMIT`` ride in the body's pipelines (``Session.pipeline``: ``BEGIN`` first in its first,
        ``COMMIT`` last in its last), so that neither costs a round trip of its own: committed when the
        body returns with it still open, rolled back when it raises. The body is run once more from the
        start when the server had forgotten a statement prepared on the connection (``wire.Forgotten``:
        nothing of that try committed), so it must be one that can run again."""
        for attempt in _ONCE_MORE:
            async with self.session() as s:
                try:
                    answer = await body(s)
                except wire.Forgotten:
                    await s.end(ROLLBACK)
                    if attempt:
                        raise
                    continue
                except BaseException:
                    with contextlib.suppress(psycopg.Error):  # (the body's error says more than the rollback's)
                        await s.end(ROLLBACK)
                    raise
                await s.end(COMMIT)
                return answer
        raise AssertionError("unreachable")  # (the last try returns or raises)

    async def rows(self, statement: Statement[R, P], /, *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """``statement``'s rows, on a connection of its own."""
        params = kwargs if kwargs and statement.named else statement.given(args, kwargs)
        async with self.pool.connection() as conn:
            return await _rows(conn, statement, params, self.quoted, self.pool.prepares)

    async def row(self, statement: Statement[R, P], /, *args: P.args, **kwargs: P.kwargs) -> R | None:
        """``statement``'s first row or None, on a connection of its own."""
        params = statement.given(args, kwargs)
        async with self.pool.connection() as conn:
            rows = await _rows(conn, statement, params, self.quoted, self.pool.prepares)
        return rows[0] if rows else None

    async def run(self, statement: Statement[Any, P], /, *args: P.args, **kwargs: P.kwargs) -> None:
        """Run ``statement`` for what it does, on a connection of its own."""
        params = statement.given(args, kwargs)
        async with self.pool.connection() as conn:
            await _run(conn, statement, params, self.quoted, self.pool.prepares)

    async def on_this_machine(self) -> bool:
        """Whether the pool's connections reach a server on this machine (``connecting.on_this_machine``)."""
        async with self.pool.connection() as conn:
            try:
                hostaddr = conn.info.hostaddr
            except psycopg.NotSupportedError:  # (libpq before 12 does not say)
                hostaddr = ""
            cur = await conn.execute("SELECT host(inet_server_addr())")
            row = await cur.fetchone()
            return connecting.on_this_machine(conn.info.host, hostaddr, row[0] if row else None)


_ONCE_MORE = range(2)


class Port:
    """A group of statements with one role (starts, claims, the journal, ...), run through the
    ``Database`` the engine gives every port."""

    def __init__(self, db: Database) -> None:
        self.db = db
