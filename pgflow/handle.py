"""A handle on a workflow by id, usable from any process that can reach the database."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Iterator
from typing import Any, Generic, TypeVar

from ._core.checks import (
    check_event_key,
    check_idempotency_key,
    check_position,
    check_reader,
    check_topic,
    check_wait,
)
from ._core.client import Client
from ._core.codec import decode, encode
from ._core.current import journaling
from ._core.engine import WorkflowRow
from ._core.signals import News
from ._core.signals import keys as signal_keys
from ._core.status import ENDED, Status
from ._core.streams.reader import HANDED, decoder
from ._core.twins import blocking, iterate
from .errors import CannotResume, UnknownWorkflow, WorkflowCancelled, WorkflowFailed
from .records import StepInfo, StreamInfo, WorkflowInfo, WorkflowRecord

R = TypeVar("R")


class WorkflowHandle(Generic[R]):
    """Status, result, streams and cancellation of one workflow. Every blocking method has an
    ``_async`` twin, which runs on the caller's own event loop."""

    def __init__(self, client: Client, id: str) -> None:
        self._client = client
        self.id = id

    def __repr__(self) -> str:
        return f"WorkflowHandle({self.id!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WorkflowHandle) and other._client is self._client and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    async def _row(self) -> WorkflowRow:
        row = await self._client.runtime().db(lambda store: store.workflows.workflow(self.id))
        if row is None:
            raise UnknownWorkflow(f"no workflow with id {self.id!r}")
        return row

    async def status_async(self) -> str:
        """"queued", "running", "succeeded", "failed" or "cancelled"."""
        return (await self._row()).status

    status = blocking(status_async)

    async def result_async(self, timeout: float | None = None) -> R:
        """Wait for the workflow to end and return its result (woken by its completion ping).

        Raises WorkflowFailed, WorkflowCancelled, or TimeoutError when ``timeout`` seconds pass first.
        """

        parent = journaling()
        if parent is not None and (known := await parent.child_outcome(self.id)) is not None:
            return self._outcome(known)
        runtime = self._client.runtime()
        seen: WorkflowRow | None = None
        read = False

        async def ended() -> WorkflowRow | None:
            nonlocal seen, read
            news = runtime.signals.waiters.ends
            if seen is None:
                seen = news.quiet_since_start(self.id)  # started here, and nothing heard of it since
                if seen is not None:
                    return None
            elif end := news.take_end(seen):  # its news carried its end
                return end
            seen, read = await self._row(), True
            return seen if seen.status in ENDED else None

        row = await runtime.wait_for([signal_keys.ended(self.id)], ended, timeout)
        if row is None and not read:
            # Never read (its pings said nothing yet): a timeout is only told after one look at the
            # row, which an end whose ping is still on its way would already show.
            row = await self._row()
            row = row if row.status in ENDED else None
        if row is None:
            raise TimeoutError(f"workflow {self.id!r} did not finish within {timeout}s")
        return self._outcome(row)

    result = blocking(result_async)

    async def get_event_async(self, key: str, timeout: float | None = None, *, type: Any = Any) -> Any:
        """The last value the workflow set under ``key``, waiting for one to be set (woken by its
        ping, with the poll as the backstop). None when ``timeout`` seconds pass first, or when the
        workflow ended without setting it (``timeout=None`` waits until one or the other; ``0``
        looks once). ``type`` decodes the value into a Struct or dataclass instead of builtins."""
        check_event_key(key)
        timeout = check_wait(timeout)
        runtime = self._client.runtime()

        async def look() -> tuple[Any] | None:
            found = await runtime.db(lambda store: store.waits.get_event(self.id, key))
            if found is None:
                raise UnknownWorkflow(f"no workflow with id {self.id!r}")
            value, status = found
            if value is not None:
                return (decode(value, type),)
            return (None,) if status in ENDED else None

        got = await runtime.wait_for([signal_keys.event(self.id), signal_keys.ended(self.id)], look, timeout)
        return None if got is None else got[0]

    get_event = blocking(get_event_async)

    def _message(self, topic: str, value: object, idempotency_key: str | None) -> tuple[bytes, str]:
        """The stored message and its idempotency key, made in the caller: from a workflow body
        without a key, the key is the sender's journal position, so a replayed sender sends nothing
        twice; elsewhere without one, a fresh key, so a send retried after a lost answer is stored
        once."""
        check_topic(topic)
        data = encode(value, f"the message on {topic!r}", self._client.registry.value_limit)
        if idempotency_key is not None:
            return data, check_idempotency_key(idempotency_key)
        sender = journaling()
        if sender is not None:
            return data, f"{sender.workflow_id}.{sender.journal.take()}"
        return data, str(uuid.uuid4())

    async def _send(self, topic: str, data: bytes, key: str) -> None:
        sender = journaling()
        if sender is not None and sender.replay_only:
            return  # a check of the sender's journal writes nothing
        runtime = self._client.runtime()
        found = await runtime.db(lambda store: store.waits.send(self.id, topic, data, key))
        if found is None:
            raise UnknownWorkflow(f"no workflow with id {self.id!r}")
        stored, queue, made_due = found
        if stored:
            due = [signal_keys.queue(queue)] if made_due else []
            runtime.signals.announce(News([signal_keys.message(self.id), *due]))

    async def send_async(self, topic: str, value: object, idempotency_key: str | None = None) -> None:
        """Send the workflow a durable message on ``topic``, which its ``recv(topic)`` takes once.
        The same ``idempotency_key`` twice (per receiving workflow) stores one message. A workflow
        that gave its slot back to wait for this topic is made due at once."""
        await self._send(topic, *self._message(topic, value, idempotency_key))

    def send(self, topic: str, value: object, idempotency_key: str | None = None) -> None:
        """Blocking twin of ``send_async``; the message and its key are made here, in the caller."""
        self._client.call(self._send, topic, *self._message(topic, value, idempotency_key))

    async def steps_async(self) -> list[StepInfo]:
        """The steps recorded so far, in call order: progress as another process sees it."""
        return (await self.info_async()).steps

    steps = blocking(steps_async)

    async def info_async(self) -> WorkflowInfo:
        """The workflow's record, its steps (timings, attempts) and its streams with their lengths."""
        found = await self._client.runtime().db(lambda store: store.management.info(self.id))
        if found is None:
            raise UnknownWorkflow(f"no workflow with id {self.id!r}")
        record, steps, streams = found
        return WorkflowInfo(WorkflowRecord.of(record), [StepInfo.of(row) for row in steps],
                            [StreamInfo(*row) for row in streams])

    info = blocking(info_async)

    async def resume_async(self) -> None:
        """Run a failed or cancelled (or timed-out) workflow again: the steps recorded with an output
        are replayed, not re-run; the step whose record is its final error runs again, and so does
        everything after it; its budgets start afresh (the runs ``max_attempts`` counts, and the retries
        of its retry policy). A workflow still queued or running, or one that succeeded, is refused
        with CannotResume."""
        runtime = self._client.runtime()
        found = await runtime.db(lambda store: store.management.resume(self.id))
        if found is None:
            raise UnknownWorkflow(f"no workflow with id {self.id!r}")
        was, queue = found
        if was not in (Status.FAILED, Status.CANCELLED):
            raise CannotResume(f"workflow {self.id!r} is {was}: only a failed or cancelled workflow resumes")
        runtime.signals.waiters.ends.heard_of(self.id)  # an end heard before is not the resumed run's
        runtime.signals.announce(News([signal_keys.queue(queue), signal_keys.ended(self.id)]))

    resume = blocking(resume_async)

    async def fork_async(self, from_step: int) -> WorkflowHandle[R]:
        """A new workflow with the same arguments whose first ``from_step`` recorded steps are copied
        (replayed, not run), the rest run anew; its handle. The original is left as it is."""
        check_position(from_step, "from_step")
        runtime = self._client.runtime()
        new_id = str(uuid.uuid4())
        queue = await runtime.db(lambda store: store.management.fork(self.id, new_id, from_step))
        if queue is None:
            raise UnknownWorkflow(f"no workflow with id {self.id!r}")
        runtime.signals.announce(News([signal_keys.queue(queue)]))
        return WorkflowHandle(self._client, new_id)

    fork = blocking(fork_async)

    async def _decoded(self, key: str, offset: int, type: Any) -> AsyncGenerator[list[tuple[int, Any]], None]:
        """The one reading loop behind all four readers: each batch of (position, chunk) as the
        runtime fetched it, decoded, until the close marker or the workflow's end. Sync readers take a
        batch per trip to the loop, not a chunk."""
        check_reader(key, offset)
        batches = self._client.runtime().read_stream(self.id, key, offset)
        try:
            decode = decoder(type)
            async for chunks in batches:
                items: list[tuple[int, Any]] = []
                for position, value in chunks:
                    if value is None:  # the close marker
                        if items:
                            yield items
                        return
                    items.append((position, decode(value)))
                if items:
                    yield items
        finally:
            await batches.aclose()

    async def stream_items_async(self, key: str, offset: int = 0, *,
                                 type: Any = Any) -> AsyncGenerator[tuple[int, Any], None]:
        """Every (position, chunk) of stream ``key`` from ``offset`` on, in order, until the stream
        is closed or the workflow ends in any way: what a server needs to tell a client where to
        resume (an SSE ``id:``)."""
        decoded = self._decoded(key, offset, type)
        try:
            async for items in decoded:
                for item in items:
                    yield item
        finally:
            await decoded.aclose()

    def stream_items(self, key: str, offset: int = 0, *, type: Any = Any) -> Iterator[tuple[int, Any]]:
        """Blocking twin of ``stream_items_async``: a generator, one trip to the loop per batch."""
        check_reader(key, offset)
        for items in iterate(self._client, self._decoded(key, offset, type)):
            yield from items

    async def stream_async(self, key: str, offset: int = 0, *, type: Any = Any) -> AsyncGenerator[Any, None]:
        """Every chunk of stream ``key`` from ``offset`` on, in order, until the stream is closed or
        the workflow ends in any way. ``offset`` resumes a reader, as a reconnecting browser would;
        ``type`` decodes chunks into a Struct or dataclass instead of builtins."""
        # The reader's own steps, not ``_decoded``'s batches: a reader in step with its writer takes a
        # batch per chunk, and each generator or coroutine less per chunk is CPU, and objects for the
        # application's garbage collector to count (a full collection stops its whole loop).
        check_reader(key, offset)
        read = self._client.runtime().read_stream(self.id, key, offset)
        decode = decoder(type)
        try:
            while True:
                step = read.step()
                if step is HANDED:
                    if read.handed is None:  # the close marker
                        return
                    yield decode(read.handed)
                    continue
                if step is None:  # only the iterator moves on: it runs the query for everyone, ends or fails
                    try:
                        step = await read.__anext__()
                    except StopAsyncIteration:
                        return
                elif isinstance(step, asyncio.Future):
                    await step
                    continue
                for _, value in step:
                    if value is None:
                        return
                    yield decode(value)
        finally:
            await read.aclose()

    def stream(self, key: str, offset: int = 0, *, type: Any = Any) -> Iterator[Any]:
        """Blocking twin of ``stream_async``: a generator, one trip to the loop per batch."""
        for _, value in self.stream_items(key, offset, type=type):
            yield value

    async def cancel_async(self) -> None:
        """Cancel the workflow: a queued (or sleeping, or waiting) one never runs again, a running
        one stops where it stands. The workflows its body started are cancelled with it, and theirs
        (a child that has ended keeps its outcome)."""
        runtime = self._client.runtime()
        found = await runtime.db(lambda store: store.workflows.request_cancel(self.id))
        if found is None:
            raise UnknownWorkflow(f"no workflow with id {self.id!r}")
        runtime.signals.announce(News([signal_keys.ended(id) for id in (self.id, *found.descendants)]))

    cancel = blocking(cancel_async)

    def _outcome(self, row: WorkflowRow) -> R:
        if row.status == Status.SUCCEEDED:
            return self._client.registry.decode_result(row.name, row.output or b"\xc0")  # type: ignore[no-any-return]
        if row.status == Status.CANCELLED:
            raise WorkflowCancelled(self.id, (row.error or {}).get("message") or None)
        error = row.error or {}
        raise WorkflowFailed(self.id, error.get("type", "Exception"), error.get("message", ""),
                             error.get("traceback", ""))

