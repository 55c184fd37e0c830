"""pgflow's connection pool: psycopg's, with a bound on how long any answer may take.

A link can die without a word: a proxy or a NAT box that stops forwarding, a network partition, a
server host that vanishes. The kernel notices late or never (a user-space proxy keeps acknowledging),
so a query on such a link waits for ever, and with it a worker's heartbeat and claims. Every checkout
of this pool therefore carries a timer: when the server has not answered within ``query_timeout``,
the connection's socket is shut down. The waiting query then fails at once as a lost connection, which
pgflow's idempotent operations already retry on a fresh one, and the pool drops the dead connection.
(Cancelling the waiting task instead would make psycopg send the server a cancel request and wait up
to ten more seconds for an answer that cannot come through the same dead link.)

Two bypasses of psycopg_pool live here and nowhere else, each measured against the pool's public way
by ``python -m benchmarks.bypasses`` (figures and the run in benchmarks/README.md):

- ``_NewestFirst`` hands out the connection returned last. It replaces the pool's private deque of
  idle connections, so pyproject.toml bounds psycopg-pool below 3.4 (read in 3.2.2 and 3.3.3); if a
  release stops keeping that deque, the pool goes back to its own order (oldest first) and
  tests/test_pool_reuse.py fails.
- ``Checkout`` takes and returns a connection by the pool's public ``getconn`` and ``putconn``
  without its ``connection()`` context.

(``Pool``'s own attributes, ``_returned`` and ``_sweep``, are names psycopg_pool does not use in those
releases either: the same bound keeps them from meeting one of its own.)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import os
import socket
import time
import weakref
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from .connecting import link_settings, named
from .registry import Config

log = logging.getLogger("pgflow")

IDLE_CHECK_AFTER = 2.0  # seconds a pooled connection may sit unused before it is checked on checkout
CHECK_WITHIN = 2.0  # seconds an empty query may take on a healthy link, however loaded


class _NewestFirst(collections.deque[Any]):
    """The pool's idle connections, handed out the one returned last first.

    psycopg_pool keeps them in a deque it takes from the left and returns to the right: the one idle
    longest goes out first. Under light load (an application's sporadic starts, an idle worker's claim
    and end) every checkout then finds a connection that sat longer than IDLE_CHECK_AFTER and pays a
    check's round trip before its query, on a backend gone cold. Taking from the end that returns go
    to keeps the connection just used in use, and leaves the idle ones to be checked when a burst
    needs them: a checkout and ``SELECT 1`` every 0.3 s on a pool grown to 10 took 728 against 1,476 µs
    (p50), a no-op started every 0.3 s after a burst 11.4 against 12.8 ms start-to-result (p50)
    (``benchmarks.bypasses --only pool_order,sporadic``). (The pool's shrinking takes from this end
    too, so it closes a warm connection rather than the longest idle: harmless, the pool shrinks all
    the same.)
    """

    def popleft(self) -> Any:
        return self.pop()


class Pool(AsyncConnectionPool[AsyncConnection[Any]]):
    """The pool of one runtime: autocommit connections whose every use is bounded in time."""

    def __init__(self, config: Config) -> None:
        self.query_timeout = config.query_timeout
        # Whether statements may be prepared on its connections (not through a transaction-mode pooler).
        self.prepares = not config.pooled
        self._returned: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
        self._sweep: asyncio.Task[None] | None = None
        super().__init__(
            config.dsn, min_size=1, max_size=config.pool_size, open=False,
            kwargs={"autocommit": True, **named(f"pgflow-{os.getpid()}"),
                    **link_settings(config.dsn, config.query_timeout, session=not config.pooled),
                    # A transaction-mode pooler runs each transaction on any of its server sessions,
                    # where a statement prepared on another is unknown (pgbouncer follows prepared
                    # statements only from 1.21 on, and only when max_prepared_statements is set).
                    **({"prepare_threshold": None} if config.pooled else {})},
            # (No ``reset`` callback: with one, psycopg_pool hands every returned connection to a
            # background task, so it is not back in the pool for the checkout that comes right after.)
            name=f"pgflow-{config.schema}", check=self._check_if_idle,
        )
        if isinstance(getattr(self, "_pool", None), collections.deque):  # psycopg_pool's own, still empty
            self._pool = _NewestFirst(self._pool)  # (tests/test_pool_reuse.py fails if this stops taking)

    def connection(self, timeout: float | None = None, *,  # type: ignore[override]
                   within: float | None = None) -> Checkout:
        """A connection whose use must be over within ``within`` seconds (``query_timeout`` by
        default; ``math.inf`` for work that may rightly take long, such as a migration), or its link
        is taken for dead and closed."""
        return Checkout(self, timeout, self.query_timeout if within is None else within)

    @staticmethod
    async def check_connection(conn: AsyncConnection[Any]) -> None:
        """psycopg's check (used by ``check()`` on every idle connection), bounded in time: a frozen
        link would otherwise stall the whole sweep."""
        with answered_within(conn, CHECK_WITHIN):
            await AsyncConnectionPool.check_connection(conn)

    async def _check_if_idle(self, conn: AsyncConnection[Any]) -> None:
        """Check a connection on checkout only when it sat idle a while (a restart may have killed
        it): a check on every checkout costs a round trip per query. A connection that died in the
        last moments fails its query instead, which the idempotent operations retry."""
        if time.monotonic() - self._returned.get(conn, 0.0) > IDLE_CHECK_AFTER:
            try:
                await self.check_connection(conn)
            except Exception:
                # What killed this idle connection (a restart, a failover, a NAT reset, a DBA's
                # pg_terminate_backend) likely killed the others too. Check them all now, in the
                # background: check() takes the idle connections out of the pool at once, so this
                # checkout goes on with a new connection instead of trying one dead connection after
                # another with a growing pause between tries (1, 2, 4, 8 s ...), and nobody waits
                # for the checks (up to CHECK_WITHIN each on a frozen link).
                if self._sweep is None or self._sweep.done():
                    self._sweep = asyncio.get_running_loop().create_task(self.check())
                    self._sweep.add_done_callback(_consume)  # its failure is the failed checks' own
                    await asyncio.sleep(0)  # let it take the idle connections before we look again
                raise

    async def close(self, timeout: float = 5.0) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            await asyncio.wait([self._sweep])
        await super().close(timeout)


class Checkout:
    """``async with pool.connection() as conn``: a connection taken from the pool and given back.

    psycopg_pool's own ``connection()`` also enters the connection's context, which commits or rolls
    back through the connection's lock: nothing to do on an autocommit connection, whose statements
    each commit themselves (an explicit ``conn.transaction()`` ends its own), and a connection left
    in a transaction is rolled back by the pool as it comes back. Each checkout of the hot path (a
    start, a claim, a batch) was two context managers and a lock deeper than it needed to be: 12 against
    26 µs of CPU a checkout, and a no-op started and awaited back to back costs its caller 1.04x and
    its worker 1.13x the CPU through ``connection()``; in a drain, whose claims and ends are batched,
    it is lost in the noise (``benchmarks.bypasses --only checkout,lone,drain16,drain64``)."""

    __slots__ = ("_pool", "_timeout", "_within", "_conn", "_timer")

    def __init__(self, pool: Pool, timeout: float | None, within: float) -> None:
        self._pool = pool
        self._timeout = timeout
        self._within = within
        self._conn: AsyncConnection[Any] | None = None
        self._timer: asyncio.TimerHandle | None = None

    async def __aenter__(self) -> AsyncConnection[Any]:
        conn = self._conn = await self._pool.getconn(self._timeout)
        if self._within != math.inf:
            self._timer = asyncio.get_running_loop().call_later(self._within, _sever, conn, self._within)
        return conn

    async def __aexit__(self, *exc: object) -> None:
        conn, self._conn = self._conn, None
        assert conn is not None
        if self._timer is not None:
            self._timer.cancel()
        self._pool._returned[conn] = time.monotonic()  # its last use, for _check_if_idle
        await self._pool.putconn(conn)


def _consume(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("a background check of the pool failed: %r", task.exception())


@contextlib.contextmanager
def answered_within(conn: AsyncConnection[Any], seconds: float) -> Iterator[None]:
    """Close ``conn``'s link if what runs inside has not finished within ``seconds``."""
    if seconds == math.inf:
        yield
        return
    timer = asyncio.get_running_loop().call_later(seconds, _sever, conn, seconds)
    try:
        yield
    finally:
        timer.cancel()


def _sever(conn: AsyncConnection[Any], seconds: float) -> None:
    """Shut the socket down under libpq: the read it waits on ends at once, as on a closed link.
    (Closing the descriptor itself would leave the event loop watching a number that is no longer
    the socket.)"""
    if conn.closed:
        return
    try:
        fd = conn.pgconn.socket
    except psycopg.OperationalError:
        return
    log.warning("PostgreSQL has not answered on a connection for %.1f s: taking the link for dead and "
                "closing it (a frozen network path, a stopped proxy, a vanished host)", seconds)
    duplicate = os.dup(fd)  # a socket object of our own, whose closing leaves libpq's descriptor be
    try:
        link = socket.socket(fileno=duplicate)
    except OSError:
        os.close(duplicate)
        return
    with link, contextlib.suppress(OSError):  # not connected any more: nothing to shut down
        link.shutdown(socket.SHUT_RDWR)
