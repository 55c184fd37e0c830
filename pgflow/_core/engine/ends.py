"""The SQL of workflow ends recorded many at once (see ``_core/finisher.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from . import wire
from .channel import Pings, Riding, riding
from .database import Port
from .fencing import held

_ERRORS = msgspec.json.Encoder()

# Every end of a batch, recorded while its claim still holds the workflow (see ``finish_many``). An end
# clears the crashes a suspect was charged (migration 0028): a resume() starts it afresh.
FINISH = (
    "WITH ends AS (SELECT * FROM unnest(%(ids)s::text[], %(leases)s::int8[], %(statuses)s::text[],"
    "   %(outputs)s::bytea[], %(errors)s::text[]) AS e(id, lease, status, output, error)),"
    # (locked in id order; each end carried along, so that the update joins each row to its
    # own end: joined to ``ends`` again, a generic plan scanned every end for every row)
    " " + held("owned", "(SELECT * FROM ends ORDER BY id)", "a.*", lock=" FOR UPDATE") + ","
    " done AS (UPDATE {s}.workflows w SET status = e.status, output = e.output, error = e.error::jsonb,"
    "   finished_at = {s}.clock_now(), lease_owner = NULL, lease_expires_at = NULL, crashes = NULL"
    "   FROM owned e WHERE w.id = e.id AND w.lease_token = e.lease"
    "   RETURNING w.id, w.lease_token)"
    " SELECT id, lease_token FROM done"
    + riding(2, "(SELECT count(*) FROM done) = %(n)s")
)


Ended = tuple[str, int]  # an end recorded: the workflow's id and its claim's token (the rows of FINISHING's)


class Finishing(Riding):
    ids: wire.Texts
    leases: wire.Int8s
    statuses: wire.Texts
    outputs: wire.Byteas
    errors: wire.Texts
    n: wire.Int4


FINISHING = wire.Statement(FINISH, row=tuple[str, int], params=Finishing)

# A batch of one end (what a worker with little to do sends): one row cannot be locked out of order,
# so the update finds it and locks it itself, with the same fence, its values given as they are (no
# arrays to unnest and join): 45 of the 340 µs of its round trip here. The status is tested in a form no
# partial index's predicate follows from: planned on an empty table (see tests/test_fence_plans.py),
# ``status = 'running'`` sent the lookup through the index of running workflows instead of the key.
FINISH_ONE = (
    "WITH done AS (UPDATE {s}.workflows w SET status = %(status)s, output = %(output)s, error = %(error)s::jsonb,"
    "   finished_at = {s}.clock_now(), lease_owner = NULL, lease_expires_at = NULL, crashes = NULL"
    "   WHERE w.id = %(id)s AND w.lease_token = %(lease)s AND (w.status = 'running') IS TRUE"
    "   RETURNING w.id, w.lease_token)"
    " SELECT id, lease_token FROM done"
    + riding(2, "EXISTS (SELECT FROM done)")
)


class FinishingOne(Riding):
    id: wire.Text
    lease: wire.Int8
    status: wire.Text
    output: wire.Bytea | None
    error: wire.Text | None


FINISHING_ONE = wire.Statement(FINISH_ONE, row=tuple[str, int], params=FinishingOne)


class Ends(Port):
    """The end statements of ``Engine`` (which provides the pool and the schema)."""

    async def finish_many(
        self, workflow_ids: Sequence[str], lease_tokens: Sequence[int], statuses: Sequence[str],
        outputs: Sequence[bytes | None], errors: Sequence[dict[str, Any] | None], pings: Pings,
    ) -> set[Ended]:
        """Record the ends of many executions in one autocommit statement; ``pings`` go out with its
        commit only if every end was recorded (they may carry the ends: one that was not recorded
        must not reach a caller). An end is recorded only while its claim (``lease_tokens``)
        still holds the workflow (fencing); returns the (id, claim token) pairs that were.

        The rows are locked in id order, the order every statement that locks several workflow rows
        takes them in (heartbeats, stream batches), so two batches cannot deadlock. A batch tried
        again after a lost connection that had in fact committed finds its workflows ended: that
        reads as a lost lease, and nothing is recorded twice.
        """
        texts = [None if e is None else _ERRORS.encode(e).decode() for e in errors]
        if len(workflow_ids) == 1:
            rows = await self.db.rows(
                FINISHING_ONE, id=workflow_ids[0], lease=lease_tokens[0], status=statuses[0], output=outputs[0],
                error=texts[0], pings_channels=pings.channels, pings=pings.payloads)
        else:
            rows = await self.db.rows(
                FINISHING, ids=workflow_ids, leases=lease_tokens, statuses=statuses, outputs=outputs, errors=texts,
                n=len(workflow_ids), pings_channels=pings.channels, pings=pings.payloads)
        return set(rows)
