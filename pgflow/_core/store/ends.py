"""The SQL of workflow ends recorded many at once (see ``_core/finisher.py``)."""

from __future__ import annotations

from typing import Any

import msgspec

from .statements import Statements

_ERRORS = msgspec.json.Encoder()

# An end's ping carries the end itself when it is small: "o:" + a JSON array [id, name, status,
# attempt, base64 output, error] (``notify.carried_end`` reads it), beside the plain "wf:<id>" that older
# listeners understand. A caller woken by it needs no read of the row.
CARRY_AT_MOST = 3000  # bytes of an "o:" key in its payload; a bigger end is only pinged
PAYLOAD_BUDGET = 4000  # bytes of keys per payload before the next begins (each key < CARRY_AT_MOST)


class EndStatements(Statements):
    """The end statements of ``Store`` (which provides the pool and the schema)."""

    async def finish_many(
        self, workflow_ids: list[str], leases: list[int], statuses: list[str], outputs: list[bytes | None],
        errors: list[dict[str, Any] | None], channel: str, pings: list[str], token: str | None,
    ) -> dict[tuple[str, int], list[str]]:
        """Record the ends of many executions in one autocommit statement, and send ``pings`` on
        ``channel`` with its commit, and (unless ``token`` is None) a ping for every end recorded,
        carrying the end when it is small. An end is recorded only while its claim (``leases``, the
        claims' tokens) still holds the workflow (fencing); returns the (id, lease) pairs that were,
        each with its ping keys.

        The rows are locked in id order, the order every statement that locks several workflow rows
        takes them in (heartbeats, stream batches), so two batches cannot deadlock. A batch tried
        again after a lost connection that had in fact committed finds its workflows ended: that
        reads as a lost lease, and nothing is recorded twice.
        """
        async with self.pool.connection() as conn:
            cur = await conn.execute(self._sql(
                "WITH ends AS (SELECT * FROM unnest(%(ids)b::text[], %(leases)b::int8[], %(statuses)b::text[],"
                "   %(outputs)b::bytea[], %(errors)b::text[]) AS e(id, lease, status, output, error)),"
                " owned AS (SELECT w.id FROM {s}.workflows w JOIN ends e ON w.id = e.id AND w.lease_token = e.lease"
                "   WHERE w.status = 'running' ORDER BY w.id FOR UPDATE OF w),"
                " done AS (UPDATE {s}.workflows w SET status = e.status, output = e.output, error = e.error::jsonb,"
                "   finished_at = now(), lease_owner = NULL, lease_expires_at = NULL"
                "   FROM ends e WHERE w.id = e.id AND w.lease_token = e.lease AND w.id IN (SELECT id FROM owned)"
                "   RETURNING w.id, w.lease_token, w.attempt, w.name, w.status, w.output, w.error),"
                " told AS (SELECT d.id, d.lease_token, array_remove(ARRAY['wf:' || d.id, CASE WHEN"
                "   octet_length(to_json(c.key)::text) <= %(carry)s THEN c.key END], NULL) AS keys"
                "   FROM done d CROSS JOIN LATERAL (SELECT 'o:' || json_build_array(d.id, d.name, d.status, d.attempt,"
                "    encode(d.output, 'base64'), d.error)::text AS key) c),"
                " sized AS (SELECT k.key, sum(octet_length(to_json(k.key)::text) + 2) OVER (ORDER BY t.id, k.key)"
                "   / %(budget)s AS part FROM told t CROSS JOIN LATERAL unnest(t.keys) AS k(key)"
                "   WHERE %(token)s::text IS NOT NULL)"
                " SELECT id, lease_token, keys FROM told"
                # Branches that return nothing but are always run: the pings go out with the commit.
                " UNION ALL SELECT NULL, NULL, NULL FROM (SELECT count(pg_notify(%(channel)s, p)) AS n"
                "   FROM unnest(%(pings)b::text[]) AS p) pinged WHERE pinged.n < 0"
                " UNION ALL SELECT NULL, NULL, NULL FROM (SELECT count(pg_notify(%(channel)s, p)) AS n FROM"
                "   (SELECT json_build_array(%(token)s::text, json_agg(key))::text AS p FROM sized GROUP BY part) ps)"
                "   told_all WHERE told_all.n < 0"
            ), {"ids": workflow_ids, "leases": leases, "statuses": statuses, "outputs": outputs,
                "errors": [None if e is None else _ERRORS.encode(e).decode() for e in errors],
                "channel": channel, "pings": pings, "token": token, "carry": CARRY_AT_MOST,
                "budget": PAYLOAD_BUDGET})
            return {(str(id), int(lease)): list(keys) for id, lease, keys in await cur.fetchall()}
