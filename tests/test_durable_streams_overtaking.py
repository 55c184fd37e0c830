"""An idempotent producer's appends that overtook each other on the way to the server
(``durable_streams/overtaking.py``): judged in their sequence order, not refused as gaps; a real gap is
still a 409 with the sequence number the server expects."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

import pgflow
from pgflow._core.engine.free_appends import Append, Producer
from pgflow.durable_streams import asgi_app
from pgflow.durable_streams import protocol as p
from pgflow.durable_streams.overtaking import AHEAD, in_sequence_order

from .test_durable_streams import JSON, Answer, call

pytestmark = pytest.mark.anyio


def by(producer: str, seq: int, path: str = "/s", epoch: int = 0) -> Append:
    return Append(path, "application/json", True, lambda _: [b"1"], False, None, Producer(producer, epoch, seq))


def plain(path: str = "/s") -> Append:
    return Append(path, "application/json", True, lambda _: [b"1"], False, None, None)


def test_a_batch_judges_each_producers_appends_in_sequence_order() -> None:
    appends = [by("a", 3), plain(), by("b", 7), by("a", 1), by("a", 2, path="/t"), by("a", 2), by("b", 6),
               by("a", 0, epoch=1)]
    order = in_sequence_order(appends)
    assert sorted(order) == list(range(len(appends)))  # a permutation
    judged = [appends[i] for i in order]
    # a's appends to /s (epoch 0) in the places they held, in sequence order; b's likewise; the others stay
    assert [(a.path, a.producer.id, a.producer.epoch, a.producer.seq) if a.producer else None for a in judged] == [
        ("/s", "a", 0, 1), None, ("/s", "b", 0, 6), ("/s", "a", 0, 2), ("/t", "a", 0, 2), ("/s", "a", 0, 3),
        ("/s", "b", 0, 7), ("/s", "a", 1, 0)]
    assert in_sequence_order([]) == [] and in_sequence_order([plain(), plain()]) == [0, 1]


def producing(seq: int) -> list[tuple[str, str]]:
    return [*JSON, ("producer-id", "w"), ("producer-epoch", "0"), ("producer-seq", str(seq))]


@pytest.mark.parametrize("elsewhere", [False, True], ids=["here", "elsewhere"])
async def test_an_append_that_overtook_its_predecessor_waits_for_it(app: pgflow.App, second_app: pgflow.App,
                                                                   elsewhere: bool) -> None:
    """Seq 1 comes first and is judged while seq 0 is still on its way: it waits (no 409), and once seq 0
    has committed, through this server or another one (another process: its ping wakes the wait), it is
    judged again and written after it."""
    asgi, other = asgi_app(app), asgi_app(second_app)
    asgi.free.overtaking.hold = 60.0  # (only the ping may end the wait before the test's own bound)
    assert (await call(asgi, "PUT", "/overtaken", JSON))[0] == 201
    answers: dict[int, Answer] = {}

    async def post(seq: int, server: Any) -> None:
        answers[seq] = await call(server, "POST", "/overtaken", producing(seq), json.dumps({"n": seq}).encode())

    waiters = app._internals().runtime().signals.waiters
    with anyio.fail_after(20):
        async with anyio.create_task_group() as group:
            group.start_soon(post, 1, asgi)
            while not len(waiters):  # seq 1 was judged a gap and waits on its stream's pings
                await anyio.sleep(0.005)
            await post(0, other if elsewhere else asgi)
    assert answers[0][0] == 200 and answers[1][0] == 200
    assert answers[1][1][p.PRODUCER_SEQ] == "1" and answers[1][1][p.NEXT_OFFSET] == p.offset_text(2)
    status, _, body = await call(asgi, "GET", "/overtaken", query="offset=-1")
    assert status == 200 and json.loads(body) == [{"n": 0}, {"n": 1}]


async def test_appends_sent_together_out_of_order_are_all_written_in_order(app: pgflow.App) -> None:
    """Five batches of one producer in flight at once, sent in reverse order: every one is a 200, and the
    stream holds them in their sequence order."""
    asgi = asgi_app(app)
    asgi.free.overtaking.hold = 60.0
    assert (await call(asgi, "PUT", "/reversed", JSON))[0] == 201
    answers: dict[int, Answer] = {}

    async def post(seq: int) -> None:
        answers[seq] = await call(asgi, "POST", "/reversed", producing(seq), json.dumps(seq).encode())

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            for seq in reversed(range(5)):
                group.start_soon(post, seq)
    assert {seq: answer[0] for seq, answer in answers.items()} == dict.fromkeys(range(5), 200)
    status, _, body = await call(asgi, "GET", "/reversed", query="offset=-1")
    assert status == 200 and json.loads(body) == [0, 1, 2, 3, 4]


async def test_a_gap_nothing_fills_is_still_a_409(app: pgflow.App) -> None:
    """Seq 2 after seq 0, with no seq 1 on its way: after its wait, the 409 says which one the server
    expects, and nothing of seq 2 was written. A gap far ahead, or one beyond the most held at once, is
    not held at all (each wake of a held append is a judging: a client must not make them cost)."""
    asgi = asgi_app(app)
    assert (await call(asgi, "PUT", "/gap", JSON))[0] == 201
    assert (await call(asgi, "POST", "/gap", producing(0), b"0"))[0] == 200
    status, head, _ = await call(asgi, "POST", "/gap", producing(2), b"2")
    assert status == 409 and head[p.EXPECTED_SEQ] == "1" and head[p.RECEIVED_SEQ] == "2"
    asgi.free.overtaking.hold = 3600.0
    with anyio.fail_after(20):
        status, head, _ = await call(asgi, "POST", "/gap", producing(1 + AHEAD + 1), b"0")
        assert status == 409 and head[p.EXPECTED_SEQ] == "1"
        asgi.free.overtaking.most = 0
        status, head, _ = await call(asgi, "POST", "/gap", producing(2), b"2")
        assert status == 409 and head[p.EXPECTED_SEQ] == "1"
    status, _, body = await call(asgi, "GET", "/gap", query="offset=-1")
    assert status == 200 and json.loads(body) == [0]
