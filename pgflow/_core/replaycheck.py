"""Replaying stored journals against the code now importable, running no step and writing nothing.

Each unfinished workflow's body runs under a ``ReplayCheck``: an execution whose journal is the one
stored, and which stops the body where that journal ends (the first position nothing was recorded at,
a sleep not yet over, a child not yet ended) instead of running or writing anything there. A body that
gets there without a ``NonDeterministicWorkflow`` replays; one that raises it is reported with the
position and both names. Everything is read in one read-only transaction on a connection of the
check's own, so the check cannot write even by mistake.
"""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import anyio
import anyio.lowlevel
import psycopg

from ..errors import ExecutionInterrupted, NonDeterministicWorkflow, Suspended
from .connecting import linked, unconnectable
from .current import current_execution
from .engine import Engine, StepRecord, WorkflowRow, quote_identifier
from .engine.migrations import check_owners
from .engine.replay import ReplayReads
from .execution import Execution
from .outcomes import replay
from .registry import Registry, StepSpec, WorkflowSpec
from .run_journal import RunJournal
from .run_state import RunState
from .run_streams import RunStreams
from .runtime import Runtime
from .status import ENDED


class JournalEnd(ExecutionInterrupted):
    """The body got to where its stored journal ends: everything before replayed."""


@dataclass(frozen=True)
class Mismatch:
    """A workflow whose journal the code would not replay: at ``position`` the code calls ``called``
    where the journal holds ``recorded`` (both None for a failure of another kind, in ``message``)."""

    workflow_id: str
    name: str
    position: int | None
    called: str | None
    recorded: str | None
    message: str


@dataclass
class ReplayReport:
    """What ``check_replay`` found: the ids that replay, the mismatches, and the workflows it did not
    check (their name is not one this App registers) with the reason."""

    passed: list[str] = field(default_factory=list)
    mismatches: list[Mismatch] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


class _NoStore:
    """Where a real execution keeps its store: a check has none to write to."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"check-replay writes nothing (Engine.{name} was reached)")


@dataclass(eq=False)
class ReplayCheck(Execution):
    """An execution over a stored journal that stops the body where the journal ends."""

    replay_only: ClassVar[bool] = True
    reads: ReplayReads | None = None
    found: tuple[int | None, str, str] | None = None  # the mismatch: position, called, recorded
    replayed_error: BaseException | None = None  # the last recorded step error raised again

    @property
    def suspend_after(self) -> float:
        return 0.0  # a wait with time left ends the check there, it is not waited out

    def seconds_left(self, remaining_when_loaded: float) -> float:
        return 0.0  # a recorded sleep is over for the check: what follows it is recorded or the end

    def recorded(self, position: int, name: str) -> StepRecord | None:
        record = self.journal.records.get(position)
        if record is not None and record.name != name and self.found is None:
            self.found = (position, name, record.name)
        return super().recorded(position, name)

    def entry(self, name: str, what: str) -> tuple[int, StepRecord | None]:
        position, record = super().entry(name, what)
        if record is None or record.waiting:
            raise JournalEnd(f"position {position}")
        return position, record

    async def call_step(self, step: StepSpec, args: Any, kwargs: Any) -> Any:
        self.state.check()
        position = self.journal.take()
        record = self.recorded(position, step.name)
        if record is None:
            raise JournalEnd(f"position {position}")
        try:
            return replay(record, step)
        except Exception as exc:
            self.replayed_error = exc
            raise

    async def write_marks(self) -> None:
        self.journal.forget_marks()

    async def before_child_start(self, ids: list[str], name: str) -> bool:
        """A child the stored run started must be there under the id this start gives it, and be of
        the same workflow; one it did not start yet is where the journal ends."""
        assert self.reads is not None
        for id in ids:
            row = await self.reads.workflow(id)
            if row is None:
                raise JournalEnd(f"child {id}")
            if row.name != name:
                position = _child_position(self.workflow_id, id)
                self.found = (position, name, row.name)
                raise NonDeterministicWorkflow(
                    f"workflow {self.workflow_id!r} starts a child workflow {name!r} at position {position},"
                    f" but its journal's run started {row.name!r} there ({id!r})")
        return False

    async def child_outcome(self, id: str) -> WorkflowRow | None:
        assert self.reads is not None
        row = await self.reads.workflow(id)
        if row is None or row.status not in ENDED:
            raise JournalEnd(f"waiting for child {id}")
        return row


def _child_position(parent: str, child: str) -> int | None:
    rest = child[len(parent) + 1:].split(".")[0]
    return int(rest) if rest.isdigit() else None


async def check_replay(registry: Registry, runtime: Runtime, dsn: str, schema: str, query_timeout: float,
                       statuses: Sequence[str], limit: int, within: float = 30.0) -> ReplayReport:
    """Replay up to ``limit`` unfinished workflows in ``statuses`` against ``registry``'s code."""
    report = ReplayReport()
    try:
        conn = await psycopg.AsyncConnection.connect(linked(dsn, query_timeout), autocommit=False)
    except (psycopg.ProgrammingError, psycopg.OperationalError) as exc:
        raise unconnectable(dsn, exc) from None  # an error of the check, not a verdict on the journals
    try:
        await conn.set_read_only(True)
        await conn.set_isolation_level(psycopg.IsolationLevel.REPEATABLE_READ)
        async with conn.transaction():
            await check_owners(conn, quote_identifier(schema))  # nothing of another role's is read or run
            reads = ReplayReads(conn, schema)
            for id, name, _status, inputs in await reads.unfinished(statuses, limit):
                spec = registry.workflows.get(name)
                if spec is None:
                    report.skipped.append((id, f"no workflow named {name!r} is registered by this App"))
                    continue
                journal, horizon = await reads.journal(id)
                mismatch = await _check_one(spec, runtime, reads, id, inputs, journal, horizon, within)
                if mismatch is None:
                    report.passed.append(id)
                else:
                    report.mismatches.append(mismatch)
    finally:
        await conn.close()
    return report


async def _check_one(spec: WorkflowSpec, runtime: Runtime, reads: ReplayReads, id: str, inputs: bytes,
                     journal: dict[int, StepRecord], horizon: int, within: float) -> Mismatch | None:
    state = RunState(id, 0)  # (no scope: nothing cancels a check)
    check = ReplayCheck(runtime=runtime, store=cast(Engine, _NoStore()), workflow_id=id, attempt=0, lease_token=0,
                        journal=RunJournal(journal, horizon), token=anyio.lowlevel.current_token(), state=state,
                        streams=RunStreams(state, None, id, 0), reads=reads)
    reset = current_execution.set(check)
    try:
        with anyio.fail_after(within):
            args, kwargs = spec.codec.decode_arguments(inputs)
            if spec.is_async:
                await spec.fn(*args, **kwargs)
                check.check_awaited(report=False)
            else:
                context = contextvars.copy_context()
                await anyio.to_thread.run_sync(lambda: context.run(spec.fn, *args, **kwargs),
                                               abandon_on_cancel=True)
    except (JournalEnd, Suspended):
        check.check_awaited(report=False)
    except NonDeterministicWorkflow as exc:
        check.check_awaited(report=False)
        position, called, recorded = check.found or (None, None, None)
        return Mismatch(id, spec.name, position, called, recorded, str(exc))
    except TimeoutError:
        return Mismatch(id, spec.name, None, None, None,
                        f"the body did not reach the end of its journal within {within:g}s (does it wait on"
                        " something pgflow does not journal?)")
    except Exception as exc:  # noqa: BLE001 - reported: the new code fails where the old journal is
        if exc is check.replayed_error:
            return None  # a recorded step error, raised again as on the first run: the run ends as it did
        if check.found is not None:
            position, called, recorded = check.found
            return Mismatch(id, spec.name, position, called, recorded, str(exc))
        return Mismatch(id, spec.name, check.journal.next_position, None, None,
                        f"the body raises {type(exc).__name__} while replaying its journal: {exc}")
    finally:
        current_execution.reset(reset)
    if check.found is not None:  # the body caught the NonDeterministicWorkflow and went on
        position, called, recorded = check.found
        return Mismatch(id, spec.name, position, called, recorded,
                        f"at position {position} the code calls {called!r} where the journal holds {recorded!r}")
    return None

