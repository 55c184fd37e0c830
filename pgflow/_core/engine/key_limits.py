"""The SQL of per-key limits (``app.queue(..., key_concurrency=, key_rate_limit=)``): which workflows of a
key-limited queue a claim takes, what each key's bucket holds, and the clean-up of full buckets.

A key-limited queue is claimed as a limited one is (``Claims.claim_limited``): under its ``queues`` row,
locked ``FOR UPDATE``, so one claim of the queue runs at a time across the fleet, and what it counts
(each key's running workflows, each key's tokens) cannot change under it. The limits are therefore
exact, whatever the number of workers, and the cost is that the queue's claims are serialised (one
statement each, after the lock).

Fairness is by turns: a claim round walks the keys that have queued work in key order, beginning after
the key the queue's last full round ended at (``queues.key_cursor``, wrapping round), and gives each key
in turn its best workflow (priority, then due time), up to the key's free slots and tokens; only when
every key has had its turn and slots are left does a key get a second workflow (up to its free slots
and tokens) in the same round. A key with ten thousand queued workflows has one turn per round like a
key with one, so the one is claimed in the first round that has a free slot for it once the keys before
it had theirs. Priority orders a key's own workflows; between keys, the turns decide.

The walk is a skip scan of ``workflows_queued_by_key`` (migration 0032): from each key to the next by
one index probe, evaluated lazily, so a round that fills its slots early reads only the keys it served
(and the full or dry ones it passed), not every key with work. Only a round that comes up short walks
every key.

Concurrency counts every running workflow of the key, whatever its lease says, and its queued suspects
(migration 0028): a dead worker's runs hold their key's slots until they are rescued, then as suspects
until a worker runs them alone (a suspect's claim consults no limits; it takes the place it held). A
count of live leases alone would let new runs take those places while the lease ran out, and the
suspects run beside them afterwards: the limit broken by a crash.
"""

from __future__ import annotations

from typing import TypedDict

from .database import Port, Sql
from .statement import Batch


def keyed_queued(verdict: str, not_paused: str) -> str:
    """The first part of a key-limited queue's claim (``claims._claim``): ``queued``, the rows it
    takes, locked, with the ``verdict`` columns; and, as its side effects, the keys' buckets spent
    and the queue's cursor moved. ``not_paused``: the condition that the queue is not paused."""
    candidate = (
        "SELECT id, priority, due_at, " + verdict + " FROM {s}.workflows"
        "   WHERE status = 'queued' AND queue = %(queue)s AND key = t.key AND due_at <= {s}.clock_now()"
        "   AND name = ANY(%(names)s) AND crashes IS NULL ORDER BY priority DESC, due_at"
    )
    return (
        "WITH RECURSIVE lim AS MATERIALIZED (SELECT key_concurrency AS kc, key_rate_limit AS kr,"
        "   rate_period AS period, coalesce(key_cursor, '') AS cursor FROM {s}.queues"
        "   WHERE name = %(queue)s AND " + not_paused + "),"
        # Each key's running workflows and queued suspects, by key (as many as the fleet runs).
        " held AS MATERIALIZED (SELECT key, count(*)::int AS n FROM (SELECT key FROM {s}.workflows"
        "   WHERE queue = %(queue)s AND status = 'running' UNION ALL SELECT key FROM {s}.workflows"
        "   WHERE queue = %(queue)s AND status = 'queued' AND crashes IS NOT NULL) h GROUP BY key),"
        # The keys with queued work, from the one after the cursor (lap 0) round to the cursor itself
        # (lap 1), '' (no key) among them: the first row is the cursor, a position, not a turn. Each
        # next key is one probe of the index; the walk goes only as far as the rows below are read.
        " ring(key, lap, pos) AS (SELECT cursor, 0, 0 FROM lim"
        "  UNION ALL SELECT n.key, n.lap, r.pos + 1 FROM ring r CROSS JOIN lim l"
        "   CROSS JOIN LATERAL ((SELECT w.key, r.lap FROM {s}.workflows w WHERE w.status = 'queued'"
        "     AND w.queue = %(queue)s AND w.key > r.key AND (r.lap = 0 OR w.key <= l.cursor) ORDER BY w.key LIMIT 1)"
        "    UNION ALL (SELECT w.key, 1 FROM {s}.workflows w WHERE r.lap = 0 AND w.status = 'queued'"
        "     AND w.queue = %(queue)s AND w.key <= l.cursor ORDER BY w.key LIMIT 1) LIMIT 1) n),"
        # Each key's turn: how many it may take (its free slots, its whole tokens, the round's slots;
        # a limit that is NULL takes no part in least()), and its tokens now, refilled.
        " turns AS (SELECT r.key, r.pos, b.tokens,"
        "   least(%(limit)s, l.kc - coalesce((SELECT h.n FROM held h WHERE h.key = r.key), 0),"
        "    floor(b.tokens))::int AS cap"
        "   FROM ring r CROSS JOIN lim l CROSS JOIN LATERAL (SELECT CASE WHEN l.kr IS NOT NULL THEN coalesce(("
        "    SELECT least(l.kr, k.tokens + l.kr * extract(epoch FROM now() - k.refilled_at)::float8 / l.period)"
        "    FROM {s}.queue_keys k WHERE k.queue = %(queue)s AND k.key = r.key), l.kr) END AS tokens OFFSET 0) b"
        "   WHERE r.pos > 0),"
        # First turns: each key's best workflow, key after key, until the round's slots are filled.
        " first AS (SELECT c.*, t.key, t.pos, t.tokens, 1 AS pass FROM turns t CROSS JOIN LATERAL ("
        + candidate + " LIMIT 1 FOR UPDATE SKIP LOCKED) c WHERE t.cap > 0 LIMIT %(limit)s),"
        # Then, only if slots are left (every key had its turn), each key's next ones.
        " more AS (SELECT c.*, t.key, t.pos, t.tokens, 2 AS pass FROM turns t CROSS JOIN LATERAL ("
        + candidate + " OFFSET 1 LIMIT t.cap - 1 FOR UPDATE SKIP LOCKED) c"
        "   WHERE t.cap > 1 AND (SELECT count(*) FROM first) < %(limit)s"
        "   LIMIT greatest(%(limit)s - (SELECT count(*) FROM first), 0)),"
        " taken AS (SELECT * FROM first UNION ALL SELECT * FROM more),"
        " queued AS (SELECT id, priority, due_at, due_at AS ready_at, free, give_up FROM taken),"
        # A full round moves the cursor to the key it ended at; a round that came up short served
        # every key all it could, and leaves it.
        " moved AS (UPDATE {s}.queues SET key_cursor = (SELECT key FROM taken ORDER BY pass DESC, pos DESC LIMIT 1)"
        "   WHERE name = %(queue)s AND %(limit)s > 0 AND (SELECT count(*) FROM taken) >= %(limit)s),"
        # Each key's tokens, less what the round took (the queue's lock makes the read-then-write exact).
        " spent AS (INSERT INTO {s}.queue_keys AS b (queue, key, tokens, refilled_at)"
        "   SELECT %(queue)s, key, tokens - count(*), now() FROM taken WHERE tokens IS NOT NULL GROUP BY key, tokens"
        "   ON CONFLICT (queue, key) DO UPDATE SET tokens = excluded.tokens, refilled_at = excluded.refilled_at),"
    )


# When a round came up short and the queue has a per-key rate: the seconds until the first key with due
# work whose bucket ran dry has a whole token again (None: no such key), for the claim loop's next look.
class NextToken(TypedDict):
    queue: str
    names: list[str]


NEXT_TOKEN = Sql(
    "SELECT min((1 - b.tokens) * q.rate_period / q.key_rate_limit) FROM {s}.queues q"
    " CROSS JOIN LATERAL (SELECT k.key, least(q.key_rate_limit::float8, k.tokens + q.key_rate_limit"
    "   * extract(epoch FROM now() - k.refilled_at)::float8 / q.rate_period) AS tokens"
    "  FROM {s}.queue_keys k WHERE k.queue = q.name) b"
    " WHERE q.name = %(queue)s AND q.key_rate_limit IS NOT NULL AND b.tokens < 1"
    "  AND EXISTS (SELECT FROM {s}.workflows w WHERE w.status = 'queued' AND w.queue = q.name AND w.key = b.key"
    "   AND w.due_at <= {s}.clock_now() AND w.name = ANY(%(names)s) AND w.crashes IS NULL)",
    row=tuple[float | None], params=NextToken)

# Buckets that are full again (a key without a row has a full bucket), and those of queues that have
# no per-key rate any more. The delete tests the row it deletes again: a claim that spent the bucket
# after this statement's snapshot (the delete then waits for it, and reads the row it wrote) keeps it.
_FULL = ("NOT EXISTS (SELECT FROM {s}.queues q WHERE q.name = k.queue AND q.key_rate_limit IS NOT NULL"
         " AND k.tokens + q.key_rate_limit * extract(epoch FROM now() - k.refilled_at)::float8 / q.rate_period"
         "  < q.key_rate_limit)")
FULL_BUCKETS = Sql(
    f"WITH full_ AS (SELECT k.queue, k.key FROM {{s}}.queue_keys k WHERE {_FULL} LIMIT %(batch)s),"
    " gone AS (DELETE FROM {s}.queue_keys k USING full_ f WHERE k.queue = f.queue AND k.key = f.key"
    f"  AND {_FULL} RETURNING 1)"
    " SELECT count(*) FROM gone", row=tuple[int], params=Batch)


class KeyLimits(Port):
    """The per-key statements of ``Engine`` besides the claim's own part (``keyed_queued``)."""

    async def prune_buckets(self, batch: int) -> int:
        """Delete up to ``batch`` buckets that are full again; how many went."""
        row = await self.db.row(FULL_BUCKETS, batch=batch)
        return row[0] if row else 0
