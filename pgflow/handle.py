"""A handle on a workflow by id, usable from any process that can reach the database."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from . import codec, streams
from .errors import UnknownWorkflow, WorkflowCancelled, WorkflowFailed
from .store import WorkflowRow

if TYPE_CHECKING:
    from .app import App
    from .workflow import Workflow

R = TypeVar("R")


@dataclass(frozen=True)
class StepInfo:
    """A recorded step call: its position in the workflow, its name, and how it ended."""

    position: int
    name: str
    error_type: str | None
    attempts: int
    finished_at: datetime
FINAL = frozenset({"succeeded", "failed", "cancelled"})


class WorkflowHandle(Generic[R]):
    """Status, result and cancellation of one workflow. Every blocking method has an ``_async`` twin."""

    def __init__(self, app: App, id: str, workflow: Workflow[Any, R] | None = None) -> None:
        self.app = app
        self.id = id
        self._workflow = workflow

    def __repr__(self) -> str:
        return f"WorkflowHandle({self.id!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WorkflowHandle) and other.app is self.app and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    async def _row(self) -> WorkflowRow:
        row = await self.app.engine.db(lambda store: store.workflow(self.id))
        if row is None:
            raise UnknownWorkflow(f"no workflow with id {self.id!r}")
        return row

    async def status_async(self) -> str:
        """"queued", "running", "succeeded", "failed" or "cancelled"."""
        return (await self._row()).status

    def status(self) -> str:
        return self.app.engine.call(self.status_async)

    async def result_async(self, timeout: float | None = None) -> R:
        """Wait for the workflow to end and return its result (woken by its completion ping).

        Raises WorkflowFailed, WorkflowCancelled, or TimeoutError when ``timeout`` seconds pass first.
        """

        engine = self.app.engine

        async def wait_there() -> WorkflowRow | None:
            # On the engine's loop, beside the listener: a wake-up costs no hop between threads.
            async def ended() -> WorkflowRow | None:
                row = await self._row()
                return row if row.status in FINAL else None

            return await engine.wait_for([f"wf:{self.id}"], ended, timeout)

        row = await engine.on_engine_loop(wait_there)
        if row is None:
            raise TimeoutError(f"workflow {self.id!r} did not finish within {timeout}s")
        return self._outcome(row)

    def result(self, timeout: float | None = None) -> R:
        return self.app.engine.call(self.result_async, timeout)

    async def steps_async(self) -> list[StepInfo]:
        """The steps recorded so far, in call order: progress as another process sees it."""
        return [StepInfo(*row) for row in await self.app.engine.db(lambda store: store.steps(self.id))]

    def steps(self) -> list[StepInfo]:
        return self.app.engine.call(self.steps_async)

    async def stream_async(self, key: str, offset: int = 0, *, type: Any = Any) -> AsyncIterator[Any]:
        """Every chunk of stream ``key`` from ``offset`` on, in order, until the stream is closed or
        the workflow ends in any way. ``offset`` resumes a reader, as a reconnecting browser would;
        ``type`` decodes chunks into a Struct or dataclass instead of builtins."""
        async for value in streams.read(self.app.engine, self.id, key, offset, type):
            yield value

    def stream(self, key: str, offset: int = 0, *, type: Any = Any) -> Iterator[Any]:
        streams.check_reader(key, offset)
        at: int | None = offset
        while at is not None:
            values, at = streams.take(self.app.engine.call(self._next_chunks, key, at), at, type)
            yield from values

    async def _next_chunks(self, key: str, offset: int) -> list[tuple[int, bytes | None]] | None:
        return await streams.next_chunks(self.app.engine, self.id, key, offset)

    async def cancel_async(self) -> None:
        """Cancel the workflow: a queued one never starts, a running one stops at its next step."""
        status = await self.app.engine.db(lambda store: store.request_cancel(self.id))
        if status is None:
            raise UnknownWorkflow(f"no workflow with id {self.id!r}")
        self.app.engine.ping(f"wf:{self.id}")

    def cancel(self) -> None:
        self.app.engine.call(self.cancel_async)

    def _outcome(self, row: WorkflowRow) -> R:
        if row.status == "succeeded":
            workflow = self._workflow or self.app.workflows.get(row.name)
            if workflow is None:
                return codec.decode(row.output or b"\xc0")  # type: ignore[no-any-return]
            return workflow.codec.decode_result(row.output or b"\xc0")  # type: ignore[no-any-return]
        if row.status == "cancelled":
            raise WorkflowCancelled(self.id)
        error = row.error or {}
        raise WorkflowFailed(self.id, error.get("type", "Exception"), error.get("message", ""),
                             error.get("traceback", ""))
