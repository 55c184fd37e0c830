"""The partitions of stream chunks: made ahead of time, dropped once their streams are gone.

The SQL functions are migration 0024's; here is when a process calls them. Making partitions and
dropping them both change the partitions of ``chunks``; they serialise on an advisory lock in the
functions, so the maintenance service and an ``app.prune`` may run them at once.
"""

from __future__ import annotations

import logging

import psycopg

from .database import Port, Sql

log = logging.getLogger("pgflow.retention")

# A drop takes ACCESS EXCLUSIVE on chunks; while it waits for the lock every chunk write and read
# queues behind it, so it waits briefly and tries again at the next pass.
DROP_LOCK_TIMEOUT = "200ms"
# Partitions made ahead of time, and dropped once their streams are gone (the functions of 0024; the
# drop waits only briefly for its lock).
ADD = Sql("SELECT {s}.add_chunk_partitions()", row=tuple[int])
DROP_LOCK_WAIT = Sql(f"SET LOCAL lock_timeout = '{DROP_LOCK_TIMEOUT}'", row=None)
DROP = Sql("SELECT {s}.drop_chunk_partitions()", row=tuple[str])


class Partitions(Port):
    async def add_chunk_partitions(self) -> int:
        """Make the partitions of the current period and those ahead that are missing; how many."""
        row = await self.db.row(ADD)
        return row[0] if row else 0

    async def drop_chunk_partitions(self) -> list[str]:
        """Drop the partitions whose streams have all been pruned and whose period is over; their
        names. None go when the lock on chunks is not to be had at once (a long statement on chunks):
        the next pass tries again."""
        async with self.db.session() as s:
            try:
                async with s.transaction():
                    await s.run(DROP_LOCK_WAIT)
                    dropped = [name for name, in await s.rows(DROP)]
            except psycopg.errors.LockNotAvailable:
                log.info("chunk partitions not dropped: the chunks table was busy; trying again later")
                return []
        if dropped:
            log.info("dropped the chunk partitions %s: every stream in them was pruned", ", ".join(dropped))
        return dropped

