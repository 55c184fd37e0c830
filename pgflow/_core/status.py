"""A workflow's status, and the words the code inside ``pgflow._core`` uses for claims and attempts.

The status is the ``status`` column of ``workflows``, one of ``Status``'s values; the SQL spells them
in its own text, the Python code names them here. A ``Status`` is a ``str`` (what users see stays a
plain string: ``handle.status() == "queued"``).

One word, one meaning, in the code of ``pgflow._core`` (public names keep their own: a worker's
``lease=`` and the CLI's ``--lease`` are seconds, ``pgflow.attempt()`` is a run):

- ``lease_token``: the random int a claim writes into ``workflows.lease_token``, never handed out
  twice; every write an execution makes is fenced by it (one whose claim was lost writes nothing).
- ``lease_seconds``: how long a claim holds a workflow without a heartbeat (the worker's ``lease=``).
- ``attempt``: the claim's number, ``workflows.attempt``: one more per claim of the row, whatever
  became of the one before (a wake from a long sleep is a claim too). An end read of attempt N is newer
  than a row read before it ran.
- ``run``: the attempt counted against the workflow's ``max_attempts`` (``pgflow.attempt()``, the
  records' ``attempt``): 1 on its first run, one more per run that a crash, a stop or a lost lease cut
  short; waking from a sleep or a receive costs none, and ``resume()`` starts the count again.
- ``retries``: runs of the body that failed and were run again under the workflow's retry policy.
- ``step_attempt``: the number of one attempt of one step call within a run (``pgflow.step_attempt()``,
  ``step_attempts.tries`` in the schema); ``attempts``: how many a step's record counts, over every run.
"""

from __future__ import annotations

from enum import StrEnum


class Status(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


STATUSES: tuple[Status, ...] = tuple(Status)
ENDED: tuple[Status, ...] = (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED)  # until a resume() queues it again
UNFINISHED: tuple[Status, ...] = (Status.QUEUED, Status.RUNNING)
