"""The debounces port: ``enqueue_debounced``, ``prune_debounces``."""

from __future__ import annotations

import pytest

from pgflow._core.engine import NO_PINGS, Engine
from pgflow._core.engine.debounces import Debounce, Debounced

from .kit import LEASE, Kind, unique

pytestmark = pytest.mark.anyio


async def debounced(engine: Engine, kind: Kind, key: str, inputs: bytes = b"in", window: float = 600.0,
                    most: float = 3600.0) -> Debounced:
    return await engine.debounces.enqueue_debounced(unique("d"), inputs, kind.new(), Debounce(key, window, most),
                                                    NO_PINGS)


async def inputs_of(engine: Engine, id: str) -> bytes:
    read = await engine.details.details(id, 1)
    assert read is not None
    return bytes(read.workflow.inputs)


class TestDebounces:
    """Debounced starts of one workflow name and key collapse into one pending run (queued, never
    claimed): the first start creates it under its id, due ``window`` seconds from now; each start
    within it joins the run (its id and birth, ``created=False``), gives it its arguments and moves its
    due time later, to ``window`` from now, but never past ``most`` seconds after the burst's first
    start. Other keys, and other names with the same key, are other runs. Once the run is claimed a new
    start begins a new run. ``prune_debounces`` forgets keys whose run is no longer pending (and says
    how many); a pending key is kept."""

    async def test_starts_within_the_window_join_one_run(self, engine: Engine) -> None:
        kind = Kind()
        first = await debounced(engine, kind, "k", b"one")
        assert first.created
        joined = await debounced(engine, kind, "k", b"two")
        assert joined == Debounced(first.id, False, first.born)
        assert await inputs_of(engine, first.id) == b"two"
        claimed, due = await engine.claims.claim("o", [kind.queue], [kind.name], 10, LEASE)
        assert claimed == [] and due is not None and 590.0 < due <= 600.0

    async def test_other_keys_and_names_are_other_runs(self, engine: Engine) -> None:
        kind = Kind()
        one = await debounced(engine, kind, "a")
        other_key = await debounced(engine, kind, "b")
        other_name = await debounced(engine, Kind(queue=kind.queue), "a")
        assert one.created and other_key.created and other_name.created
        assert len({one.id, other_key.id, other_name.id}) == 3

    async def test_a_run_is_due_at_most_most_seconds_after_the_first_start(self, engine: Engine) -> None:
        kind = Kind()
        first = await debounced(engine, kind, "k", window=0.05, most=0.3)
        await debounced(engine, kind, "k", window=3600.0, most=0.3)
        [claimed] = await kind.claim_within(engine, timeout=5.0)
        assert claimed.id == first.id

    async def test_a_claimed_run_is_not_joined(self, engine: Engine) -> None:
        kind = Kind()
        first = await debounced(engine, kind, "k", b"one", window=0.0)
        [claimed] = await kind.claim_within(engine)
        assert claimed.id == first.id and claimed.inputs == b"one"
        second = await debounced(engine, kind, "k", b"two")
        assert second.created and second.id != first.id
        assert await inputs_of(engine, first.id) == b"one"

    async def test_prune_forgets_only_keys_no_longer_pending(self, engine: Engine) -> None:
        kind = Kind()
        done = await debounced(engine, kind, "done", window=0.0)
        await kind.claim_within(engine)
        pending = await debounced(engine, kind, "pending")
        assert await engine.debounces.prune_debounces(1000) >= 1
        assert await engine.debounces.prune_debounces(1000) == 0
        assert (await debounced(engine, kind, "pending")).id == pending.id
        again = await debounced(engine, kind, "done")
        assert again.created and again.id != done.id
