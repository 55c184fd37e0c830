"""The waits port: ``record_wake``, ``suspend``, ``send``, ``receive``, ``set_event``, ``get_event``."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from pgflow._core.engine import Claimed, Engine, Fence, Receipt, Requeued, StepRecord
from pgflow._core.status import Status

from .kit import LEASE, Kind, unique

pytestmark = pytest.mark.anyio

HOUR = timedelta(hours=1)


def now() -> datetime:
    return datetime.now(UTC)


async def receive(engine: Engine, claimed: Claimed, position: int, topic: str = "t", timeout: float = 60.0,
                  final: bool = False) -> tuple[bool, Receipt]:
    """(whether the claim held the workflow, the receipt)."""
    found = await engine.waits.receive(claimed.id, claimed.attempt, claimed.lease_token, position, f"recv:{topic}",
                                       topic, timeout, final)
    return found.owner, found.value


async def record_of(engine: Engine, workflow_id: str, position: int) -> StepRecord | None:
    return (await engine.journal.journal(workflow_id))[0].get(position)


class TestSleeps:
    """``record_wake`` journals, for the claim holding the workflow, a wake-up ``seconds`` from now at
    a position, and answers it: the seconds left and the time. A position journals one wake-up: asked
    again (a replay), it answers the same time, with less left. A token that lost the workflow
    journals nothing (``owner=False``). The journal reads the wake-up back with the seconds left."""

    async def test_a_wake_up_is_journaled_once(self, engine: Engine) -> None:
        claimed = await Kind().run(engine)
        first = await engine.waits.record_wake(claimed.id, claimed.attempt, claimed.lease_token, 0, "sleep", 100.0)
        assert (first.owner, first.cancel) == (True, False) and 95.0 < first.value.left <= 100.0
        again = await engine.waits.record_wake(claimed.id, claimed.attempt, claimed.lease_token, 0, "sleep", 5.0)
        assert again.owner and again.value.at == first.value.at and again.value.left <= first.value.left
        record = await record_of(engine, claimed.id, 0)
        assert record is not None and (record.name, record.wake_at, record.waiting) == ("sleep", first.value.at, False)
        assert record.remaining is not None and 90.0 < record.remaining <= 100.0

    async def test_a_lost_token_journals_no_wake_up(self, engine: Engine) -> None:
        kind = Kind()
        lost = await kind.run(engine)
        await engine.claims.release(lost.id, lost.lease_token)
        found = await engine.waits.record_wake(lost.id, lost.attempt, lost.lease_token, 0, "sleep", 100.0)
        assert not found.owner
        assert await engine.journal.journal(lost.id) == ({}, -1)


class TestSuspend:
    """``suspend`` gives a running workflow's slot back until a time (or its deadline, if sooner) for
    the claim holding it: queued again, due then, its lease gone and the token's writes refused; its
    next claim counts no new run (``uncounted``). A cancellation asked for meanwhile ends it cancelled
    instead. Waiting for a topic whose message is already there makes it due at once. A token that no
    longer holds it suspends nothing (None)."""

    async def test_a_suspended_workflow_is_due_at_its_time(self, engine: Engine) -> None:
        kind = Kind()
        claimed = await kind.run(engine)
        assert await engine.waits.suspend(claimed.id, claimed.lease_token, now() + HOUR) == \
            Requeued(kind.queue, Status.QUEUED)
        got, due = await engine.claims.claim("o", [kind.queue], [kind.name], 10, LEASE)
        assert got == [] and due is not None and 3500.0 < due <= 3600.0
        assert not (await engine.journal.record_step(claimed.id, claimed.attempt, claimed.lease_token, 0, "s", None,
                                                     None, 1)).owner

    async def test_a_wake_up_is_no_new_run(self, engine: Engine) -> None:
        kind = Kind()
        claimed = await kind.run(engine)
        await engine.waits.suspend(claimed.id, claimed.lease_token, now() - timedelta(seconds=1))
        woken = await kind.claim_one(engine)
        assert (woken.id, woken.attempt, woken.run, woken.uncounted) == (claimed.id, 2, 1, True)
        assert woken.lease_token != claimed.lease_token

    async def test_a_suspension_ends_at_the_deadline_if_sooner(self, engine: Engine) -> None:
        kind = Kind()
        claimed = await kind.run(engine, timeout=60.0)
        await engine.waits.suspend(claimed.id, claimed.lease_token, now() + HOUR)
        _, due = await engine.claims.claim("o", [kind.queue], [kind.name], 10, LEASE)
        assert due is not None and due <= 60.0

    async def test_a_cancellation_asked_meanwhile_ends_it_cancelled(self, engine: Engine) -> None:
        kind = Kind()
        claimed = await kind.run(engine)
        await engine.workflows.request_cancel(claimed.id)
        assert await engine.waits.suspend(claimed.id, claimed.lease_token, now()) == \
            Requeued(kind.queue, Status.CANCELLED)
        row = await engine.workflows.workflow(claimed.id)
        assert row is not None and row.status == "cancelled"
        assert await kind.claim(engine) == []

    async def test_a_lost_token_suspends_nothing(self, engine: Engine) -> None:
        kind = Kind()
        lost = await kind.run(engine)
        await engine.claims.release(lost.id, lost.lease_token)
        assert await engine.waits.suspend(lost.id, lost.lease_token, now() + HOUR) is None
        again = await kind.claim_one(engine)
        assert again.id == lost.id and not again.uncounted  # still due now, and a run cut short


class TestMessages:
    """``send`` stores a message for a workflow (once per idempotency key) and makes the workflow due
    at once when it gave its slot back to wait for that topic; it answers (stored now, the workflow's
    queue, made due), or None when there is no such workflow. ``receive``, for the claim holding the
    workflow, takes the oldest message of a topic not taken yet and journals it at a position, in one
    step: a message is delivered once, and a position receives one message (asked again, it takes
    none). Without a message the position is journaled as waiting, with a deadline ``timeout`` from the
    first look, which later looks keep; a ``final`` look without one journals it as timed out, and that
    position takes no message afterwards. A token that lost the workflow takes nothing."""

    async def test_a_message_sent_before_receive_is_delivered_once(self, engine: Engine) -> None:
        kind = Kind()
        claimed = await kind.run(engine)
        assert await engine.waits.send(claimed.id, "t", b"hello", None) == (True, kind.queue, False)
        owner, got = await receive(engine, claimed, 0)
        assert owner and (got.taken, got.value) == (True, b"hello")
        owner, got = await receive(engine, claimed, 1)
        assert owner and (got.taken, got.value) == (False, None)
        record = await record_of(engine, claimed.id, 0)
        assert record is not None and (record.output, record.waiting) == (b"hello", False)

    async def test_messages_come_oldest_first_one_per_position(self, engine: Engine) -> None:
        claimed = await Kind().run(engine)
        for value in (b"a", b"b", b"c"):
            await engine.waits.send(claimed.id, "t", value, None)
        assert (await receive(engine, claimed, 0))[1].value == b"a"
        assert not (await receive(engine, claimed, 0))[1].taken  # a replay of position 0 takes no other
        assert (await receive(engine, claimed, 1))[1].value == b"b"
        assert (await receive(engine, claimed, 2))[1].value == b"c"

    async def test_topics_are_apart(self, engine: Engine) -> None:
        claimed = await Kind().run(engine)
        await engine.waits.send(claimed.id, "other", b"x", None)
        assert not (await receive(engine, claimed, 0, "t"))[1].taken
        assert (await receive(engine, claimed, 1, "other"))[1].value == b"x"

    async def test_a_message_is_stored_once_per_idempotency_key(self, engine: Engine) -> None:
        kind = Kind()
        claimed = await kind.run(engine)
        assert await engine.waits.send(claimed.id, "t", b"one", "k") == (True, kind.queue, False)
        assert await engine.waits.send(claimed.id, "t", b"two", "k") == (False, kind.queue, False)
        assert await engine.waits.send(claimed.id, "t", b"three", None) == (True, kind.queue, False)
        assert [(await receive(engine, claimed, p))[1].value for p in range(3)] == [b"one", b"three", None]

    async def test_a_send_to_no_workflow_is_none(self, engine: Engine) -> None:
        assert await engine.waits.send(unique("none"), "t", b"x", None) is None
        assert await engine.waits.send(unique("none"), "t", b"x", "k") is None

    async def test_a_send_wakes_a_workflow_waiting_for_its_topic(self, engine: Engine) -> None:
        kind = Kind()
        claimed = await kind.run(engine)
        await engine.waits.suspend(claimed.id, claimed.lease_token, now() + HOUR, topic="t")
        assert await engine.waits.send(claimed.id, "other", b"x", None) == (True, kind.queue, False)
        assert await kind.claim(engine) == []
        assert await engine.waits.send(claimed.id, "t", b"y", None) == (True, kind.queue, True)
        woken = await kind.claim_one(engine)
        assert woken.id == claimed.id and woken.uncounted

    async def test_a_suspension_for_a_topic_with_a_message_waiting_is_due_at_once(self, engine: Engine) -> None:
        kind = Kind()
        claimed = await kind.run(engine)
        await engine.waits.send(claimed.id, "t", b"early", None)
        await engine.waits.suspend(claimed.id, claimed.lease_token, now() + HOUR, topic="t")
        woken = await kind.claim_one(engine)
        assert (await receive(engine, woken, 0))[1].value == b"early"

    async def test_a_receive_without_a_message_waits_until_its_first_deadline(self, engine: Engine) -> None:
        claimed = await Kind().run(engine)
        owner, first = await receive(engine, claimed, 0, timeout=60.0)
        assert owner and not first.taken and 55.0 < first.left <= 60.0
        _, again = await receive(engine, claimed, 0, timeout=5.0)
        assert not again.taken and again.deadline == first.deadline
        record = await record_of(engine, claimed.id, 0)
        assert record is not None and record.waiting and record.wake_at == first.deadline
        await engine.waits.send(claimed.id, "t", b"late", None)
        _, got = await receive(engine, claimed, 0)
        assert (got.taken, got.value) == (True, b"late")
        record = await record_of(engine, claimed.id, 0)
        assert record is not None and (record.waiting, record.output) == (False, b"late")

    async def test_a_final_look_without_a_message_journals_a_timeout(self, engine: Engine) -> None:
        claimed = await Kind().run(engine)
        _, got = await receive(engine, claimed, 0, final=True)
        assert not got.taken
        record = await record_of(engine, claimed.id, 0)
        assert record is not None and (record.waiting, record.output) == (False, None)
        await engine.waits.send(claimed.id, "t", b"after", None)
        assert not (await receive(engine, claimed, 0))[1].taken
        assert (await receive(engine, claimed, 1))[1].value == b"after"

    async def test_a_lost_token_takes_nothing(self, engine: Engine) -> None:
        kind = Kind()
        lost = await kind.run(engine)
        await engine.waits.send(lost.id, "t", b"kept", None)
        await engine.claims.release(lost.id, lost.lease_token)
        owner, got = await receive(engine, lost, 0)
        assert not owner and not got.taken
        holder = await kind.claim_one(engine)
        assert (await receive(engine, holder, 0))[1].value == b"kept"


class TestEvents:
    """``set_event`` publishes a value under a key for the claim holding the workflow, and journals it
    at a position in the same step: a position publishes once (a replay publishes nothing, even a
    different value), a later position under the same key replaces the value. A token that lost the
    workflow publishes nothing. ``get_event`` answers (the value or None, the workflow's status), or
    None when there is no such workflow."""

    async def test_an_event_is_published_once_per_position(self, engine: Engine) -> None:
        claimed = await Kind().run(engine)
        assert await engine.waits.get_event(claimed.id, "k") == (None, "running")
        assert await _set(engine, claimed, 0, "k", b"one") == Fence(True, False)
        assert await engine.waits.get_event(claimed.id, "k") == (b"one", "running")
        assert await _set(engine, claimed, 0, "k", b"replayed") == Fence(True, False)
        assert await engine.waits.get_event(claimed.id, "k") == (b"one", "running")
        await _set(engine, claimed, 1, "k", b"two")
        await _set(engine, claimed, 2, "other", b"x")
        assert await engine.waits.get_event(claimed.id, "k") == (b"two", "running")
        assert 0 in (await engine.journal.journal(claimed.id))[0]

    async def test_a_lost_token_publishes_nothing(self, engine: Engine) -> None:
        kind = Kind()
        lost = await kind.run(engine)
        await engine.claims.release(lost.id, lost.lease_token)
        assert (await _set(engine, lost, 0, "k", b"late")).owner is False
        assert await engine.waits.get_event(lost.id, "k") == (None, "queued")

    async def test_no_workflow_no_event(self, engine: Engine) -> None:
        assert await engine.waits.get_event(unique("none"), "k") is None


async def _set(engine: Engine, claimed: Claimed, position: int, key: str, value: bytes) -> Fence:
    return await engine.waits.set_event(claimed.id, claimed.attempt, claimed.lease_token, position,
                                        f"set_event:{key}", key, value)
