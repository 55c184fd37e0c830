"""The ends port: ``finish_many``."""

from __future__ import annotations

from typing import Any

import pytest

from pgflow._core.engine import NO_PINGS, Claimed, Engine, Pings

from .conftest import EngineFactory
from .kit import Kind, unique

pytestmark = pytest.mark.anyio


async def finish(engine: Engine, runs: list[Claimed], status: str = "succeeded", output: bytes | None = b"out",
                 error: dict[str, Any] | None = None, pings: Pings = NO_PINGS) -> set[tuple[str, int]]:
    return await engine.ends.finish_many([c.id for c in runs], [c.lease_token for c in runs], [status] * len(runs),
                                         [output] * len(runs), [error] * len(runs), pings)


class TestEnds:
    """``finish_many`` records the ends of many runs at once (status, output, error), each only while
    its claim token still holds its workflow running, and answers the (id, token) of those recorded;
    the others are left as they are. An ended workflow holds no lease and is claimed by nobody. An end
    sent again after it was recorded records nothing (and so is not answered). The batch's pings ride
    on its commit only when every end of it was recorded. One end alone and a batch keep the same
    rules."""

    @pytest.mark.parametrize("status", ["succeeded", "failed", "cancelled"])
    async def test_an_end_is_recorded_for_the_run_that_holds_it(self, engine: Engine, status: str) -> None:
        kind = Kind()
        claimed = await kind.run(engine)
        error = None if status == "succeeded" else {"type": "E", "message": "m"}
        output = b"out" if status == "succeeded" else None
        assert await finish(engine, [claimed], status, output, error) == {(claimed.id, claimed.lease_token)}
        row = await engine.workflows.workflow(claimed.id)
        assert row is not None and (row.status, row.output, row.error, row.attempt) == (status, output, error, 1)
        assert await kind.claim(engine) == []

    async def test_ends_only_runs_still_held(self, engine: Engine) -> None:
        kind = Kind()
        lost = await kind.run(engine)
        await engine.claims.release(lost.id, lost.lease_token)
        assert await finish(engine, [lost]) == set()  # released: no longer running under its token
        retaken = await kind.claim_one(engine)
        assert await finish(engine, [lost]) == set()
        row = await engine.workflows.workflow(lost.id)
        assert row is not None and (row.status, row.output) == ("running", None)
        assert await finish(engine, [retaken]) == {(retaken.id, retaken.lease_token)}

    async def test_a_batch_records_the_ends_held_and_only_those(self, engine: Engine) -> None:
        kind = Kind()
        runs = [await kind.run(engine) for _ in range(3)]
        lost = runs[1]
        await engine.claims.release(lost.id, lost.lease_token)
        await kind.claim_one(engine)
        assert await finish(engine, runs, output=b"done") == {(c.id, c.lease_token) for c in runs if c is not lost}
        rows = {c.id: await engine.workflows.workflow(c.id) for c in runs}
        assert {id: (row.status, row.output) for id, row in rows.items() if row} == {
            runs[0].id: ("succeeded", b"done"), lost.id: ("running", None), runs[2].id: ("succeeded", b"done")}

    async def test_an_end_sent_again_records_nothing(self, engine: Engine) -> None:
        kind = Kind()
        one, two = await kind.run(engine), await kind.run(engine)
        assert len(await finish(engine, [one, two], output=b"first")) == 2
        assert await finish(engine, [one, two], output=b"second") == set()
        assert await finish(engine, [one], output=b"second") == set()
        row = await engine.workflows.workflow(one.id)
        assert row is not None and row.output == b"first"

    async def test_an_ended_workflows_lease_is_not_renewed(self, engine: Engine) -> None:
        kind, worker = Kind(), unique("w")
        claimed = await kind.run(engine, worker)
        await finish(engine, [claimed])
        assert await engine.workers.heartbeat(worker, 30.0, "host", 1, [kind.queue], "test", [kind.name],
                                              [claimed.id], 5.0) == []

    async def test_pings_ride_only_on_a_batch_wholly_recorded(self, engine: Engine, factory: EngineFactory) -> None:
        kind, channel = Kind(), unique("ch")
        held, lost, alone, gone = [await kind.run(engine) for _ in range(4)]
        for run in (lost, gone):
            await engine.claims.release(run.id, run.lease_token)
        async with factory.listening([channel]) as heard:
            await finish(engine, [held, lost], pings=Pings([channel], ["mixed"]))
            await finish(engine, [gone], pings=Pings([channel], ["gone"]))
            await finish(engine, [alone], pings=Pings([channel, channel], ["alone", "again"]))
            assert [p for _, p in await heard.until("again")] == ["alone", "again"]
