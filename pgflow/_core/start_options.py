"""What ``with_options`` gathers for the starts made through its result: one frozen value, checked as
a whole where a later ``with_options`` call may still complete it (a debounce given half)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from .debounce_options import check_debounce_complete, check_debounce_expiry
from .engine.debounces import Debounce
from .engine.starts import Timing
from .timing import timing


@dataclass(frozen=True)
class StartOptions:
    id: str | None = None
    queue: str | None = None
    priority: int | None = None
    delay: float = 0.0
    eta: datetime | None = None
    expires: datetime | float | None = None
    debounce: float | None = None
    debounce_key: str | None = None
    debounce_max: float | None = None
    key: str | None = None

    def timing(self) -> Timing | None:
        """The stored timing; for a debounced start its expiry alone, checked to come after the
        first window (a run that expired before it was due could never run)."""
        if self.debounce is not None:
            check_debounce_expiry(self.debounce, self.expires)
            return timing(0.0, None, self.expires)
        return timing(self.delay, self.eta, self.expires)

    def debounced(self) -> Debounce | None:
        """How a start with these options is debounced, None when it is not; a ValueError for a
        debounce half given (what ``with_options`` could not refuse, as a later call may complete it)."""
        most = check_debounce_complete(window=self.debounce, key=self.debounce_key, most=self.debounce_max)
        if most is None or self.debounce is None or self.debounce_key is None:
            return None
        return Debounce(self.debounce_key, self.debounce, most)
