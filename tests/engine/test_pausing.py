"""The pausing port: ``pause_queue``, ``resume_queue``, ``paused_queues``, ``queue_known``."""

from __future__ import annotations

import anyio
import pytest

from pgflow._core.engine import Engine

from .kit import LEASE, Kind

pytestmark = pytest.mark.anyio


class TestPausing:
    """A paused queue keeps its work but hands none out: no claim (plain, limited or of a suspect)
    takes a workflow from it, and no claim reports its next due time; its running workflows run on.
    Pausing again changes nothing (the same ``since``); resuming says whether it was paused, and its
    work is claimable again at once. ``queue_known`` says whether the fleet knows a queue: one with work
    queued or running, limits, a worker serving it, or paused."""

    async def test_a_paused_queue_hands_nothing_out(self, engine: Engine) -> None:
        kind = Kind()
        running = await kind.run(engine)
        await kind.start(engine)
        await kind.start(engine, delay=600.0)
        since = await engine.pausing.pause_queue(kind.queue)
        assert await engine.pausing.pause_queue(kind.queue) == since
        assert (await engine.pausing.paused_queues())[kind.queue] == since
        assert await engine.claims.claim("o", [kind.queue], [kind.name], 10, LEASE) == ([], None)
        await engine.claims.declare_queue(kind.queue, 5, None, 1.0)
        assert (await engine.claims.claim_limited("o", kind.queue, [kind.name], 10, LEASE)).claimed == []
        record = await engine.journal.record_step(running.id, running.attempt, running.lease_token, 0, "s", None,
                                                  None, 1)
        assert record.owner  # a running workflow runs on
        assert await engine.pausing.resume_queue(kind.queue)
        assert not await engine.pausing.resume_queue(kind.queue)
        assert kind.queue not in await engine.pausing.paused_queues()
        claimed, due = await engine.claims.claim("o", [kind.queue], [kind.name], 10, LEASE)
        assert len(claimed) == 1 and due is not None and 590.0 < due <= 600.0

    async def test_a_paused_queue_hands_out_no_suspect(self, engine: Engine, peer: Engine) -> None:
        kind = Kind()
        await kind.run(engine, "ghost", lease=0.1)
        await engine.pausing.pause_queue(kind.queue)
        await anyio.sleep(0.2)
        assert (await peer.claims.claim_round("o", [kind.queue], [kind.name], 10, LEASE)).claimed == []  # (rescues)
        assert await peer.claims.claim_suspect("o", [kind.queue], [kind.name], LEASE) is None
        await engine.pausing.resume_queue(kind.queue)
        assert (await kind.suspect_within(peer, "o")).suspect

    async def test_no_round_says_suspects_wait_in_a_paused_queue(self, engine: Engine, peer: Engine) -> None:
        kind = Kind()
        await kind.run(engine, "ghost", lease=0.1)
        await engine.pausing.pause_queue(kind.queue)
        await anyio.sleep(0.2)
        found = await peer.claims.claim_round("o", [kind.queue], [kind.name], 10, LEASE)  # (rescues it)
        assert found.claimed == [] and not found.suspects

    async def test_which_queues_are_known(self, engine: Engine) -> None:
        queued, limited, paused, unknown = Kind(), Kind(), Kind(), Kind()
        await queued.start(engine)
        await engine.claims.declare_queue(limited.queue, 1, None, 1.0)
        await engine.pausing.pause_queue(paused.queue)
        assert [await engine.pausing.queue_known(k.queue) for k in (queued, limited, paused, unknown)] == \
            [True, True, True, False]
