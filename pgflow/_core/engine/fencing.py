"""What a write fenced by a claim answers. Every write an execution makes carries its claim's token
and touches only a row that token still holds; it answers whether it did, and whether somebody asked
for the workflow to be cancelled meanwhile (``execution.Execution.fenced`` acts on both)."""

from __future__ import annotations

from datetime import datetime
from typing import Generic, NamedTuple, TypedDict, TypeVar

from ..status import Status
from .database import Sql

T = TypeVar("T")

# The row an execution's write is fenced by, as the CTE ``owner`` (its cancel_requested) when the token
# still holds it. The row is found by its primary key alone, and the token and the status are tested
# outside the subquery (its LIMIT, a no-op on a primary key, keeps the planner from pushing them in):
# pgflow's plans are generic and one made on a new, unanalysed table preferred the partial indexes of
# running workflows for ``status = 'running'``, which under a long transaction hold every version ever
# running, so each write walked them all (tests/test_fence_plans.py). ``{lock}``: " FOR SHARE" or "".
_OWNER = (
    "owner AS (SELECT w.cancel_requested FROM (SELECT cancel_requested, lease_token, status"
    "  FROM {{s}}.workflows WHERE id = %(id)s LIMIT 1{lock}) w"
    "  WHERE w.lease_token = %(lease)s AND w.status = 'running')"
)
OWNER_LOCKED = _OWNER.format(lock=" FOR SHARE")
OWNER = _OWNER.format(lock="")


class Owned(TypedDict):
    """The parameters of ``OWNER``: the workflow, and the claim's token."""

    id: str
    lease: int


class Journaled(Owned):
    """The parameters of a journal entry written for the execution holding a claim (number ``attempt``):
    its ``position`` and ``name``."""

    attempt: int
    position: int
    name: str

# The workflow's id when the token (%s after the id) still holds it, its row locked for the statements of the
# transaction that follow (the same lookup by the primary key alone). FOR NO KEY UPDATE: the key-share
# lock of a message's foreign key does not hold it up.
HOLDS_LOCKED = (
    "SELECT w.id FROM (SELECT id, lease_token, status FROM {s}.workflows WHERE id = %s LIMIT 1 FOR NO KEY UPDATE) w"
    " WHERE w.lease_token = %s AND w.status = 'running'"
)


class Holding(NamedTuple):
    """The parameters of ``HOLDS_LOCKED``: the workflow, and the claim's token."""

    id: str
    lease: int


HOLDS = Sql(HOLDS_LOCKED, row=tuple[str], params=Holding)


def held(name: str, asked: str, select: str, *, lock: str = "", by: str = "w.lease_token = a.lease") -> str:
    """The CTE ``name``: ``select`` of each row of ``asked`` (a FROM item with the workflow's ``id``,
    as ``a``) whose workflow (``w``: id, lease_token, lease_owner, status, cancel_requested) is running
    and held as ``by`` says; found as OWNER's row is, by the primary key alone, one lookup per row in
    ``asked``'s order, the order any ``lock`` (" FOR SHARE", " FOR UPDATE") is taken in. Every
    statement that locks several workflow rows takes them in id order, so that none deadlock."""
    return (f"{name} AS (SELECT {select} FROM {asked} a CROSS JOIN LATERAL"
            f" (SELECT id, lease_token, lease_owner, status, cancel_requested FROM {{s}}.workflows"
            f"  WHERE id = a.id LIMIT 1{lock}) w"
            f" WHERE w.status = 'running' AND {by})")


class Fence(NamedTuple):
    """``owner``: the claim still held the workflow (so the write was made); ``cancel``: a
    cancellation of the workflow was requested."""

    owner: bool
    cancel: bool

    def with_value(self, value: T) -> Fenced[T]:
        return Fenced(self.owner, self.cancel, value)


class Fenced(NamedTuple, Generic[T]):
    """A ``Fence`` and what the write gave back."""

    owner: bool
    cancel: bool
    value: T


class Wake(NamedTuple):
    """A sleep's journaled wake-up: ``left`` seconds from the statement, at ``at``."""

    left: float
    at: datetime


class Receipt(NamedTuple):
    """A receive's look at its topic: whether a message was ``taken`` (and its ``value``), and its
    journaled deadline: ``left`` seconds from the statement, at ``deadline``."""

    taken: bool
    value: bytes | None
    left: float
    deadline: datetime


class Requeued(NamedTuple):
    """Where a run that gave its workflow back left it: its ``queue``, and its ``status`` now
    (queued, or cancelled when a cancellation was asked for meanwhile)."""

    queue: str
    status: Status


class StepStart(NamedTuple):
    """A note that the execution holding ``lease_token`` (its claim number ``attempt``) starts attempt
    ``step_attempt`` of the step at ``position`` (``Engine.start_steps``)."""

    workflow_id: str
    attempt: int
    lease_token: int
    position: int
    step_attempt: int
