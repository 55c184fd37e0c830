"""The notifier of one event loop: news for other processes, collected in memory and sent in one
background transaction at most every ``interval``, so that many writers share one NOTIFY commit (a
commit that notifies holds the cluster's notify lock through its flush).

A flush that fails is logged and dropped: a lost ping costs latency, never data, since every waiter
re-reads the table on its poll. A full notification queue is an episode (a session somewhere in the
cluster sits in an open transaction and holds it back): it is logged once when it begins and once
when it ends, and meanwhile the flushes back off to one per ``REFUSED_RETRY`` seconds.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import psycopg
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from ..engine import channel as channel_sql
from ..engine.channel import Pings
from .payload import End, News

log = logging.getLogger("pgflow.signals")

FLUSH_TIMEOUT = 2.0  # seconds a flush waits for a connection before dropping its pings
REFUSED_RETRY = 0.5  # seconds between flushes while the server refuses notifications
QUEUE_FULL = "54000"  # program_limit_exceeded: "too many notifications in the NOTIFY queue"


class Refusals:
    """Whether the server refuses notifications right now (one episode from the first refusal to the
    next notification it takes), logged once per episode, not per statement."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.dropped = 0  # pings of flushes the server refused in this episode
        self.episodes = 0

    @property
    def refusing(self) -> bool:
        return self.since is not None

    def refused(self, exc: BaseException) -> None:
        if self.since is None:
            self.since = anyio.current_time()
            self.episodes += 1
            self.dropped = 0
            log.warning("PostgreSQL refuses notifications (%s): pgflow's pings are dropped and every waiter"
                        " falls back to its poll until it takes them again. A full notification queue means a"
                        " session somewhere in the cluster sits in an open transaction after LISTEN: `pgflow"
                        " status` names the oldest open transactions.", _first_line(exc))

    def taken(self) -> None:
        if self.since is not None:
            log.warning("PostgreSQL takes notifications again after %.1f s (%d pings were dropped meanwhile)",
                        anyio.current_time() - self.since, self.dropped)
            self.since = None


class Notifier:
    """Collects news and sends it to other processes, at most one transaction every ``interval``: a
    ping after a quiet spell goes out at once, and under load the pings of a whole interval share
    one transaction."""

    def __init__(self, pool: Callable[[], Awaitable[AsyncConnectionPool[Any]]], interval: float,
                 seal: Callable[[News], Pings], refusals: Refusals) -> None:
        self._pool = pool
        self._interval = interval
        self._seal = seal
        self.refusals = refusals
        self._keys: set[str] = set()
        self._ends: dict[str, End] = {}
        self._due = anyio.Event()
        self._last_flush = -1e9
        self._flushing = False
        self._carrying = 0  # statements sending pings with their own commit right now
        self.flushes = 0
        self.failed_flushes = 0

    @property
    def pending(self) -> bool:
        return bool(self._keys or self._ends)

    def may_carry(self) -> bool:
        """Whether a statement about to commit should send its pings itself: when nothing waits for
        the next flush and no other statement of this process is carrying pings (its commit is
        then the quickest way out, with no second transaction); otherwise its news goes to ``add``
        after the commit, to be coalesced with the rest. Call ``carried`` once the statement is done.

        A second notifying commit from this process would only queue behind the first on the
        cluster's notify lock: under load the pings coalesce here, while a caller that starts one
        workflow after another sends each ping with its own commit and waits for no interval. A
        carry still open after an interval (its statement hangs or was abandoned) no longer holds
        the others back."""
        now = anyio.current_time()
        if (self.pending or self._flushing or self.refusals.refusing
                or (self._carrying and now - self._last_flush < self._interval)):
            return False
        self._carrying += 1
        self._last_flush = now
        return True

    def carried(self) -> None:
        self._carrying = max(0, self._carrying - 1)

    def add(self, news: News) -> None:
        """Send this news with the next flush."""
        first = not self.pending
        self._keys.update(news.keys)
        for end in news.ends:
            self._ends[end.workflow_id] = end
        self._keys.update(chunk.stream for chunk in news.chunks)  # a chunk is told by its stream's key
        if first:
            self._due.set()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Flush until cancelled, then flush what is left."""
        task_status.started()
        try:
            while True:
                await self._due.wait()
                self._due = anyio.Event()
                pause = REFUSED_RETRY if self.refusals.refusing else self._interval
                await anyio.sleep(max(0.0, self._last_flush + pause - anyio.current_time()))
                self._last_flush = anyio.current_time()
                self._flushing = True
                try:
                    with anyio.CancelScope(shield=True):
                        await self.flush()
                finally:
                    self._flushing = False
        finally:
            with anyio.CancelScope(shield=True):
                await self.flush()

    async def flush(self) -> None:
        if not self.pending:
            return
        news = News(sorted(self._keys), list(self._ends.values()))
        self._keys, self._ends = set(), {}
        pings = self._seal(news)
        if not pings.payloads:
            return
        try:
            pool = await self._pool()
            async with pool.connection(timeout=FLUSH_TIMEOUT) as conn:
                await channel_sql.notify(conn, pings)
            self.flushes += 1
            self.refusals.taken()
        except (psycopg.Error, OSError, PoolTimeout) as exc:
            self.failed_flushes += 1
            if isinstance(exc, psycopg.Error) and exc.sqlstate == QUEUE_FULL:
                self.refusals.refused(exc)
                self.refusals.dropped += len(news.keys) + len(news.ends)
            else:
                log.warning("dropped %d pings: %s", len(news.keys) + len(news.ends), exc)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
