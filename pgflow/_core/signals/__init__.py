"""The signals layer: pings between waiters and whoever changes what they wait for (see service.py)."""

from .payload import Chunk, End, News
from .sealing import Keyring
from .service import Signals
from .waiters import Outage, PollTicks, Waiter, Waiters

__all__ = ["Chunk", "End", "Keyring", "News", "Outage", "PollTicks", "Signals", "Waiter", "Waiters"]
