"""What a claim hands a worker: each workflow it now holds (``Claimed``), and what one claim found
(``Round``), read from the rows of the claim's statement (``claims.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(slots=True, eq=False)
class Claimed:
    """A workflow this worker now holds a lease on, as its claim read it (nothing assigns to one: not
    frozen only because a frozen one's ``__init__`` sets each field through ``object.__setattr__``,
    1.6 µs more per claimed workflow)."""

    id: str
    name: str
    inputs: bytes
    attempt: int
    max_attempts: int | None  # its max_attempts (None: no cap)
    seconds_left: float | None  # until the workflow's timeout; None without one
    queue: str
    traceparent: str | None  # the caller's trace, when it had one
    waited: float  # seconds from being due (or its lease running out) to this claim
    lease_token: int  # never handed out twice: it fences every write of the execution
    born: int  # the row's created_at in microseconds (what binds news of its end to this workflow)
    # The attempt counted against the workflow's budget (``pgflow.attempt()``): 1 on its first run,
    # one more per run a crash or a stop interrupted; resuming after a sleep or a resume() costs none.
    run: int = 1
    expired: bool = False  # claimed past its ``expires=`` without having started: ends cancelled, unrun
    retries: int = 0  # runs of the body that failed and were retried under its workflow's retry policy
    set_start: bool = False  # this claim set the row's started_at (its first start), and
    set_deadline: bool = False  # its deadline_at (the first start's, or a rerun's): ``unclaim`` clears them
    # The claimer's fence (worker id, epoch) when it had one: chunk batches are fenced by it, not by the row.
    fence: tuple[str, int] | None = None
    # Given up instead of run (no new attempt begun): its worker died while running it alone
    # ``crashes`` times, or its attempts are spent (see claims._VERDICT).
    give_up: bool = False
    # None: no suspect. Otherwise a suspect (run alone), whose worker died that many times while
    # running it alone (0: it was caught in another workflow's crash).
    crashes: int | None = None
    uncounted: bool = False  # this claim began no new attempt (a wake-up, a retry, a rerun after a crash)

    @property
    def suspect(self) -> bool:
        """Claimed as a suspect of a crash: its worker runs nothing beside it."""
        return self.crashes is not None


class Round(NamedTuple):
    """What one claim found: the workflows claimed, the seconds until the next delayed one falls due
    (None: none waits), whether suspects wait to be run alone (as a full claim saw), and, for a
    rate-limited queue whose bucket ran dry, the seconds until its next token."""

    claimed: list[Claimed]
    due: float | None
    suspects: bool | None = None  # None: this claim did not look (only full claims do)
    refill: float | None = None


# A row of the claim statement (``claim_sql._claim``), in order: each claimed workflow's id, name, inputs,
# attempt, max_attempts, seconds_left, run, queue, traceparent, waited, born, expired, retries, set_start,
# set_deadline, give_up, crashes, free and its claimer's fence epoch; then two columns that only its last
# row fills (whose others are NULL, not as typed here): the seconds until the next delayed workflow falls
# due, and whether suspects wait.
ClaimRow = tuple[str, str, bytes, int, int | None, float | None, int, str, str | None, float, int, bool, int, bool,
                 bool, bool, int | None, bool, int | None, float | None, bool | None]


def claimed_of(rows: Sequence[ClaimRow], owner: str, token: int) -> list[Claimed]:
    """The claimed workflows of a claim's rows (all but its last, which says when the next falls due)."""
    return [Claimed(id=id, name=name, inputs=inputs, attempt=attempt, max_attempts=max_attempts, seconds_left=left,
                    queue=queue, traceparent=traceparent, waited=waited, lease_token=token, born=born, run=run,
                    expired=expired, retries=retries, set_start=set_start, set_deadline=set_deadline,
                    give_up=give_up, crashes=crashes, uncounted=free, fence=None if epoch is None else (owner, epoch))
            for id, name, inputs, attempt, max_attempts, left, run, queue, traceparent, waited, born, expired,
            retries, set_start, set_deadline, give_up, crashes, free, epoch, _, _ in rows]
