"""The SQL layer: every statement pgflow runs, and the schema's numbered migrations."""

from .channel import NO_PINGS, Pings
from .claims import Claimed
from .fencing import Fence, Fenced, Receipt, Requeued, StepStart, Wake
from .reruns import Rerun
from .statements import quote_identifier
from .store import (
    StepRecord,
    Store,
    WorkflowRow,
    retrying,
    unreachable,
)

__all__ = ["NO_PINGS", "Claimed", "Fence", "Fenced", "Pings", "Receipt", "Requeued", "Rerun", "StepRecord", "StepStart",
           "Store", "Wake", "WorkflowRow", "quote_identifier", "retrying", "unreachable"]
