"""When and how long to wait before a failed step runs again."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

RetryOn = tuple[type[BaseException], ...] | Callable[[BaseException], bool]


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter, up to ``max_attempts`` runs in all.

    The n-th wait is drawn uniformly from the upper half of ``min(max_backoff, backoff * rate**(n-1))``
    so that many steps failing together (a service went down) do not come back in lockstep.
    ``retry_on`` is a tuple of exception types or a predicate; anything else fails the step at once.
    """

    max_attempts: int = 1
    backoff: float = 0.5
    backoff_rate: float = 2.0
    max_backoff: float = 60.0
    retry_on: RetryOn = (Exception,)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.backoff < 0 or self.max_backoff < 0 or self.backoff_rate < 1:
            raise ValueError("backoff and max_backoff must be >= 0 and backoff_rate >= 1")

    def should_retry(self, exc: BaseException, attempt: int) -> bool:
        if attempt >= self.max_attempts or not isinstance(exc, Exception):
            return False
        if isinstance(self.retry_on, tuple):
            return isinstance(exc, self.retry_on)
        return bool(self.retry_on(exc))

    def delay(self, attempt: int) -> float:
        """Seconds to wait after the ``attempt``-th failure."""
        ceiling = min(self.max_backoff, self.backoff * self.backoff_rate ** (attempt - 1))
        return random.uniform(ceiling / 2, ceiling)
