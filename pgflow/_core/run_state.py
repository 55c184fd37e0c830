"""Why a run must stop, told once and read everywhere: the one owner of a run's interrupt and its
cancellation.

Many parts of a worker learn that a run must stop: a fenced write finds its lease lost or its cancel
asked for, the stream writer's batch is fenced out, cut off or refused, the heartbeat or the cancel
watch hears of a cancel, the workflow's deadline passes, a wait gives the slot back, the run ends.
Each tells the run's ``RunState`` (``interrupt``, or ``cancel``), and every check the run makes (before
a step, a wait, a chunk) raises the one reason in force. Two reasons may arrive in either order, from
different tasks; which one stands is written here, once, instead of at each place that learns one:

=====  ==========================================  ===================================================
rank   reason                                      what becomes of the run
=====  ==========================================  ===================================================
1      ``LeaseLost``                               nothing: another run owns the workflow, so nothing
                                                   this one does can be recorded, not even a cancel
2      ``CancelRequested``                         recorded as cancelled: somebody asked, and the row
                                                   says so whatever else went wrong
3      ``StoreUnavailable``,                       given back, to run again from its journal (an
       ``StreamWriteFailed``, ``ChunkRefused``     outage); failed with the reason (a refused chunk)
4      ``TimedOut``                                failed with ``WorkflowTimeout`` (decided as the
                                                   deadline passed; this only stops what is left)
5      ``Suspended``                               its slot given back until its wait is due
6      ``RunOver``                                 nothing more: its end is being recorded or it was
                                                   given back
=====  ==========================================  ===================================================

A stronger reason replaces a weaker one; of equal rank the first stays. So a reason, once given, is
only ever replaced by one that decides more: a chunk refused is not hidden by the run ending, and a
cancel is not hidden by an outage that comes after it. (The worker stopping is no reason: it cancels
the run's scope, and a run whose scope was cancelled without a cancel is given back.)

A cancellation has one path, ``cancel``: the reason recorded, and the run's scope cancelled, so the
body stops where it stands rather than at its next write. The worker's registry of running runs (the
heartbeat's and the cancel watch's way to a run by its id) holds this method.
"""

from __future__ import annotations

import anyio

from ..errors import CancelRequested, ExecutionInterrupted, LeaseLost, StoreUnavailable, Suspended


class StreamWriteFailed(ExecutionInterrupted):
    """A batch of chunks could not be written; the execution stops and another run resumes it."""


class ChunkRefused(ExecutionInterrupted):
    """The server refused a chunk for what it holds; its workflow fails with this reason."""


class TimedOut(ExecutionInterrupted):
    """The workflow ran past its timeout: its failure is recorded, and what is left of it (a sync
    body's abandoned thread) writes nothing more."""


class RunOver(ExecutionInterrupted):
    """The run has ended or given its workflow back: nothing it writes from now on may land."""


# The table of the module's docstring, strongest first.
PRECEDENCE: tuple[tuple[type[ExecutionInterrupted], ...], ...] = (
    (LeaseLost,),
    (CancelRequested,),
    (StoreUnavailable, StreamWriteFailed, ChunkRefused),
    (TimedOut,),
    (Suspended,),
    (RunOver,),
)
_RANK = {kind: rank for rank, kinds in enumerate(PRECEDENCE) for kind in kinds}


def rank(reason: ExecutionInterrupted) -> int:
    """The rank of ``reason`` in ``PRECEDENCE`` (0: the strongest). A reason of no rank is a bug of
    the caller: every reason a run may be given is in the table."""
    for kind in type(reason).__mro__:
        found = _RANK.get(kind)
        if found is not None:
            return found
    raise TypeError(f"{type(reason).__name__} has no rank among a run's interrupts (run_state.PRECEDENCE)")


class RunState:
    """The interrupt of one run (``reason``: None while it may go on), its cancellation, and what its
    body raised (for the workflow's retry policy). Owned by the run's execution; the executor, the
    stream writer and the worker's cancel paths tell it, and nothing else assigns its fields."""

    __slots__ = ("workflow_id", "run", "reason", "failure", "_scope")

    def __init__(self, workflow_id: str, run: int, scope: anyio.CancelScope | None = None) -> None:
        self.workflow_id = workflow_id
        self.run = run  # the attempt counted against the workflow's budget, for the messages
        self.reason: ExecutionInterrupted | None = None
        self.failure: BaseException | None = None
        self._scope = scope  # the scope the body runs in (None: a replay check, which has none)

    def interrupt(self, reason: ExecutionInterrupted) -> ExecutionInterrupted:
        """Tell the run it must stop for ``reason``; the reason in force afterwards (``reason``, or a
        stronger or earlier one of equal rank that stands), for the caller to raise or hand on."""
        current, stronger = self.reason, rank(reason)
        if current is None or stronger < rank(current):
            self.reason = current = reason
        return current

    def cancel(self) -> None:
        """The one way a run is cancelled: the reason recorded (a cancel of the workflow, unless a lost
        lease stands) and the run's scope cancelled, so the body stops now, at whatever it awaits."""
        self.interrupt(CancelRequested(f"workflow {self.workflow_id!r} was cancelled"))
        if self._scope is not None:
            self._scope.cancel()

    def lose_lease(self) -> ExecutionInterrupted:
        """``interrupt`` with the lease lost (a fenced write found another claim on the workflow)."""
        return self.interrupt(LeaseLost(f"workflow {self.workflow_id!r} attempt {self.run} lost its lease"))

    @property
    def cancelled(self) -> bool:
        """Whether the reason in force is a cancel (a run whose scope was cancelled is recorded as
        cancelled then, and given back otherwise)."""
        return isinstance(self.reason, CancelRequested)

    def check(self) -> None:
        """Raise the reason in force, if any: a run stops at its next step, wait or write."""
        if self.reason is not None:
            raise self.reason

    def failed(self, exc: BaseException) -> None:
        """Keep what the body raised: the workflow's retry policy decides on it."""
        self.failure = exc
