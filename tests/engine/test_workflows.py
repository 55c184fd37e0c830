"""The workflows port: ``existing``, ``workflow``, ``request_cancel``, ``cancels_requested``."""

from __future__ import annotations

import pytest

from pgflow._core.engine import NO_PINGS, Engine, Fence
from pgflow._core.engine.workflows import Cancelled

from .kit import Kind, unique

pytestmark = pytest.mark.anyio


class TestWorkflows:
    """``existing`` says which ids name workflows; ``workflow`` reads one (None: no such id).
    ``request_cancel`` cancels a queued workflow at once (it ends cancelled, and no claim takes it),
    flags a running one (it runs on; its claim's fenced writes and ``cancels_requested`` tell it),
    leaves an ended one as it is, and does the same for every workflow its body started, their
    children and so on, that has not ended; it answers the workflow's status afterwards and the
    descendants it cancelled or flagged (None: no such workflow). ``cancels_requested`` names those of
    the ids asked that are running with a cancellation asked for."""

    async def test_existing_names_only_workflows_that_exist(self, engine: Engine) -> None:
        kind = Kind()
        one, two = await kind.start(engine), await kind.start(engine)
        assert await engine.workflows.existing([one, unique("none"), two]) == {one, two}
        assert await engine.workflows.existing([]) == set()
        assert await engine.workflows.workflow(unique("none")) is None

    async def test_a_queued_workflow_is_cancelled_at_once(self, engine: Engine) -> None:
        kind = Kind()
        id = await kind.start(engine)
        assert await engine.workflows.request_cancel(id) == Cancelled("cancelled", [])
        row = await engine.workflows.workflow(id)
        assert row is not None and (row.status, row.attempt) == ("cancelled", 0)
        assert await kind.claim(engine) == []
        assert await engine.workflows.cancels_requested([id]) == []

    async def test_a_running_workflow_is_flagged(self, engine: Engine) -> None:
        kind = Kind()
        claimed, other = await kind.run(engine), await kind.run(engine)
        assert await engine.workflows.cancels_requested([claimed.id, other.id]) == []
        assert await engine.workflows.request_cancel(claimed.id) == Cancelled("running", [])
        assert await engine.workflows.request_cancel(claimed.id) == Cancelled("running", [])  # again: the same
        row = await engine.workflows.workflow(claimed.id)
        assert row is not None and row.status == "running"
        assert await engine.workflows.cancels_requested([claimed.id, other.id]) == [claimed.id]
        fence = await engine.journal.record_step(claimed.id, claimed.attempt, claimed.lease_token, 0, "s", None,
                                                 None, 1)
        assert fence == Fence(True, True)
        assert await engine.ends.finish_many([claimed.id], [claimed.lease_token], ["cancelled"], [None], [None],
                                             NO_PINGS) == {(claimed.id, claimed.lease_token)}
        assert await engine.workflows.cancels_requested([claimed.id]) == []

    async def test_an_ended_workflow_is_left_as_it_is(self, engine: Engine) -> None:
        claimed = await Kind().run(engine)
        await engine.ends.finish_many([claimed.id], [claimed.lease_token], ["succeeded"], [b"out"], [None], NO_PINGS)
        assert await engine.workflows.request_cancel(claimed.id) == Cancelled("succeeded", [])
        row = await engine.workflows.workflow(claimed.id)
        assert row is not None and (row.status, row.output) == ("succeeded", b"out")

    async def test_no_workflow_nothing_to_cancel(self, engine: Engine) -> None:
        assert await engine.workflows.request_cancel(unique("none")) is None

    async def test_a_cancellation_reaches_every_descendant_not_ended(self, engine: Engine) -> None:
        kind = Kind()
        parent = await kind.run(engine)
        queued = await kind.start(engine, f"{parent.id}.0", parent=parent.id, delay=3600.0)
        running = await kind.run(engine, parent=parent.id)
        ended = await kind.run(engine, parent=parent.id)
        await engine.ends.finish_many([ended.id], [ended.lease_token], ["succeeded"], [None], [None], NO_PINGS)
        grandchild = await kind.start(engine, parent=running.id, delay=3600.0)
        unrelated = await kind.start(engine, delay=3600.0)
        cancelled = await engine.workflows.request_cancel(parent.id)
        assert cancelled is not None and cancelled.status == "running"
        assert sorted(cancelled.descendants) == sorted([queued, running.id, grandchild])
        statuses = {id: row.status for id in (queued, running.id, ended.id, grandchild, unrelated)
                    if (row := await engine.workflows.workflow(id))}
        assert statuses == {queued: "cancelled", running.id: "running", ended.id: "succeeded",
                            grandchild: "cancelled", unrelated: "queued"}
        assert sorted(await engine.workflows.cancels_requested(sorted([parent.id, running.id, ended.id]))) == \
            sorted([parent.id, running.id])
