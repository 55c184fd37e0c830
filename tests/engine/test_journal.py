"""The journal port: ``journal``, ``start_steps``, ``record_step``."""

from __future__ import annotations

import pytest

from pgflow._core.engine import NO_PINGS, Claimed, Engine, Fence, StepRecord, StepStart

from .kit import Kind, unique

pytestmark = pytest.mark.anyio


def note(claimed: Claimed, position: int, tries: int) -> StepStart:
    return StepStart(claimed.id, claimed.attempt, claimed.lease_token, position, tries)


async def record(engine: Engine, claimed: Claimed, position: int, output: bytes | None = b"out",
                 attempts: int = 1, name: str = "step") -> Fence:
    return await engine.journal.record_step(claimed.id, claimed.attempt, claimed.lease_token, position, name,
                                            output, None, attempts)


class TestJournal:
    """A workflow's journal holds a record per position, written by ``record_step`` for the claim that
    holds the workflow and read back whole by ``journal`` (by position, with everything recorded: name,
    output, error, stream ends), with its horizon: the highest position an earlier run reached, by a
    record or by a child it started there (a child's id is its parent's, a dot and the position, and
    for a batch a dot and an index), -1 for none. A position is recorded once: a second record there
    changes nothing and still answers that the claim holds the workflow. A record under a token that no
    longer holds the workflow writes nothing and answers ``owner=False``; one for a workflow whose
    cancellation was asked answers ``cancel=True``."""

    async def test_an_empty_journal(self, engine: Engine) -> None:
        claimed = await Kind().run(engine)
        assert await engine.journal.journal(claimed.id) == ({}, -1)
        assert await engine.journal.journal(unique("none")) == ({}, -1)

    async def test_records_read_back_by_position(self, engine: Engine) -> None:
        claimed = await Kind().run(engine)
        error = {"type": "ValueError", "message": "no", "nested": {"a": [1, 2]}}
        for position, name, output, err, ends in [(0, "a", b"zero", None, {"s": 3}), (2, "c", None, error, None),
                                                  (1, "b", b"", None, None)]:
            fence = await engine.journal.record_step(claimed.id, claimed.attempt, claimed.lease_token, position, name,
                                                     output, err, 1, ends)
            assert fence == Fence(True, False)
        journal, horizon = await engine.journal.journal(claimed.id)
        assert horizon == 2
        assert journal == {
            0: StepRecord(0, "a", b"zero", None, {"s": 3}),
            1: StepRecord(1, "b", b"", None, None),
            2: StepRecord(2, "c", None, error, None),
        }

    async def test_a_position_is_recorded_once(self, engine: Engine) -> None:
        claimed = await Kind().run(engine)
        assert await record(engine, claimed, 0, b"first") == Fence(True, False)
        assert await record(engine, claimed, 0, b"second", name="other") == Fence(True, False)
        journal, _ = await engine.journal.journal(claimed.id)
        assert (journal[0].name, journal[0].output) == ("step", b"first")

    async def test_a_record_under_a_lost_token_writes_nothing(self, engine: Engine) -> None:
        kind = Kind()
        first = await kind.run(engine)
        await engine.claims.release(first.id, first.lease_token)
        second = await kind.claim_one(engine)
        assert await record(engine, first, 0, b"late") == Fence(False, False)
        assert await engine.journal.journal(first.id) == ({}, -1)
        assert await record(engine, second, 0, b"now") == Fence(True, False)

    async def test_a_record_of_an_ended_workflow_writes_nothing(self, engine: Engine) -> None:
        claimed = await Kind().run(engine)
        assert await engine.ends.finish_many([claimed.id], [claimed.lease_token], ["succeeded"], [None], [None],
                                             NO_PINGS)
        assert (await record(engine, claimed, 0)).owner is False
        assert await engine.journal.journal(claimed.id) == ({}, -1)

    async def test_a_record_tells_of_a_cancellation_asked_for(self, engine: Engine) -> None:
        claimed = await Kind().run(engine)
        await engine.workflows.request_cancel(claimed.id)
        assert await record(engine, claimed, 0) == Fence(True, True)
        assert 0 in (await engine.journal.journal(claimed.id))[0]

    async def test_the_horizon_counts_the_children_started(self, engine: Engine) -> None:
        kind, child = Kind(), Kind()
        claimed = await kind.run(engine)
        await child.start(engine, f"{claimed.id}.7", parent=claimed.id)
        assert await engine.journal.journal(claimed.id) == ({}, 7)
        await child.start(engine, f"{claimed.id}.9.2", parent=claimed.id)  # a batch's third, from position 9
        await child.start(engine, f"{claimed.id}.x", parent=claimed.id)  # no position: not counted
        await child.start(engine, f"{claimed.id}.40")  # no parent: not its child
        assert await engine.journal.journal(claimed.id) == ({}, 9)
        await record(engine, claimed, 3)
        journal, horizon = await engine.journal.journal(claimed.id)
        assert list(journal) == [3] and horizon == 9


class TestStepStarts:
    """``start_steps`` notes, before a step runs, that the claim holding a workflow begins its
    ``step_attempt``-th try of the step at a position in this run, so that a try cut short by a crash
    still counts: the step's record counts every try noted for its position by every run (or the
    attempts the record says, when more). A note is idempotent (a position's note in a run keeps its
    highest count); notes go in batches over many workflows and are answered in the order given, each
    with its fence (``owner=False``, and nothing noted, under a token that lost the workflow;
    ``cancel=True`` when a cancellation was asked for)."""

    async def test_the_record_counts_the_tries_noted(self, engine: Engine) -> None:
        claimed = await Kind().run(engine)
        assert await engine.journal.start_steps([note(claimed, 0, 1)]) == [Fence(True, False)]
        assert await engine.journal.start_steps([note(claimed, 0, 2)]) == [Fence(True, False)]
        await record(engine, claimed, 0, attempts=1)
        assert await _attempts(engine, claimed.id, 0) == 2

    async def test_a_note_again_counts_once(self, engine: Engine) -> None:
        claimed = await Kind().run(engine)
        await engine.journal.start_steps([note(claimed, 0, 2), note(claimed, 0, 2)])
        await engine.journal.start_steps([note(claimed, 0, 2), note(claimed, 0, 1)])
        await record(engine, claimed, 0, attempts=1)
        assert await _attempts(engine, claimed.id, 0) == 2

    async def test_the_tries_of_every_run_count(self, engine: Engine) -> None:
        kind = Kind()
        first = await kind.run(engine)
        await engine.journal.start_steps([note(first, 0, 2)])
        await engine.claims.release(first.id, first.lease_token)  # the run is cut short in its second try
        second = await kind.claim_one(engine)
        await engine.journal.start_steps([note(second, 0, 1)])
        await record(engine, second, 0, attempts=1)
        assert await _attempts(engine, second.id, 0) == 3

    async def test_a_record_says_more_attempts_than_noted(self, engine: Engine) -> None:
        claimed = await Kind().run(engine)
        await engine.journal.start_steps([note(claimed, 0, 1)])
        await record(engine, claimed, 0, attempts=4)
        assert await _attempts(engine, claimed.id, 0) == 4

    async def test_notes_are_fenced_and_answered_in_order(self, engine: Engine) -> None:
        kind = Kind()
        held, cancelling = await kind.run(engine), await kind.run(engine)
        lost = await kind.run(engine)
        await engine.claims.release(lost.id, lost.lease_token)
        retaken = await kind.claim_one(engine)
        await engine.workflows.request_cancel(cancelling.id)
        answers = await engine.journal.start_steps([note(lost, 0, 5), note(held, 0, 1), note(cancelling, 0, 1)])
        assert answers == [Fence(False, False), Fence(True, False), Fence(True, True)]
        await record(engine, retaken, 0, attempts=1)
        assert await _attempts(engine, retaken.id, 0) == 1  # the lost token's note counted nothing

    async def test_the_tries_begun_are_read_back_until_recorded(self, engine: Engine) -> None:
        kind = Kind()
        first = await kind.run(engine)
        await engine.journal.start_steps([note(first, 0, 2), note(first, 3, 1)])
        await engine.claims.release(first.id, first.lease_token)
        second = await kind.claim_one(engine)
        assert await engine.details.tries_begun(second.id) == {0: 2, 3: 1}
        await engine.journal.start_steps([note(second, 0, 1)])
        assert await engine.details.tries_begun(second.id) == {0: 3, 3: 1}
        await record(engine, second, 0)
        assert await engine.details.tries_begun(second.id) == {3: 1}

    async def test_notes_of_one_position_count_for_it_alone(self, engine: Engine) -> None:
        claimed = await Kind().run(engine)
        await engine.journal.start_steps([note(claimed, 0, 3), note(claimed, 1, 1)])
        await record(engine, claimed, 1, attempts=1)
        await record(engine, claimed, 0, attempts=1)
        assert (await _attempts(engine, claimed.id, 0), await _attempts(engine, claimed.id, 1)) == (3, 1)


async def _attempts(engine: Engine, workflow_id: str, position: int) -> int:
    """A step's attempts, as its record counts them (as the details port reads them)."""
    read = await engine.details.details(workflow_id, 100)
    assert read is not None
    return next(s.attempts for s in read.steps if s.position == position)
