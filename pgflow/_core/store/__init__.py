"""The SQL layer: every statement pgflow runs, and the schema's numbered migrations."""

from .store import (
    NO_PINGS,
    Claimed,
    Pings,
    StepRecord,
    Store,
    WorkflowRow,
    quote_identifier,
    retrying,
    unreachable,
)

__all__ = ["NO_PINGS", "Claimed", "Pings", "StepRecord", "Store", "WorkflowRow", "quote_identifier", "retrying",
           "unreachable"]
