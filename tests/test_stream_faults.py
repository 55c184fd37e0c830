"""Streams across real processes and real faults: pings between processes, a terminated listener, a
worker killed mid-stream, a server restart.

Writers are ``python -m pgflow worker tests.apps.streamy:app`` processes; readers are in the test
process, on Apps of their own. Workflows write deterministic sequences and hold before their last chunk
until the test creates a gate file, so a fault always lands while a stream is being written. Where a
test must prove that pings (not the poll) deliver, its reading App polls every 60 s and the test allows
25 s.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest

import pgflow
from pgflow._core import codec
from pgflow._core.signals import keys as signal_keys

from .apps import streamy
from .channel import listen, named, opened
from .helpers import query
from .processes import WAIT, Proc, Processes, wait_until_async
from .servers import EmbeddedServer

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

PING_WAIT = 25.0  # seconds within which only a ping (not a 60 s poll) can deliver
SLOW_POLL = 60.0
LEASE = 2.0


# -- processes ------------------------------------------------------------------------------------------


def streamy_worker(procs: Processes, env: dict[str, str], name: str, concurrency: int = 8) -> Proc:
    """A worker process serving tests/apps/streamy.py."""
    return procs.worker(name, "tests.apps.streamy:app", env, concurrency=concurrency, lease=LEASE)


# -- readers and the table ----------------------------------------------------------------------------------


class Reader:
    """An async reader of one stream, attached from the start; keeps what it read and any error.

    With ``resume``, a reader whose connection fails resumes from the offset it had reached, as a
    client reconnecting after an error would; ``errors`` keeps what it survived.
    """

    def __init__(self, handle: pgflow.WorkflowHandle[Any], key: str = streamy.SEQ, *,
                 resume: bool = False) -> None:
        self.handle = handle
        self.key = key
        self.resume = resume
        self.got: list[Any] = []
        self.errors: list[BaseException] = []
        self.done = False

    @property
    def error(self) -> BaseException | None:
        return self.errors[-1] if self.errors and not self.resume else None

    async def run(self) -> None:
        try:
            while True:
                try:
                    async for value in self.handle.stream_async(self.key, offset=len(self.got)):
                        self.got.append(value)
                    return
                except psycopg.OperationalError as exc:
                    self.errors.append(exc)
                    if not self.resume or len(self.errors) > 20:
                        raise
        except Exception as exc:  # noqa: BLE001 - the test reports it with the workers' logs
            if not self.errors or self.errors[-1] is not exc:
                self.errors.append(exc)
            self.resume = False
        finally:
            self.done = True


@contextlib.asynccontextmanager
async def running(readers: list[Reader]) -> AsyncIterator[None]:
    """The readers read, each in a task of its own, during the block; its end waits for them all."""
    async with anyio.create_task_group() as tg:
        for r in readers:
            tg.start_soon(r.run)
        yield


async def assert_dense_sequence(dsn: str, schema: str, workflow_id: str, n: int) -> None:
    """The stream holds 0..n-1 at positions 0..n-1, each once, then one close marker."""
    rows = await query(dsn, f'SELECT position, value FROM "{schema}".streams'
                            " WHERE workflow_id = %s AND key = %s ORDER BY position", workflow_id, streamy.SEQ)
    assert [p for p, _ in rows] == list(range(n + 1))
    assert [codec.decode(v) for _, v in rows[:-1]] == list(range(n))
    assert rows[-1][1] is None


# -- 7. many keys: pings beyond one NOTIFY payload and beyond the wake-all threshold ------------------------


async def test_pings_for_thousands_of_keys_reach_readers_in_another_process(
    app: pgflow.App, dsn: str, schema: str, procs: Processes, worker_env: dict[str, str], tmp_path: Path,
) -> None:
    wf = streamy.build(app)
    notes: list[psycopg.Notify] = []

    async def collect(conn: psycopg.AsyncConnection[Any]) -> None:
        async for note in conn.notifies():
            notes.append(note)

    def heard(note: psycopg.Notify) -> Any:
        news = opened(app, note)
        assert news is not None, "a payload of the worker's that does not open with the schema's keys"
        return news

    async def phase(name: str, keys: list[str], reading: pgflow.App, proc: Proc) -> tuple[str, list[psycopg.Notify]]:
        gate = tmp_path / f"gate-{name}"
        h = await wf.fan_out.start_async(keys, str(gate))
        readers = [Reader(reading.handle(h.id), key) for key in keys]
        async with running(readers):
            await wait_until_async(lambda: all(r.got or r.done for r in readers), f"{name}: chunk 0 of every key",
                             procs, proc)
            start = len(notes)
            gate.touch()
            # The readers wait for chunk 1 with a 60 s poll: only the pings can deliver it in time.
            await wait_until_async(lambda: all(r.done for r in readers), f"{name}: every reader to finish",
                             procs, proc, timeout=PING_WAIT)
        assert [r.error for r in readers if r.error] == []
        assert all(r.got == [0, 1] for r in readers)
        assert await reading.handle(h.id).result_async(timeout=WAIT) == len(keys)
        return h.id, notes[start:]

    listener = await listen(dsn, schema)
    reading = pgflow.App(dsn, schema=schema, poll_interval=SLOW_POLL)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(collect, listener)
            worker = streamy_worker(procs, worker_env, "worker")

            # 4400 keys at once: even split into two batches, more keys per batch than are named one
            # by one, so each batch pings "*".
            short = [f"k{i:04d}" for i in range(4400)]
            _, sent = await phase("short", short, reading, worker)
            assert any(named(heard(p)) == ["*"] for p in sent), [p.payload for p in sent[:5]]

            # 600 keys of 200 bytes (~120 kB of names; a stream is named on the channel by a digest of
            # its name), packed into payloads under the 8000-byte limit.
            long_ = [f"{i:04d}-" + "x" * 195 for i in range(600)]
            wid, sent = await phase("long", long_, reading, worker)
            packed = [named(heard(p)) for p in sent]  # (a stream's only chunk in a batch rides with its key)
            assert all(len(p.payload.encode()) < 8000 for p in sent)
            every = {key for keys in packed for key in keys}
            assert "*" not in every
            ours = {signal_keys.stream(wid, key) for key in long_}
            assert ours <= every
            # The news of one flush did not fit one payload: it went out in several.
            assert sum(1 for keys in packed if ours & set(keys)) >= 2
            tg.cancel_scope.cancel()
    finally:
        await reading.close_async()
        await listener.close()


# -- 9. the listener's connection terminated mid-stream -----------------------------------------------------


async def test_a_terminated_listener_reconnects_and_the_reader_gets_everything(
    app: pgflow.App, dsn: str, schema: str, procs: Processes, worker_env: dict[str, str], tmp_path: Path,
) -> None:
    wf = streamy.build(app)
    gate, n = tmp_path / "gate", 300
    reading = pgflow.App(dsn, schema=schema, poll_interval=SLOW_POLL)
    try:
        worker = streamy_worker(procs, worker_env, "worker")
        h = await wf.body_seq.start_async(n, str(gate), 0.005)
        reader = Reader(reading.handle(h.id))
        async with running([reader]):
            await wait_until_async(lambda: len(reader.got) >= 50 or reader.done, "50 chunks", procs, worker)
            await wait_until_async(lambda: reading.stats().listeners_connected == 1, "the listener to connect", procs)
            [victim] = reading.stats().listener_backends
            before = reading.stats().listener_reconnects
            assert await query(dsn, "SELECT pg_terminate_backend(%s)", victim) == [(True,)]
            await wait_until_async(lambda: reading.stats().listener_reconnects > before
                             and reading.stats().listeners_connected == 1, "the listener to reconnect", procs, worker)
            gate.touch()  # the last chunk and the close come after the reconnect, announced by pings only
            await wait_until_async(lambda: reader.done, "the reader to finish", procs, worker, timeout=PING_WAIT)
        assert reader.error is None, f"{reader.error!r}\n{procs.logs()}"
        assert reader.got == list(range(n))
        assert await h.result_async(timeout=WAIT) == n
        await assert_dense_sequence(dsn, schema, h.id, n)
    finally:
        await reading.close_async()


# -- 10. a writer killed mid-stream -------------------------------------------------------------------------


async def test_a_worker_killed_mid_stream_leaves_every_stream_dense_and_exactly_once(
    app: pgflow.App, dsn: str, schema: str, procs: Processes, worker_env: dict[str, str], tmp_path: Path,
) -> None:
    # Body writes are replayed (the committed ones skipped); the step resumes from stream_offset.
    wf = streamy.build(app)
    gate, n = tmp_path / "gate", 200
    a = streamy_worker(procs, worker_env, "worker-A", concurrency=16)
    kinds = [kind for kind in wf.seq for _ in range(2)]
    handles = [await wf.seq[kind].start_async(n, str(gate), 0.004) for kind in kinds]
    readers = [Reader(h) for h in handles]
    async with running(readers):
        await wait_until_async(lambda: all(len(r.got) >= n // 4 for r in readers), "a quarter of every stream",
                         procs, a)
        a.kill()  # SIGKILL: whatever batch was in flight is lost or committed, nothing in between
        at_kill = [len(r.got) for r in readers]
        assert all(count < n for count in at_kill)  # the gate holds every last chunk
        assert [await h.status_async() for h in handles] == ["running"] * len(handles)
        gate.touch()
        b = streamy_worker(procs, worker_env, "worker-B", concurrency=16)
        await wait_until_async(lambda: all(r.done for r in readers), "every reader to finish", procs, b)

    for kind, h, r, seen in zip(kinds, handles, readers, at_kill, strict=True):
        assert r.error is None, f"{kind}: {r.error!r}\n{procs.logs()}"
        assert r.got == list(range(n)), kind
        result = await h.result_async(timeout=WAIT)
        if "step" in kind:
            assert result >= seen > 0, kind  # the rerun step started where the killed one had got to
        else:
            assert result == n
        assert [v async for v in h.stream_async(streamy.SEQ)] == list(range(n))
        await assert_dense_sequence(dsn, schema, h.id, n)


# -- 11. the server restarted mid-stream --------------------------------------------------------------------


async def restart_mid_stream(app: pgflow.App, dsn: str, schema: str, embedded: EmbeddedServer,
                             procs: Processes, worker_env: dict[str, str], tmp_path: Path, *,
                             resume: bool) -> list[Reader]:
    """Four workflows (body and step writers, async and sync) in a worker process; readers in this
    process; the server restarted (pg_ctl restart -m fast) while all of them are mid-stream."""
    wf = streamy.build(app)
    gate, n = tmp_path / "gate", 300
    worker = streamy_worker(procs, worker_env, "worker")
    kinds = ["async", "sync", "async step", "sync step"]
    handles = [await wf.seq[kind].start_async(n, str(gate), 0.005) for kind in kinds]
    readers = [Reader(h, resume=resume) for h in handles]
    async with running(readers):
        await wait_until_async(lambda: all(len(r.got) >= 50 or r.done for r in readers), "50 chunks of each",
                         procs, worker)
        await anyio.to_thread.run_sync(embedded.restart)
        gate.touch()
        await wait_until_async(lambda: all(r.done for r in readers), "every reader to finish", procs, worker)

    # The worker recovered by itself: every workflow finished, every stream is dense and exactly once.
    async with pgflow.App(dsn, schema=schema) as fresh:
        for kind, h in zip(kinds, handles, strict=True):
            ended = await fresh.handle(h.id).result_async(timeout=WAIT)
            assert ended == n if "step" not in kind else ended >= 0, procs.logs()
            await assert_dense_sequence(dsn, schema, h.id, n)
            assert [v async for v in fresh.handle(h.id).stream_async(streamy.SEQ)] == list(range(n))
    return readers


async def test_a_server_restart_mid_stream_is_survived_by_the_writer_and_a_resuming_reader(
    app: pgflow.App, dsn: str, schema: str, restartable: EmbeddedServer, procs: Processes,
    worker_env: dict[str, str], tmp_path: Path,
) -> None:
    readers = await restart_mid_stream(app, dsn, schema, restartable, procs, worker_env, tmp_path, resume=True)
    for r in readers:
        assert r.error is None, f"{r.errors!r}\n{procs.logs()}"
        assert r.got == list(range(300))


async def test_a_server_restart_mid_stream_does_not_break_an_attached_reader(
    app: pgflow.App, dsn: str, schema: str, restartable: EmbeddedServer, procs: Processes,
    worker_env: dict[str, str], tmp_path: Path,
) -> None:
    readers = await restart_mid_stream(app, dsn, schema, restartable, procs, worker_env, tmp_path, resume=False)
    for r in readers:
        assert r.errors == []
        assert r.got == list(range(300))
