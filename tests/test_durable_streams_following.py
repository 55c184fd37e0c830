"""A live SSE reader follows its stream (``durable_streams/following.py``): the appends this process
commits are handed to it by their writer, with no read of the table, when they alone woke it and
follow on from where it is; anything else (another process's append, a poll tick, a gap) and it reads
the table. Either way it gets every message once, in order."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

import pgflow
from pgflow._core.engine.free_appends import Appended
from pgflow._core.engine.free_streams import Chunk, FreeStream
from pgflow.durable_streams import asgi_app
from pgflow.durable_streams.following import Follower

from .test_durable_streams import JSON, call

pytestmark = pytest.mark.anyio


def messages(sse: bytes) -> list[Any]:
    """The JSON messages of an SSE answer's data events, in order."""
    found: list[Any] = []
    for event in sse.decode().split("\n\n"):
        lines = event.split("\n")
        if lines[0] == "event: data":
            found += json.loads("\n".join(line.removeprefix("data:") for line in lines[1:]))
    return found


async def follow(asgi: Any, path: str, answers: dict[str, bytes]) -> None:
    _, _, answers[path] = await call(asgi, "GET", path, query="offset=-1&live=sse")


async def test_appends_of_this_process_reach_a_live_reader_with_no_read(dsn: str, schema: str) -> None:
    with pgflow.App(dsn, schema=schema, poll_interval=60) as app:  # (no poll tick within the test)
        asgi = asgi_app(app)
        assert (await call(asgi, "PUT", "/live", JSON, b"[0]"))[0] == 201
        reads = asgi.free.reads
        answers: dict[str, bytes] = {}
        async with anyio.create_task_group() as group:
            group.start_soon(follow, asgi, "/live", answers)
            listener = app._internals().runtime().signals.listener
            assert listener is not None
            with anyio.fail_after(10):
                while "/live" not in asgi.free.followers or not listener.connected:
                    await anyio.sleep(0.01)
            before = reads.batches
            for n in range(1, 21):
                assert (await call(asgi, "POST", "/live", JSON, json.dumps([n, n + 100]).encode()))[0] == 204
            assert (await call(asgi, "POST", "/live", [("stream-closed", "true")]))[0] == 204
        # Every append handed over, none read (one read may be the look a listener's first connection wakes
        # every waiter for, pings may have gone unheard; a reader that reads on each ping reads 20 times).
        assert reads.batches - before <= 1
        assert messages(answers["/live"]) == [0, *[m for n in range(1, 21) for m in (n, n + 100)]]


async def test_another_process_appends_interleaved_with_ours_are_read(dsn: str, schema: str) -> None:
    """The other process's appends wake the reader by the pings that rode on their commit (no poll
    tick comes within the test, and the writer's notifier sends nothing of its own)."""
    with pgflow.App(dsn, schema=schema, poll_interval=60) as app, \
            pgflow.App(dsn, schema=schema, poll_interval=60) as second_app:
        asgi, elsewhere = asgi_app(app), asgi_app(second_app)
        assert (await call(asgi, "PUT", "/mixed", JSON))[0] == 201
        assert (await call(elsewhere, "HEAD", "/mixed"))[0] == 200  # (its store is open)
        notifier = second_app._internals().runtime().signals.notifier
        assert notifier is not None
        flushes = notifier.flushes
        answers: dict[str, bytes] = {}
        with anyio.fail_after(30):
            async with anyio.create_task_group() as group:
                group.start_soon(follow, asgi, "/mixed", answers)
                while "/mixed" not in asgi.free.followers:
                    await anyio.sleep(0.01)
                for n in range(30):  # here, there, here, ...: our hands do not follow on from what it read
                    writer = asgi if n % 3 else elsewhere
                    assert (await call(writer, "POST", "/mixed", JSON, str(n).encode()))[0] == 204
                assert (await call(elsewhere, "POST", "/mixed", [("stream-closed", "true")]))[0] == 204
        assert messages(answers["/mixed"]) == list(range(30))
        assert notifier.flushes == flushes


def stream_at(tail: int, ttl: int | None = None) -> FreeStream:
    return FreeStream(1, "/s", "application/json", tail, False, None, ttl, None, None, None, None, None, None, False)


async def test_what_a_follower_takes_from_its_hands() -> None:
    from pgflow._core.signals import PollTicks

    follower = Follower(PollTicks())

    def publish(*dones: Appended) -> None:  # as FreeStreamsAccess.publish: the hands, then their ping
        follower.handed(list(dones))
        follower.wake()
        follower.told()

    assert follower.take(0, 100, 1000) is None  # its first look reads the table (pings before it began are lost)
    ok = lambda tail, *units: Appended("ok", stream_at(tail), units=units)  # noqa: E731
    publish(ok(2, b"1", b"2"), ok(3, b"3"))
    publish(ok(4, b"4"))
    assert await follower.wait(1)
    assert follower.take(0, 100, 1000) == (stream_at(4), [Chunk(0, 1, 2, b"1"), Chunk(1, 2, 2, b"2"),
                                                          Chunk(2, 3, 3, b"3"), Chunk(3, 4, 4, b"4")])
    assert not await follower.wait(0.01)  # re-armed: nothing since
    publish(ok(6, b"6"))  # position 5 came from elsewhere: not in hand
    assert follower.take(4, 100, 1000) is None
    publish(ok(7, b"7"))
    follower.wake()  # a ping of another process's append too
    assert follower.take(6, 100, 1000) is None
    follower.wake()  # (the other way round)
    publish(ok(8, b"8"))
    assert follower.take(7, 100, 1000) is None
    publish(ok(9, b"9"))
    assert follower.take(9, 100, 1000) == (stream_at(9), [])  # already read: nothing new, no read needed
    publish(ok(11, b"10", b"11"))
    assert follower.take(9, 1, 1000) is None  # more than one answer holds: read in pages
    publish(Appended("ok", stream_at(12, ttl=60), units=(b"12",)))
    assert follower.take(11, 100, 1000) is None  # a read moves a sliding TTL on: read
