"""The streams of one run: where each ends, how far the body's replay of its writes has got, and what
the worker's stream writer (``streams/writer.py``) keeps about the run's chunks.

A chunk written by the workflow body lands at the same position on every run, so a workflow replayed
after a crash skips the writes that were already committed instead of repeating them: per key, the
cursor is how far this run's replay has got, and the end the next free position in the table (read
once when the run starts, then kept here). A chunk written by a step is appended after whatever the
stream holds. The run stops writing when its ``RunState`` holds a reason to stop.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ..errors import StepTimeout
from .run_state import RunState
from .step_body import inside_step

if TYPE_CHECKING:
    from .cancels import CancelWatch
    from .streams.writer import Stream, StreamWriter


class RunStreams:
    """One run's streams, and the writer's owner of its chunks: it fences them with ``lease_token``
    (or ``fence``, its worker's, while that holds) and counts them in flight."""

    __slots__ = ("state", "writer", "workflow_id", "lease_token", "ends", "cursor", "closed", "named_streams",
                 "fence", "cancels", "chunks_in_flight", "fence_cut", "settled")

    def __init__(self, state: RunState, writer: StreamWriter | None, workflow_id: str, lease_token: int,
                 ends: dict[str, int] | None = None, fence: tuple[str, int] | None = None,
                 cancels: CancelWatch | None = None) -> None:
        self.state = state
        self.writer = writer
        self.workflow_id = workflow_id
        self.lease_token = lease_token
        self.ends = ends if ends is not None else {}  # per key: the next free position in the table
        self.cursor: dict[str, int] = {}  # per key: how far the body's replay of its writes has got
        self.closed: set[str] = set()
        # The writer's: what it knows of each stream; the worker fence (worker id, epoch) the claim was
        # made under, while it holds (it fences the run's chunk batches, migration 0026; None: the
        # workflow's row does); the run's chunks in batches being written; a batch of them under this
        # worker's fence that was cut off; and the future its end waits on for those in flight.
        self.named_streams: dict[str, Stream] = {}
        self.fence = fence
        self.cancels = cancels  # told of the workflow once its chunks are fenced by its worker
        self.chunks_in_flight = 0
        self.fence_cut: str | None = None
        self.settled: asyncio.Future[None] | None = None

    def put(self, key: str, value: bytes | None) -> asyncio.Future[None] | None:
        """Hand a chunk (``None`` closes the stream) to the worker's writer at the stream's next
        position: the future is done once it is committed, and fails with the reason it was not
        (the run was interrupted meanwhile). None when there is nothing to write (a replayed write).
        (Not a coroutine: a writer awaits the future itself, one frame less to resume per chunk.)"""
        step = inside_step.get()
        if step is not None and step.abandoned:
            raise StepTimeout(f"stream {key!r}: the step attempt writing it ran past its timeout and was abandoned")
        reason = self.state.reason  # (``state.check()``, inline: once per chunk)
        if reason is not None:
            raise reason
        closed = self.closed
        if closed and key in closed:
            raise ValueError(f"stream {key!r} of workflow {self.workflow_id!r} is closed")
        if value is None:
            closed.add(key)
        end = self.ends.get(key, 0)
        if step is None:
            cursor = self.cursor.get(key, 0)
            self.cursor[key] = cursor + 1
            if cursor < end:
                return None
        self.ends[key] = end + 1
        writer = self.writer
        if writer is None:
            raise RuntimeError("streams are written by workflows run by a worker")
        if self.fence is not None and self.cancels is not None:
            self.cancels.watch(self.workflow_id)  # its chunks do not read its row (see cancels.py)
        return writer.put(self, key, end, value)

    async def write(self, key: str, value: bytes | None) -> None:
        """``put``, awaited."""
        written = self.put(key, value)
        if written is not None:
            await written

    def offset(self, key: str) -> int:
        """Inside a step: chunks this step call has committed to ``key`` so far, earlier attempts
        included. In the workflow body: how many chunks the stream holds."""
        end = self.ends.get(key, 0)
        return end - self.cursor.get(key, 0) if inside_step.get() else end

    def caught_up(self, ends: dict[str, int]) -> None:
        """A step's record says where its streams ended (it was replayed, or recorded with them): the
        body's cursors move past what the step wrote."""
        cursor = self.cursor
        for key, end in ends.items():
            cursor[key] = max(cursor.get(key, 0), end)
