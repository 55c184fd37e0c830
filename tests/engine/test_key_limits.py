"""Per-key limits: the claims port's ``declare_queue`` (``key_concurrency``, ``key_rate_limit``) and
``claim_limited`` on a queue that has them, a start's key (``NewWorkflows.key``), and the ``key_limits``
port (``prune_buckets``)."""

from __future__ import annotations

import dataclasses

import anyio
import pytest

from pgflow._core.engine import NO_PINGS, Claimed, Engine

from .kit import LEASE, Kind, unique

pytestmark = pytest.mark.anyio


async def start(engine: Engine, kind: Kind, key: str | None, count: int = 1) -> list[str]:
    """Start ``count`` workflows of ``kind`` under ``key`` (None: none), one after the other; their ids."""
    ids = []
    for _ in range(count):
        id = unique(kind.name)
        started = await engine.starts.enqueue(id, b"in", dataclasses.replace(kind.new(), key=key), NO_PINGS)
        assert started.created
        ids.append(id)
    return ids


async def claim(engine: Engine, kind: Kind, owner: str = "a", limit: int = 10, lease: float = LEASE) -> list[str]:
    return [c.id for c in (await engine.claims.claim_limited(owner, kind.queue, [kind.name], limit, lease)).claimed]


async def finish(engine: Engine, claimed: Claimed) -> None:
    assert await engine.ends.finish_many([claimed.id], [claimed.lease_token], ["succeeded"], [None], [None], NO_PINGS)


async def suspects_wait(engine: Engine, kind: Kind) -> None:
    """Limited claims, which must take nothing, until one says suspects wait (within 5 s)."""
    with anyio.fail_after(5.0):
        while True:
            found = await engine.claims.claim_limited("p", kind.queue, [kind.name], 10, LEASE)
            assert found.claimed == [], "a place held by a dead worker's run was taken"
            if found.suspects:
                return
            await anyio.sleep(0.05)


class TestKeyLimitedQueues:
    """A queue with per-key limits is claimed within them across every worker: at most
    ``key_concurrency`` of one key's workflows run at once, at most ``key_rate_limit`` of them are
    claimed per ``rate_period`` seconds (a bucket per key, full at first), and the workflows without a
    key share one key. Keys take turns: a round gives each key with work its best workflow before any key
    a second, beginning after the key where the last full round ended, so a key's backlog holds no other
    key's workflow back. A run whose worker died keeps its key's place until it ran again."""

    async def test_key_concurrency_holds_across_owners_and_keys_run_beside_each_other(
            self, engine: Engine, peer: Engine) -> None:
        kind = Kind()
        await engine.claims.declare_queue(kind.queue, None, None, 1.0, key_concurrency=1)
        a = await start(engine, kind, "a", 2)
        b = await start(engine, kind, "b", 2)
        none = await start(engine, kind, None, 2)
        first = await engine.claims.claim_limited("o", kind.queue, [kind.name], 10, LEASE)
        assert sorted(c.id for c in first.claimed) == sorted([a[0], b[0], none[0]])
        assert await claim(peer, kind, "p") == []
        await finish(engine, next(c for c in first.claimed if c.id == a[0]))
        assert await claim(peer, kind, "p") == [a[1]]

    async def test_a_lone_keys_workflow_has_its_turn_before_a_backlogs_second(self, engine: Engine) -> None:
        kind = Kind()
        await engine.claims.declare_queue(kind.queue, None, None, 1.0, key_concurrency=100)
        await start(engine, kind, "a-hot", 5)
        [lone] = await start(engine, kind, "b-lone")
        taken = await claim(engine, kind, limit=2)
        assert lone in taken and len(taken) == 2

    async def test_rounds_go_round_the_keys(self, engine: Engine, peer: Engine) -> None:
        kind = Kind()
        await engine.claims.declare_queue(kind.queue, None, None, 1.0, key_concurrency=100)
        ids = {key: await start(engine, kind, key, 2) for key in ("a", "b", "c")}
        order = [await claim(engine if n % 2 else peer, kind, limit=1) for n in range(6)]
        assert order == [[ids["a"][0]], [ids["b"][0]], [ids["c"][0]], [ids["a"][1]], [ids["b"][1]], [ids["c"][1]]]

    async def test_a_key_rate_limit_paces_each_key_apart(self, engine: Engine, peer: Engine) -> None:
        kind = Kind()
        await engine.claims.declare_queue(kind.queue, None, None, 3600.0, key_rate_limit=2)
        a = await start(engine, kind, "a", 3)
        b = await start(engine, kind, "b", 1)
        assert sorted(await claim(engine, kind)) == sorted([*a[:2], *b])
        dry = await peer.claims.claim_limited("p", kind.queue, [kind.name], 10, LEASE)
        assert dry.claimed == [] and dry.refill is not None and 0 < dry.refill <= 1800.0

    async def test_a_dead_workers_run_keeps_its_keys_place_until_it_ran_again(
            self, engine: Engine, peer: Engine) -> None:
        kind = Kind()
        await engine.claims.declare_queue(kind.queue, None, None, 1.0, key_concurrency=1)
        first, second = await start(engine, kind, "k", 2)
        assert await claim(engine, kind, "ghost", lease=0.1) == [first]
        await anyio.sleep(0.2)  # the lease runs out; the ghost never heartbeats: it died
        # Expired, then rescued as a suspect: its place is held all along, and no claim takes the next.
        await suspects_wait(peer, kind)
        suspect = await peer.claims.claim_suspect("p", [kind.queue], [kind.name], LEASE)
        assert suspect is not None and suspect.id == first
        assert await claim(peer, kind, "p") == []
        await finish(peer, suspect)
        assert await claim(peer, kind, "p") == [second]

    async def test_a_dead_workers_run_keeps_the_queues_place_until_it_ran_again(
            self, engine: Engine, peer: Engine) -> None:
        """The queue's own ``concurrency`` counts the same way."""
        kind = Kind()
        await engine.claims.declare_queue(kind.queue, 1, None, 1.0)
        first, second = await kind.starts(engine, 2)
        assert await claim(engine, kind, "ghost", lease=0.1) == [first]
        await anyio.sleep(0.2)
        await suspects_wait(peer, kind)
        suspect = await peer.claims.claim_suspect("p", [kind.queue], [kind.name], LEASE)
        assert suspect is not None and suspect.id == first
        assert await claim(peer, kind, "p") == []
        await finish(peer, suspect)
        assert await claim(peer, kind, "p") == [second]

    async def test_full_buckets_are_pruned(self, engine: Engine) -> None:
        """A bucket refilled is the same as none: ``prune_buckets`` deletes it (how many went)."""
        kind = Kind()
        await engine.claims.declare_queue(kind.queue, None, None, 0.1, key_rate_limit=1)
        await start(engine, kind, "k", 1)
        assert len(await claim(engine, kind)) == 1
        await anyio.sleep(0.2)
        assert await engine.key_limits.prune_buckets(10_000) >= 1
