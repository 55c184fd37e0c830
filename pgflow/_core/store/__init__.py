"""The SQL layer: every statement pgflow runs, and the schema's numbered migrations."""

from .channel import NO_PINGS, Pings
from .claims import Claimed
from .statements import quote_identifier
from .store import (
    StepRecord,
    Store,
    WorkflowRow,
    retrying,
    unreachable,
)

__all__ = ["NO_PINGS", "Claimed", "Pings", "StepRecord", "Store", "WorkflowRow", "quote_identifier", "retrying",
           "unreachable"]
