"""The engine: everything that touches PostgreSQL, as ports by role (``Engine``) over one ``Database``,
and the schema's numbered migrations."""

from .channel import NO_PINGS, Pings
from .claimed import Claimed
from .database import quote_identifier
from .engine import Engine
from .fencing import Fence, Fenced, Receipt, Requeued, StepStart, Wake
from .journal import StepRecord
from .reruns import Rerun
from .retries import retrying, unreachable
from .workflows import WorkflowRow

__all__ = ["NO_PINGS", "Claimed", "Engine", "Fence", "Fenced", "Pings", "Receipt", "Requeued", "Rerun", "StepRecord",
           "StepStart", "Wake", "WorkflowRow", "quote_identifier", "retrying", "unreachable"]
