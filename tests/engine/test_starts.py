"""The starts port: ``enqueue`` and ``enqueue_many``."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from pgflow._core.engine import NO_PINGS, Engine, Pings
from pgflow._core.engine.starts import Timing

from .conftest import EngineFactory
from .kit import Kind, unique

pytestmark = pytest.mark.anyio


class TestStarts:
    """A start puts a workflow on its queue under an id, once: the first start of an id creates it
    (queued, attempt 0, its name, queue, priority, inputs, limits and parent as given) and says so;
    any later start of that id, alone or in a batch, creates nothing and answers the name the id
    already holds and the same birth (``born``, which binds news of the workflow to this one of its
    id). A batch answers each id in the order asked; an id twice in one batch is created once. A
    workflow falls due ``delay`` seconds from now, or at ``eta``, and not before; it expires at
    ``expires_at`` (or ``expires_in`` from now), after which its first claim says it expired. The
    pings given ride on the start's commit."""

    async def test_a_first_start_creates_a_queued_workflow(self, engine: Engine) -> None:
        kind = Kind()
        id = unique("s")
        started = await kind.enqueue(engine, id, b"inputs")
        assert started.created and started.name == kind.name and started.born > 0
        row = await engine.workflows.workflow(id)
        assert row is not None
        assert (row.id, row.name, row.status, row.attempt, row.output, row.error, row.born) == \
            (id, kind.name, "queued", 0, None, None, started.born)

    async def test_a_second_start_of_an_id_creates_nothing_and_names_the_first(self, engine: Engine) -> None:
        first, other = Kind(), Kind()
        id = unique("s")
        created = await first.enqueue(engine, id, b"one")
        again = await other.enqueue(engine, id, b"two")
        assert not again.created
        assert (again.name, again.born) == (first.name, created.born)
        [claimed] = await first.claim(engine)
        assert (claimed.id, claimed.inputs, claimed.queue) == (id, b"one", first.queue)  # the first start's
        assert await other.claim(engine) == []

    async def test_a_batch_answers_each_id_in_order(self, engine: Engine) -> None:
        kind, other = Kind(), Kind()
        taken = unique("s")
        before = await other.enqueue(engine, taken)
        ids = [unique("s"), taken, unique("s")]
        found = await engine.starts.enqueue_many(ids, [b"a", b"b", b"c"], kind.new(), NO_PINGS)
        assert [(s.created, s.name) for s in found] == [(True, kind.name), (False, other.name), (True, kind.name)]
        assert found[1].born == before.born
        assert found[0].born > 0 and found[2].born > 0
        claimed = await kind.claim(engine)
        assert sorted((c.id, c.inputs) for c in claimed) == sorted([(ids[0], b"a"), (ids[2], b"c")])

    async def test_an_id_twice_in_one_batch_is_created_once(self, engine: Engine) -> None:
        kind = Kind()
        id = unique("s")
        found = await engine.starts.enqueue_many([id, id], [b"a", b"b"], kind.new(), NO_PINGS)
        assert sorted(s.created for s in found) == [False, True]
        assert found[0].born == found[1].born and {s.name for s in found} == {kind.name}
        assert [c.id for c in await kind.claim(engine)] == [id]

    async def test_a_batch_after_a_single_start_of_the_same_id_creates_nothing(self, engine: Engine) -> None:
        kind = Kind()
        id = unique("s")
        single = await kind.enqueue(engine, id)
        [again] = await engine.starts.enqueue_many([id], [b"x"], kind.new(), NO_PINGS)
        assert (again.created, again.name, again.born) == (False, kind.name, single.born)

    async def test_what_a_start_gives_comes_back_with_its_claim(self, engine: Engine) -> None:
        kind = Kind()
        parent = await Kind().start(engine)
        id = await kind.start(engine, inputs=b"\x00\xffbytes", priority=7, max_attempts=4, timeout=60.0,
                              parent=parent, traceparent="00-trace-01")
        claimed = await kind.claim_one(engine)
        assert (claimed.id, claimed.name, claimed.inputs, claimed.queue, claimed.max_attempts, claimed.traceparent) == \
            (id, kind.name, b"\x00\xffbytes", kind.queue, 4, "00-trace-01")
        assert claimed.seconds_left is not None and 55.0 < claimed.seconds_left <= 60.0
        assert (claimed.attempt, claimed.run, claimed.expired, claimed.retries) == (1, 1, False, 0)
        # the parent cancels it with itself
        cancelled = await engine.workflows.request_cancel(parent)
        assert cancelled is not None and cancelled.descendants == [id]

    async def test_without_a_timeout_a_claim_has_no_time_left_to_count(self, engine: Engine) -> None:
        kind = Kind()
        await kind.start(engine)
        assert (await kind.claim_one(engine)).seconds_left is None

    async def test_a_delayed_start_is_not_due_before_its_delay(self, engine: Engine) -> None:
        kind = Kind()
        await kind.start(engine, delay=3600.0)
        claimed, due = await engine.claims.claim("owner", [kind.queue], [kind.name], 10, 30.0)
        assert claimed == []
        assert due is not None and 3500.0 < due <= 3600.0

    async def test_an_eta_in_the_past_is_due_at_once_and_one_ahead_is_not(self, engine: Engine) -> None:
        kind = Kind()
        now = datetime.now(UTC)
        ahead = await kind.start(engine, when=Timing(eta=now + timedelta(hours=1)))
        past = await kind.start(engine, when=Timing(eta=now - timedelta(hours=1)))
        claimed, due = await engine.claims.claim("owner", [kind.queue], [kind.name], 10, 30.0)
        assert [c.id for c in claimed] == [past]
        assert due is not None and 3500.0 < due <= 3600.0
        assert (await engine.workflows.workflow(ahead)) is not None

    async def test_a_start_past_its_expiry_is_claimed_expired(self, engine: Engine) -> None:
        kind = Kind()
        gone = await kind.start(engine, when=Timing(expires_at=datetime.now(UTC) - timedelta(seconds=1)))
        lasting = await kind.start(engine, when=Timing(expires_in=3600.0))
        claimed = {c.id: c for c in await kind.claim(engine)}
        assert claimed[gone].expired and not claimed[lasting].expired

    async def test_a_start_sends_its_pings_with_its_commit(self, engine: Engine, factory: EngineFactory) -> None:
        kind, channel = Kind(), unique("ch")
        async with factory.listening([channel]) as heard:
            await engine.starts.enqueue(unique("s"), b"", kind.new(), Pings([channel], ["one"]))
            await engine.starts.enqueue_many([unique("s"), unique("s")], [b"", b""], kind.new(),
                                             Pings([channel, channel], ["two", "three"]))
            assert [p for _, p in await heard.until("three")] == ["one", "two", "three"]
