"""The SQL layer: every statement pgflow runs, and the schema's numbered migrations."""

from .store import Claimed, StepRecord, Store, WorkflowRow, quote_identifier, retrying, unreachable

__all__ = ["Claimed", "StepRecord", "Store", "WorkflowRow", "quote_identifier", "retrying", "unreachable"]
