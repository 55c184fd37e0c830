"""What this process knows of the free-standing streams it appended to: the state it last committed to
each (or read of it under its lock), so that the next batch of appends to them is judged before any
round trip, and sent whole in one (``FreeAppends.append_many``).

Nothing here is trusted: the batch's statement writes only if every stream and producer it names is,
under its lock, exactly as it was judged on (``APPEND_MANY``'s check; a row that another process
changed, an expired or deleted stream, a stream made anew at the path, all fail it), and otherwise
writes nothing, and the batch is judged again on what its locks read. A stream whose state was found
changed by someone else is left to that locked path for a while (``CONTENDED``): a stream two
processes append to would otherwise cost every batch a failed try.
"""

from __future__ import annotations

import time

from .free_judging import Append, Batch
from .free_rows import FreeStream

MOST = 10_000  # streams known, at most (the ones appended to longest ago are forgotten first)
CONTENDED = 10.0  # seconds a stream found changed by another process goes the locked way


class Known:
    """The state of streams this process appended to: by path, the stream, and the state of each of
    its producers seen (``None``: known to have written nothing to it)."""

    def __init__(self, most: int = MOST) -> None:
        self._most = most
        self._streams: dict[str, tuple[FreeStream, dict[str, tuple[int, int] | None]]] = {}
        self._contended: dict[str, float] = {}

    def batch(self, appends: list[Append]) -> Batch | None:
        """The batch judged on what is known, when every stream the appends name and every producer
        they name on it is known (and none is contended); else None."""
        streams: dict[str, FreeStream] = {}
        states: dict[tuple[int, str], tuple[int, int]] = {}
        now = time.monotonic()
        for append in appends:
            known = self._streams.get(append.path)
            if known is None or self._contended.get(append.path, 0.0) > now:
                return None
            stream, producers = known
            streams[append.path] = stream
            if append.producer is not None:
                if append.producer.id not in producers:
                    return None
                state = producers[append.producer.id]
                if state is not None:
                    states[(stream.id, append.producer.id)] = state
        return Batch(streams, states)

    def learn(self, appends: list[Append], batch: Batch) -> None:
        """``batch`` committed: its streams and producers as it left them."""
        for path in {append.path for append in appends} - set(batch.streams):
            self._streams.pop(path, None)  # (none there, or expired and deleted)
        for path, stream in batch.streams.items():
            known = self._streams.pop(path, None)
            if stream.deleted:
                continue
            producers = known[1] if known is not None and known[0].id == stream.id else {}
            for stream_id, producer in batch.named:
                if stream_id == stream.id:
                    producers[producer] = batch.states.get((stream_id, producer))
            self._streams[path] = (stream, producers)  # (last: the most recently appended to)
        while len(self._streams) > self._most:
            del self._streams[next(iter(self._streams))]

    def forget(self, paths: set[str]) -> None:
        for path in paths:
            self._streams.pop(path, None)

    def contend(self, paths: set[str]) -> None:
        """These streams were found changed by another process: the locked way for a while."""
        until = time.monotonic() + CONTENDED
        for path in paths:
            self._contended[path] = until
            self._streams.pop(path, None)
        if len(self._contended) > self._most:
            now = time.monotonic()
            self._contended = {path: t for path, t in self._contended.items() if t > now}

    def differs(self, stream: FreeStream, expired: bool) -> bool:
        """Whether ``stream``, read under its lock, is not what is known of its path."""
        known = self._streams.get(stream.path)
        return known is None or expired or known[0] != stream
