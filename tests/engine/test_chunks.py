"""The chunks port: ``stream_ids``, ``write_chunks``, ``read_streams``, ``stream_ends``."""

from __future__ import annotations

import pytest

from pgflow._core.engine import NO_PINGS, Claimed, Engine, Pings
from pgflow._core.engine.chunks import Written

from .conftest import EngineFactory
from .kit import Kind, unique

pytestmark = pytest.mark.anyio

BIG = 1 << 20  # a read's byte budget and first-chunk bound that no test reaches


async def stream(engine: Engine, claimed: Claimed, key: str = "s") -> int:
    return (await engine.chunks.stream_ids([claimed.id], [key]))[(claimed.id, key)]


async def write(engine: Engine, claimed: Claimed, sid: int, start: int, values: list[bytes | None],
                pings: Pings = NO_PINGS, again: bool = False) -> Written:
    """``values`` written at ``start`` on, by ``claimed``'s run alone."""
    return await engine.chunks.write_chunks([(claimed.id, claimed.lease_token)], [1] * len(values),
                                            [sid] * len(values), list(range(start, start + len(values))), values,
                                            pings, again=again)


async def read(engine: Engine, sid: int, offset: int = 0, limit: int = 100, budget: int = BIG,
               whole: int = BIG) -> list[tuple[int, bytes | None]]:
    found, _, _, _ = await engine.chunks.read_streams([sid], [""], [""], [offset], limit, budget, whole)
    return found[0]


class TestStreamIds:
    """``stream_ids`` names a workflow's streams: a (workflow, key) gets one id, the same every time it
    is asked, by any engine on the store; different keys, or the same key of another workflow, get
    different ids."""

    async def test_a_stream_is_named_once(self, engine: Engine, peer: Engine) -> None:
        one, two = unique("w"), unique("w")
        first = await engine.chunks.stream_ids([one, one, two], ["a", "b", "a"])
        assert set(first) == {(one, "a"), (one, "b"), (two, "a")}
        assert len(set(first.values())) == 3
        again = await peer.chunks.stream_ids([two, one], ["a", "a"])
        assert again == {(two, "a"): first[(two, "a")], (one, "a"): first[(one, "a")]}


class TestChunks:
    """A stream's chunks are written in batches by the runs that hold their workflows and read back in
    position order from any cursor: a read gives up to ``limit`` chunks and ``budget`` bytes from its
    offset (a first chunk up to ``whole`` bytes however small the budget), says which streams it cut
    short by the budget, learns the ids of streams asked by (workflow, key), and, for a stream it
    found nothing in, gives the workflow's status (None: no such workflow) and whether the stream is
    closed (its last chunk is None). ``stream_ends`` gives each stream's next free position.

    A batch is fenced: a chunk is written only if its run's claim token still holds its workflow;
    the runs fenced out are named and their chunks dropped, the others' written; the runs whose
    cancellation was asked are named too. A batch under a worker fence (``fence``) that still holds
    is written at once; one whose worker fence moved on is decided by the rows. ``again`` (a batch
    sent again after a lost connection) skips the chunks already written. The batch's pings ride on
    its commit, only when every run of it held."""

    async def test_chunks_read_back_in_order_from_a_cursor(self, engine: Engine) -> None:
        claimed = await Kind().run(engine)
        sid = await stream(engine, claimed)
        assert await write(engine, claimed, sid, 0, [b"a", b"b"]) == Written(set(), set(), True)
        assert await write(engine, claimed, sid, 2, [b"c", b"", b"e"]) == Written(set(), set(), True)
        assert await read(engine, sid) == [(0, b"a"), (1, b"b"), (2, b"c"), (3, b""), (4, b"e")]
        assert await read(engine, sid, offset=3) == [(3, b""), (4, b"e")]
        assert await read(engine, sid, offset=5) == []
        assert await read(engine, sid, offset=1, limit=2) == [(1, b"b"), (2, b"c")]

    async def test_a_batch_of_many_runs_and_streams(self, engine: Engine) -> None:
        kind = Kind()
        one, two = await kind.run(engine), await kind.run(engine)
        ids = await engine.chunks.stream_ids([one.id, one.id, two.id], ["x", "y", "x"])
        owners = sorted([(one.id, one.lease_token), (two.id, two.lease_token)])
        index = {owner[0]: n + 1 for n, owner in enumerate(owners)}
        sids = [ids[(one.id, "x")], ids[(two.id, "x")], ids[(one.id, "y")], ids[(one.id, "x")]]
        written = await engine.chunks.write_chunks(owners, [index[one.id], index[two.id], index[one.id], index[one.id]],
                                                   sids, [0, 0, 0, 1], [b"1x0", b"2x0", b"1y0", b"1x1"], NO_PINGS)
        assert written == Written(set(), set(), True)
        found, _, _, _ = await engine.chunks.read_streams(
            [ids[(one.id, "x")], ids[(one.id, "y")], ids[(two.id, "x")]], ["", "", ""], ["", "", ""], [0, 0, 0],
            100, BIG, BIG)
        assert found == [[(0, b"1x0"), (1, b"1x1")], [(0, b"1y0")], [(0, b"2x0")]]
        assert await engine.chunks.stream_ends(one.id) == {"x": 2, "y": 1}

    async def test_stream_ends_are_the_next_free_positions(self, engine: Engine) -> None:
        claimed = await Kind().run(engine)
        assert await engine.chunks.stream_ends(claimed.id) == {}
        ids = await engine.chunks.stream_ids([claimed.id] * 3, ["a", "b", "empty"])
        await write(engine, claimed, ids[(claimed.id, "a")], 0, [b"1", b"2", None])
        await write(engine, claimed, ids[(claimed.id, "b")], 0, [b"1"])
        assert await engine.chunks.stream_ends(claimed.id) == {"a": 3, "b": 1}

    async def test_a_read_keeps_to_its_byte_budget(self, engine: Engine) -> None:
        claimed = await Kind().run(engine)
        sid = await stream(engine, claimed)
        await write(engine, claimed, sid, 0, [b"1" * 10, b"2" * 10, b"3" * 10])
        found, cut, _, _ = await engine.chunks.read_streams([sid], [""], [""], [0], 100, 25, BIG)
        assert found == [[(0, b"1" * 10), (1, b"2" * 10)]] and cut == {0}
        # a first chunk bigger than the budget comes whole when it is within ``whole``
        found, cut, _, _ = await engine.chunks.read_streams([sid], [""], [""], [1], 100, 5, 10)
        assert found == [[(1, b"2" * 10)]] and cut == {0}
        # and not at all, but cut short, when it is bigger than that too
        found, cut, _, _ = await engine.chunks.read_streams([sid], [""], [""], [1], 100, 5, 9)
        assert found == [[]] and cut == {0}
        found, cut, _, _ = await engine.chunks.read_streams([sid], [""], [""], [0], 100, 30, BIG)
        assert len(found[0]) == 3 and cut == set()

    async def test_a_read_by_name_learns_the_streams_id(self, engine: Engine) -> None:
        claimed = await Kind().run(engine)
        sid = await stream(engine, claimed, "named")
        await write(engine, claimed, sid, 0, [b"v"])
        found, _, learnt, states = await engine.chunks.read_streams(
            [None, None], [claimed.id, claimed.id], ["named", "unnamed"], [0, 0], 100, BIG, BIG)
        assert found == [[(0, b"v")], []]
        assert learnt == {0: sid}
        assert states == {1: ("running", False)}

    async def test_a_read_that_finds_nothing_says_the_workflows_status_and_whether_closed(
            self, engine: Engine) -> None:
        kind = Kind()
        closed, ended = await kind.run(engine), await kind.run(engine)
        one, two = await stream(engine, closed), await stream(engine, ended)
        await write(engine, closed, one, 0, [b"last", None])
        await write(engine, ended, two, 0, [b"only"])
        await engine.ends.finish_many([ended.id], [ended.lease_token], ["succeeded"], [None], [None], NO_PINGS)
        found, _, learnt, states = await engine.chunks.read_streams(
            [None, None, None], [closed.id, ended.id, unique("none")], ["s", "s", "s"], [1, 1, 0], 100, BIG, BIG)
        assert found == [[(1, None)], [], []]
        assert learnt == {0: one, 1: two}
        assert states == {1: ("succeeded", False), 2: (None, False)}
        found, _, _, states = await engine.chunks.read_streams([one], [""], [""], [2], 100, BIG, BIG)
        assert found == [[]] and states == {0: ("running", True)}

    async def test_a_write_under_a_lost_token_is_refused(self, engine: Engine) -> None:
        kind = Kind()
        first = await kind.run(engine)
        sid = await stream(engine, first)
        await write(engine, first, sid, 0, [b"a"])
        await engine.claims.release(first.id, first.lease_token)
        second = await kind.claim_one(engine)
        late = await write(engine, first, sid, 1, [b"late"])
        assert late == Written({(first.id, first.lease_token)}, set(), True)
        assert await read(engine, sid) == [(0, b"a")]
        assert await write(engine, second, sid, 1, [b"b"]) == Written(set(), set(), True)
        assert await read(engine, sid) == [(0, b"a"), (1, b"b")]

    async def test_a_batch_drops_only_the_runs_fenced_out_and_names_cancellations(self, engine: Engine) -> None:
        kind = Kind()
        lost, held, cancelling = await kind.run(engine), await kind.run(engine), await kind.run(engine)
        await engine.claims.release(lost.id, lost.lease_token)
        await kind.claim_one(engine)
        await engine.workflows.request_cancel(cancelling.id)
        ids = await engine.chunks.stream_ids([lost.id, held.id, cancelling.id], ["s", "s", "s"])
        runs = sorted([lost, held, cancelling], key=lambda c: c.id)
        written = await engine.chunks.write_chunks(
            [(c.id, c.lease_token) for c in runs], [1, 2, 3], [ids[(c.id, "s")] for c in runs], [0, 0, 0],
            [b"0", b"1", b"2"], NO_PINGS)
        assert written == Written({(lost.id, lost.lease_token)}, {cancelling.id}, True)
        assert await read(engine, ids[(lost.id, "s")]) == []
        assert await read(engine, ids[(held.id, "s")]) != []
        assert await read(engine, ids[(cancelling.id, "s")]) != []

    async def test_a_batch_under_a_worker_fence(self, engine: Engine) -> None:
        kind, worker = Kind(), unique("w")
        await engine.workers.register_worker(worker, "host", 1, [kind.queue], "test", [kind.name], 30.0)
        claimed = await kind.run(engine, worker)
        assert claimed.fence is not None and claimed.fence[0] == worker
        sid = await stream(engine, claimed)
        owners = [(claimed.id, claimed.lease_token)]
        held = await engine.chunks.write_chunks(owners, [1], [sid], [0], [b"a"], NO_PINGS, fence=claimed.fence)
        assert held == Written(set(), set(), True)
        # a fence that does not hold (another epoch) leaves the rows to decide: this one still holds
        moved = (worker, claimed.fence[1] + 1)
        assert await engine.chunks.write_chunks(owners, [1], [sid], [1], [b"b"], NO_PINGS, fence=moved) == \
            Written(set(), set(), False)
        assert await read(engine, sid) == [(0, b"a"), (1, b"b")]

    async def test_a_batch_sent_again_skips_what_was_written(self, engine: Engine) -> None:
        claimed = await Kind().run(engine)
        sid = await stream(engine, claimed)
        await write(engine, claimed, sid, 0, [b"a", b"b"])
        assert await write(engine, claimed, sid, 0, [b"a", b"b", b"c"], again=True) == Written(set(), set(), True)
        assert await read(engine, sid) == [(0, b"a"), (1, b"b"), (2, b"c")]

    async def test_pings_ride_only_on_a_batch_whose_runs_all_held(
            self, engine: Engine, factory: EngineFactory) -> None:
        kind, channel = Kind(), unique("ch")
        held, lost = await kind.run(engine), await kind.run(engine)
        await engine.claims.release(lost.id, lost.lease_token)
        ids = await engine.chunks.stream_ids([held.id, lost.id], ["s", "s"])
        async with factory.listening([channel]) as heard:
            runs = sorted([held, lost], key=lambda c: c.id)
            await engine.chunks.write_chunks([(c.id, c.lease_token) for c in runs], [1, 2],
                                             [ids[(c.id, "s")] for c in runs], [0, 0], [b"x", b"y"],
                                             Pings([channel], ["mixed"]))
            await write(engine, held, ids[(held.id, "s")], 1, [b"z"], Pings([channel], ["held"]))
            assert [p for _, p in await heard.until("held")] == ["held"]
