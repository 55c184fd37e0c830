"""The claims port: ``claim``, ``claim_round``, ``claim_suspect``, ``claim_limited``, ``unclaim``,
``declare_queue``, ``release``."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import anyio
import pytest

from pgflow._core.engine import NO_PINGS, Claimed, Engine
from pgflow._core.engine.claims import CRASHES_ALONE
from pgflow._core.engine.starts import Timing

from .conftest import EngineFactory
from .kit import LEASE, Kind, unique

pytestmark = pytest.mark.anyio


async def holds(engine: Engine, claimed: Claimed) -> bool:
    """Whether ``claimed``'s token still holds its workflow: a fenced write answers (a record at a
    position no test uses otherwise)."""
    fence = await engine.journal.record_step(claimed.id, claimed.attempt, claimed.lease_token, 999, "probe",
                                             None, None, 1)
    return fence.owner


def ago(hours: float) -> Timing:
    return Timing(eta=datetime.now(UTC) - timedelta(hours=hours))


class TestClaim:
    """A claim takes up to ``limit`` due workflows of the queues and names asked (no others), the
    best priority first and, within a priority, the one due longest; it marks each running under a
    lease of ``lease_seconds`` for its owner, counts an attempt, and gives each a claim token never
    handed out before, which fences every write made for that run. A workflow is held by one claim at
    a time: while its lease holds no other claim takes it, and claims racing for the same work share
    it out without overlap. A workflow not yet due is not taken; the claim says in how many seconds
    the next one of its queues and names falls due (None when none waits)."""

    async def test_best_priority_first_then_longest_due(self, engine: Engine) -> None:
        kind = Kind()
        low_old = await kind.start(engine, priority=0, when=ago(3))
        high_new = await kind.start(engine, priority=5, when=ago(1))
        high_old = await kind.start(engine, priority=5, when=ago(2))
        middle = await kind.start(engine, priority=1, when=ago(4))
        order = [(await kind.claim_one(engine)).id for _ in range(4)]
        assert order == [high_old, high_new, middle, low_old]
        assert await kind.claim(engine) == []

    async def test_a_limited_claim_takes_the_best(self, engine: Engine) -> None:
        kind = Kind()
        await kind.start(engine, priority=0)
        best = {await kind.start(engine, priority=3), await kind.start(engine, priority=2)}
        assert {c.id for c in await kind.claim(engine, limit=2)} == best

    async def test_only_the_queues_and_names_asked(self, engine: Engine) -> None:
        kind = Kind()
        other_name, other_queue = Kind(queue=kind.queue), Kind(name=kind.name)
        mine = await kind.start(engine)
        await other_name.start(engine)
        theirs = await other_queue.start(engine)
        assert [c.id for c in await kind.claim(engine)] == [mine]
        claimed, _ = await engine.claims.claim("o", [kind.queue, other_queue.queue], [kind.name], 10, LEASE)
        assert [c.id for c in claimed] == [theirs]

    async def test_a_claim_begins_a_run_under_a_new_token(self, engine: Engine) -> None:
        kind = Kind()
        first, second = await kind.start(engine), await kind.start(engine)
        one = await kind.claim_one(engine)
        two = await kind.claim_one(engine)
        assert {one.id, two.id} == {first, second}
        assert one.lease_token != two.lease_token
        assert (one.attempt, one.run, one.uncounted, one.give_up, one.suspect) == (1, 1, False, False, False)
        row = await engine.workflows.workflow(one.id)
        assert row is not None and (row.status, row.attempt) == ("running", 1)

    async def test_a_held_workflow_is_not_claimed_again_while_its_lease_holds(
            self, engine: Engine, peer: Engine) -> None:
        kind = Kind()
        await kind.run(engine)
        assert await kind.claim(peer, "other") == []
        assert await kind.claim(engine, "owner") == []  # nor by its own owner

    async def test_racing_claims_never_hand_a_workflow_to_two_owners(
            self, engine: Engine, factory: EngineFactory) -> None:
        kind = Kind()
        ids = set(await kind.starts(engine, 40))
        taken: dict[str, list[str]] = {}

        async def claimer(owner: str) -> None:
            mine = factory.peer(engine)
            while claimed := await kind.claim(mine, owner, limit=3):
                for c in claimed:
                    taken.setdefault(c.id, []).append(owner)

        async with anyio.create_task_group() as tasks:
            for n in range(5):
                tasks.start_soon(claimer, f"owner{n}")
        assert set(taken) == ids
        assert all(len(owners) == 1 for owners in taken.values()), taken

    async def test_a_claim_says_when_the_next_falls_due(self, engine: Engine) -> None:
        kind = Kind()
        assert await engine.claims.claim("o", [kind.queue], [kind.name], 10, LEASE) == ([], None)
        await kind.start(engine, delay=600.0)
        await Kind(queue=kind.queue).start(engine, delay=60.0)  # another name's: not this claim's business
        claimed, due = await engine.claims.claim("o", [kind.queue], [kind.name], 10, LEASE)
        assert claimed == [] and due is not None and 590.0 < due <= 600.0


class TestRelease:
    """``release`` gives a workflow back to its queue for the claim that holds it, due at once (no
    lease has to run out): another claim takes it at once, as a new attempt under a new token, and the
    released token's writes are refused from then on. A token that no longer holds the workflow
    releases nothing, and says so. A released run was cut short: it counts against ``max_attempts``,
    and the claim after the last one allowed gives the workflow up (``give_up``) without counting
    another run."""

    async def test_a_released_workflow_is_claimable_again_at_once(self, engine: Engine, peer: Engine) -> None:
        kind = Kind()
        first = await kind.run(engine)
        assert await engine.claims.release(first.id, first.lease_token)
        row = await engine.workflows.workflow(first.id)
        assert row is not None and row.status == "queued"
        second = await kind.claim_one(peer, "other")
        assert second.id == first.id and second.lease_token != first.lease_token
        assert (second.attempt, second.run, second.give_up) == (2, 2, False)

    async def test_a_previous_claims_token_is_fenced(self, engine: Engine) -> None:
        kind = Kind()
        first = await kind.run(engine)
        await engine.claims.release(first.id, first.lease_token)
        second = await kind.claim_one(engine)
        assert not await holds(engine, first)
        assert await holds(engine, second)
        assert not await engine.claims.release(first.id, first.lease_token)  # nor released by it
        row = await engine.workflows.workflow(first.id)
        assert row is not None and row.status == "running"
        assert await kind.claim(engine) == []

    async def test_a_release_twice_releases_once(self, engine: Engine) -> None:
        kind = Kind()
        first = await kind.run(engine)
        assert await engine.claims.release(first.id, first.lease_token)
        assert not await engine.claims.release(first.id, first.lease_token)

    async def test_the_claim_after_the_last_attempt_gives_the_workflow_up(self, engine: Engine) -> None:
        kind = Kind()
        first = await kind.run(engine, max_attempts=2)
        await engine.claims.release(first.id, first.lease_token)
        second = await kind.claim_one(engine)
        assert (second.run, second.give_up) == (2, False)
        await engine.claims.release(second.id, second.lease_token)
        last = await kind.claim_one(engine)
        assert last.id == first.id and last.give_up and last.run == 2  # no third run begun


class TestUnclaim:
    """``unclaim`` undoes claims whose workflows were not run: each goes back to its queue as it was
    before the claim (its attempt not counted, not started, no deadline set), so its next claim is
    the same as if the undone one never happened. Only claims that still hold their workflows are
    undone; the ids given back are returned."""

    async def test_an_unclaimed_workflow_is_as_it_was(self, engine: Engine) -> None:
        kind = Kind()
        await kind.start(engine, timeout=60.0)
        first = await kind.claim_one(engine)
        assert first.set_start and first.set_deadline
        assert await engine.claims.unclaim([first]) == [first.id]
        row = await engine.workflows.workflow(first.id)
        assert row is not None and (row.status, row.attempt) == ("queued", 0)
        again = await kind.claim_one(engine)
        assert (again.id, again.attempt, again.run, again.set_start, again.set_deadline) == (first.id, 1, 1, True, True)
        assert again.lease_token != first.lease_token
        assert not await holds(engine, first)

    async def test_only_claims_still_held_are_undone(self, engine: Engine) -> None:
        kind = Kind()
        one, two = await kind.starts(engine, 2)
        claimed = {c.id: c for c in await kind.claim(engine, limit=2)}
        await engine.claims.release(one, claimed[one].lease_token)
        retaken = await kind.claim_one(engine)
        assert await engine.claims.unclaim(list(claimed.values())) == [two]
        assert await holds(engine, retaken)

    async def test_a_wake_up_unclaimed_stays_uncounted(self, engine: Engine) -> None:
        kind = Kind()
        first = await kind.run(engine)
        await engine.waits.suspend(first.id, first.lease_token, datetime.now(UTC) - timedelta(seconds=1))
        woken = await kind.claim_one(engine)
        assert woken.uncounted and woken.run == 1
        assert await engine.claims.unclaim([woken]) == [woken.id]
        again = await kind.claim_one(engine)
        assert again.uncounted and (again.attempt, again.run) == (2, 1)


class TestLostLeases:
    """A workflow whose lease ran out is handed out again, under a new token (the old one's writes are
    refused). When its worker died under it (silent for a whole lease of its own, or never
    registered), it is a suspect of the crash: no plain claim takes it, a claim round says suspects
    wait, and ``claim_suspect`` hands it to one worker that runs it alone. Its ``crashes`` count the
    deaths it saw alone (0: it died beside others), and one that killed its worker alone
    ``CRASHES_ALONE`` times (within ``max_attempts``) is given up. A worker that lives on (it still
    heartbeats) and let the lease lapse only loses the run: no suspect, taken by a plain claim once
    the lease ran out a worker's lease ago, as a new attempt."""

    async def test_a_run_alone_whose_worker_died_is_a_suspect(self, engine: Engine, peer: Engine) -> None:
        kind = Kind()
        lost = await kind.run(engine, "ghost", lease=0.1)
        await anyio.sleep(0.2)
        suspect = await kind.suspect_within(peer, "other")
        assert suspect.id == lost.id and suspect.suspect and suspect.crashes == 1
        assert (suspect.attempt, suspect.run, suspect.give_up) == (2, 2, False)
        assert not await holds(peer, lost) and await holds(peer, suspect)

    async def test_runs_that_died_beside_others_are_suspects_uncharged(self, engine: Engine, peer: Engine) -> None:
        kind = Kind()
        await kind.starts(engine, 2)
        lost = await kind.claim(engine, "ghost", limit=2, lease=0.1)
        await anyio.sleep(0.2)
        first = await kind.suspect_within(peer, "other")
        assert first.crashes == 0
        second = await peer.claims.claim_suspect("other", [kind.queue], [kind.name], LEASE)
        assert second is not None and second.crashes == 0 and second.suspect
        assert {first.id, second.id} == {c.id for c in lost}

    async def test_a_workflow_that_killed_its_worker_alone_too_often_is_given_up(
            self, engine: Engine, factory: EngineFactory) -> None:
        kind = Kind()
        lost = await kind.run(engine, "ghost", lease=0.1, max_attempts=10)
        for crashes in range(1, CRASHES_ALONE + 1):
            await anyio.sleep(0.2)
            suspect = await kind.suspect_within(factory.peer(engine), "ghost", lease=0.1)
            assert suspect.id == lost.id and suspect.crashes == crashes
            assert suspect.give_up == (crashes == CRASHES_ALONE)

    async def test_a_live_workers_lapsed_lease_is_lost_not_a_crash(self, engine: Engine, peer: Engine) -> None:
        kind = Kind()
        worker = unique("w")
        await engine.workers.register_worker(worker, "host", 1, [kind.queue], "test", [kind.name], 1.0)
        lost = await kind.run(engine, worker, lease=0.1)

        async def heartbeats() -> None:
            while True:
                await engine.workers.heartbeat(worker, 0.1, "host", 1, [kind.queue], "test", [kind.name], [], 5.0)
                await anyio.sleep(0.05)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(heartbeats)
            [again] = await kind.claim_within(peer, "other")
            tasks.cancel_scope.cancel()
        assert again.id == lost.id and not again.suspect
        assert (again.attempt, again.run) == (2, 2)
        assert not await holds(peer, lost)

    async def test_a_lost_lease_makes_no_round_say_suspects_wait(self, engine: Engine, peer: Engine) -> None:
        kind = Kind()
        worker = unique("w")
        await engine.workers.register_worker(worker, "host", 1, [kind.queue], "test", [kind.name], 1.0)
        await kind.run(engine, worker, lease=0.1)
        said: list[bool | None] = []

        async def heartbeats() -> None:
            while True:
                await engine.workers.heartbeat(worker, 0.1, "host", 1, [kind.queue], "test", [kind.name], [], 5.0)
                await anyio.sleep(0.05)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(heartbeats)
            with anyio.fail_after(5.0):
                while not (found := await peer.claims.claim_round("o", [kind.queue], [kind.name], 10, LEASE)).claimed:
                    said.append(found.suspects)
                    await anyio.sleep(0.05)
            tasks.cancel_scope.cancel()
        assert not found.claimed[0].suspect
        assert True not in said


class TestLimitedQueues:
    """``declare_queue`` records a queue's limits (or forgets them when there are none), and
    ``claim_limited`` claims from it within them, across every worker: at most ``concurrency``
    workflows of the queue run at once (a dead worker's runs among them until they ran again:
    test_key_limits.py), and at most ``rate_limit`` claims per
    ``rate_period`` seconds (a bucket that starts full); when the bucket is dry, the claim says in how
    many seconds its next token comes. A queue without limits is claimed from as ``claim`` does."""

    async def test_concurrency_holds_across_owners(self, engine: Engine, peer: Engine) -> None:
        kind = Kind()
        await engine.claims.declare_queue(kind.queue, 2, None, 1.0)
        await kind.starts(engine, 4)
        one = await engine.claims.claim_limited("a", kind.queue, [kind.name], 1, LEASE)
        two = await peer.claims.claim_limited("b", kind.queue, [kind.name], 10, LEASE)
        assert len(one.claimed) == 1 and len(two.claimed) == 1
        assert (await engine.claims.claim_limited("a", kind.queue, [kind.name], 10, LEASE)).claimed == []
        done = one.claimed[0]
        assert await engine.ends.finish_many([done.id], [done.lease_token], ["succeeded"], [None], [None], NO_PINGS)
        assert len((await peer.claims.claim_limited("b", kind.queue, [kind.name], 10, LEASE)).claimed) == 1

    async def test_a_rate_limit_paces_claims(self, engine: Engine) -> None:
        kind = Kind()
        await engine.claims.declare_queue(kind.queue, None, 2, 3600.0)
        await kind.starts(engine, 3)
        first = await engine.claims.claim_limited("a", kind.queue, [kind.name], 10, LEASE)
        assert len(first.claimed) == 2
        dry = await engine.claims.claim_limited("a", kind.queue, [kind.name], 10, LEASE)
        assert dry.claimed == [] and dry.refill is not None and 0 < dry.refill <= 1800.0

    async def test_limits_forgotten_are_no_limits(self, engine: Engine) -> None:
        kind = Kind()
        await engine.claims.declare_queue(kind.queue, 1, None, 1.0)
        await engine.claims.declare_queue(kind.queue, None, None, 1.0)
        await kind.starts(engine, 3)
        found = await engine.claims.claim_limited("a", kind.queue, [kind.name], 10, LEASE)
        assert len(found.claimed) == 3 and found.refill is None

    async def test_a_limited_claim_takes_only_the_names_asked(self, engine: Engine) -> None:
        kind = Kind()
        await engine.claims.declare_queue(kind.queue, 5, None, 1.0)
        await Kind(queue=kind.queue).start(engine)
        mine = await kind.start(engine)
        found = await engine.claims.claim_limited("a", kind.queue, [kind.name], 10, LEASE)
        assert [c.id for c in found.claimed] == [mine]
