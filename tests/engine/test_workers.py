"""The workers port: ``register_worker``, ``unregister_worker``, ``heartbeat``, ``forget_workers``."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest

from pgflow._core.engine import NO_PINGS, Engine
from pgflow._core.engine.chunks import Written
from pgflow._core.engine.workers import Held

from .kit import LEASE, Kind, unique

pytestmark = pytest.mark.anyio


async def register(engine: Engine, kind: Kind, lease: float = LEASE) -> str:
    worker = unique("w")
    await engine.workers.register_worker(worker, "host", 1, [kind.queue], "test", [kind.name], lease)
    return worker


async def heartbeat(engine: Engine, worker: str, kind: Kind, running: Sequence[str],
                    lease: float = LEASE) -> list[Held]:
    return await engine.workers.heartbeat(worker, lease, "host", 1, [kind.queue], "test", [kind.name],
                                          sorted(running), 5.0)


class TestWorkers:
    """A worker is registered (with the queues it serves, which makes them known queues) until it
    unregisters or is forgotten for its silence. Its ``heartbeat`` says it lives (registering it again
    if it was forgotten) and extends, to ``lease_seconds`` from now, the leases it still holds on the
    workflows it names as running, and only those: not one it no longer holds (released, taken over,
    ended), not one it holds and did not name (a run it gave up must let its lease run out). It answers
    each lease extended, with the claim's attempt and whether a cancellation was asked for. A lease
    extended keeps the workflow from every other claim. ``forget_workers`` forgets the workers silent
    for ``silent_for`` seconds and counts them. A registered worker's claims carry its fence (worker,
    epoch), which moves on when a run is taken from it; a batch of chunks under a fence that moved on
    is decided by the workflows' rows."""

    async def test_a_heartbeat_extends_only_leases_still_held_and_named(self, engine: Engine) -> None:
        kind = Kind()
        worker = await register(engine, kind)
        kept, released, unnamed, ended = [await kind.run(engine, worker) for _ in range(4)]
        others = await kind.run(engine, "other")
        await engine.claims.release(released.id, released.lease_token)
        await engine.ends.finish_many([ended.id], [ended.lease_token], ["succeeded"], [None], [None], NO_PINGS)
        await engine.workflows.request_cancel(kept.id)
        held = await heartbeat(engine, worker, kind, [kept.id, released.id, ended.id, others.id, unique("none")])
        assert held == [Held(kept.id, kept.attempt, True)]
        assert unnamed.id not in {h.id for h in held}

    async def test_an_extended_lease_keeps_the_workflow_from_other_claims(self, engine: Engine, peer: Engine) -> None:
        kind = Kind()
        worker = await register(engine, kind)
        claimed = await kind.run(engine, worker, lease=0.2)
        assert await heartbeat(engine, worker, kind, [claimed.id]) == [Held(claimed.id, 1, False)]
        await anyio.sleep(0.4)
        found = await peer.claims.claim_round("other", [kind.queue], [kind.name], 10, LEASE)
        assert found.claimed == [] and not found.suspects

    async def test_registered_workers_make_their_queues_known(self, engine: Engine) -> None:
        kind = Kind()
        assert not await engine.pausing.queue_known(kind.queue)
        worker = await register(engine, kind)
        assert await engine.pausing.queue_known(kind.queue)
        await engine.workers.unregister_worker(worker)
        assert not await engine.pausing.queue_known(kind.queue)
        await heartbeat(engine, worker, kind, [])  # a worker forgotten comes back with its heartbeat
        assert await engine.pausing.queue_known(kind.queue)

    async def test_silent_workers_are_forgotten(self, engine: Engine) -> None:
        silent, heard = Kind(), Kind()
        await register(engine, silent)
        await anyio.sleep(1.0)
        await register(engine, heard)
        assert await engine.workers.forget_workers(0.8) >= 1
        assert not await engine.pausing.queue_known(silent.queue)
        assert await engine.pausing.queue_known(heard.queue)

    async def test_claims_carry_the_workers_fence_which_a_takeover_moves_on(
            self, engine: Engine, peer: Engine) -> None:
        kind = Kind()
        worker = await register(engine, kind, lease=0.1)
        lost = await kind.run(engine, worker, lease=0.1)
        assert lost.fence is not None and lost.fence[0] == worker
        assert (await kind.run(engine, "unregistered")).fence is None
        sid = (await engine.chunks.stream_ids([lost.id], ["s"]))[(lost.id, "s")]
        await anyio.sleep(0.25)
        taken = await kind.suspect_within(peer, "other")
        assert taken.id == lost.id
        late = await engine.chunks.write_chunks([(lost.id, lost.lease_token)], [1], [sid], [0], [b"late"], NO_PINGS,
                                                fence=lost.fence)
        assert late == Written({(lost.id, lost.lease_token)}, set(), False)
        found, _, _, _ = await engine.chunks.read_streams([sid], [""], [""], [0], 10, 1000, 1000)
        assert found == [[]]

    async def test_an_unregistered_workers_batches_are_decided_by_the_rows(self, engine: Engine) -> None:
        kind = Kind()
        worker = await register(engine, kind)
        claimed = await kind.run(engine, worker)
        assert claimed.fence is not None
        await engine.workers.unregister_worker(worker)
        sid = (await engine.chunks.stream_ids([claimed.id], ["s"]))[(claimed.id, "s")]
        written = await engine.chunks.write_chunks([(claimed.id, claimed.lease_token)], [1], [sid], [0], [b"v"],
                                                   NO_PINGS, fence=claimed.fence)
        assert written == Written(set(), set(), False)
