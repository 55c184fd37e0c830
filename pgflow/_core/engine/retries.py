"""Which database errors pass with time, and trying an idempotent operation again while they last."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import psycopg
from psycopg_pool import PoolClosed

log = logging.getLogger("pgflow.store")
T = TypeVar("T")


# Server states that pass: it is shutting down or starting (a restart, a failover), it ended the
# session (for one, because it sat idle in a transaction past query_timeout: the loop was stalled),
# it has no connection slot free right now, it cancelled the statement (a statement_timeout, a DBA's
# pg_cancel_backend), or it picked the statement as a deadlock's or a serialization conflict's victim.
_PASSING_STATES = frozenset({"57P01", "57P02", "57P03", "53300", "25P03", "57014", "40P01", "40001"})


def unreachable(exc: BaseException) -> bool:
    """True when the server could not be reached, went away or gave up on the statement for reasons
    of the moment, which trying again mends. Every other error (a value the server refuses, a
    statement over one of its limits) comes back the same however often the statement is tried."""
    if not isinstance(exc, psycopg.Error) or isinstance(exc, PoolClosed):
        return False  # (a closed pool stays closed: its runtime was closed, and waiting cannot help)
    state = exc.sqlstate
    if state is None:
        return isinstance(exc, psycopg.OperationalError)  # the link failed: no server answer at all
    return state.startswith("08") or state in _PASSING_STATES


async def retrying(operation: Callable[[], Awaitable[T]], what: str, patience: float = 10.0) -> T:
    """Run an idempotent database operation, trying again while the server cannot be reached (a
    restart, a failover) for up to ``patience`` seconds; then the last error propagates. Errors that
    trying again cannot mend propagate at once."""
    deadline = anyio.current_time() + patience
    delay = 0.05
    while True:
        try:
            return await operation()
        except psycopg.Error as exc:
            if not unreachable(exc) or anyio.current_time() + delay > deadline:
                raise
            log.warning("%s failed (%s); trying again in %.2fs", what, exc, delay)
            await anyio.sleep(delay)
            delay = min(delay * 2, 1.0)
