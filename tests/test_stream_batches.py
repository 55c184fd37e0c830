"""How the stream writer cuts its queue into batches (``_core/streams/writer.py``), without a server:
writers in step (each awaiting its chunk's commit) are cut into two cohorts when the server is on
another machine, so one cohort's next chunks are written while the other's statement runs, and go
whole when it is on this one; a stream never has chunks in two batches at once; a run that is over
sends nothing more and learns when its batches in flight are done. Whether the server is here:
``connecting.on_this_machine``."""

from __future__ import annotations

import asyncio

import pytest

from pgflow._core.connecting import on_this_machine
from pgflow._core.run_state import RunOver, RunState
from pgflow._core.streams.writer import COHORT_AT_LEAST, Stream, StreamWriter, _Pending

pytestmark = pytest.mark.anyio


class RunOwner:
    """What the stream writer reads and keeps of a run (``RunStreams``' part of it), without a run:
    the writer's tests drive it with these."""

    def __init__(self, n: int) -> None:
        self.workflow_id = f"w{n}"
        self.lease_token = n
        self.state = RunState(self.workflow_id, 1)
        self.named_streams: dict[str, Stream] = {}
        self.fence = None
        self.chunks_in_flight = 0
        self.settled = None
        self.fence_cut = None


def _queued(writer: StreamWriter, streams: list[Stream], owners: list[RunOwner]) -> None:
    loop = asyncio.get_running_loop()
    for stream, owner in zip(streams, owners, strict=True):
        writer._queue.append(_Pending(owner, "k", 0, b"v", stream, loop.create_future()))


def _writer(*, cohorts: bool) -> StreamWriter:
    return StreamWriter(None, None, cohorts=cohorts)  # type: ignore[arg-type] # (the queue alone: nothing is sent)


async def test_writers_in_step_go_as_two_cohorts_and_a_stream_waits_for_its_own() -> None:
    writer = _writer(cohorts=True)
    writers = 4 * COHORT_AT_LEAST
    owners = [RunOwner(n) for n in range(writers)]
    streams = [Stream(f"s{n}") for n in range(writers)]
    _queued(writer, streams, owners)
    first = writer._take_batch()
    writer._in_flight = 1
    second = writer._take_batch()
    assert (len(first), len(second), len(writer._queue)) == (writers // 2, writers // 2, 0)
    # A second chunk of a stream in flight waits for its batch; a batch in flight means no halving.
    _queued(writer, streams[:3] + [Stream("new")], owners[:4])
    writer._in_flight = 1
    assert [p.stream.ping for p in writer._take_batch()] == ["new"]
    writer._sent(first)
    assert len(writer._take_batch()) == 3


async def test_writers_in_step_go_as_one_batch_to_a_server_on_this_machine() -> None:
    writer = _writer(cohorts=False)
    writers = 4 * COHORT_AT_LEAST
    _queued(writer, [Stream(f"s{n}") for n in range(writers)], [RunOwner(n) for n in range(writers)])
    assert (len(writer._take_batch()), len(writer._queue)) == (writers, 0)


async def test_a_short_queue_goes_whole() -> None:
    writer = _writer(cohorts=True)
    few = 2 * COHORT_AT_LEAST - 1
    _queued(writer, [Stream(f"s{n}") for n in range(few)], [RunOwner(n) for n in range(few)])
    assert len(writer._take_batch()) == few


async def test_a_settled_run_sends_nothing_more_and_waits_for_its_batch_in_flight() -> None:
    writer = _writer(cohorts=True)
    owner, other = RunOwner(1), RunOwner(2)
    _queued(writer, [Stream("a"), Stream("b")], [owner, other])
    batch = writer._take_batch()
    assert writer.settle(RunOwner(3)) is None  # nothing in flight: nothing to wait for
    settled = writer.settle(owner)
    assert settled is not None and not settled.done()
    assert isinstance(owner.state.reason, RunOver)
    _queued(writer, [Stream("late")], [owner])
    [late] = writer._queue
    assert writer._take_batch() == []  # a chunk put after the settle is not sent, and fails
    assert isinstance(late.done.exception(), RunOver)
    writer._sent(batch)
    assert settled.done() and owner.chunks_in_flight == 0


@pytest.mark.parametrize(("host", "hostaddr", "server_addr", "here"), [
    ("/var/run/postgresql", "", None, True),  # a unix-domain socket's directory
    ("@pgflow", "", None, True),  # Linux's abstract namespace
    ("", "", None, True),  # libpq's default: the socket
    ("localhost", "127.0.0.1", "127.0.0.1", True),
    ("localhost", "::1", "::1", True),
    ("127.0.0.2", "127.0.0.2", "127.0.0.2", True),
    ("localhost", "::ffff:127.0.0.1", "::ffff:127.0.0.1", True),
    ("localhost", "127.0.0.1", None, True),  # a pooler here, the server behind it through its socket
    ("localhost", "127.0.0.1", "10.1.2.3", False),  # a pooler here, the server on another machine
    ("db.example.com", "10.1.2.3", "10.1.2.3", False),
    ("10.1.2.3", "", "10.1.2.3", False),
    ("2001:db8::1", "2001:db8::1", "2001:db8::1", False),
    ("db.example.com", "", "10.1.2.3", False),  # no address known: not assumed to be here
    ("pooler.example.com", "10.1.2.4", "127.0.0.1", False),  # a pooler elsewhere, its server beside it
])
def test_which_servers_are_on_this_machine(host: str, hostaddr: str, server_addr: str | None, here: bool) -> None:
    assert on_this_machine(host, hostaddr, server_addr) is here
