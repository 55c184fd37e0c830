"""Free-standing streams: the whole protocol (PUT, POST, GET, HEAD, DELETE) on pgflow's tables.

Each request is one transaction of ``FreeStreams`` (``_core/engine/free_streams.py``); after an append
commits, its stream's key is pinged, and readers waiting on it (long-poll, SSE, here or in any process
of the fleet) look again, as they also do on the slow poll. So a reader never depends on a ping: the
table is the only truth.
"""

from __future__ import annotations

from .free_reads import FreeReads
from .free_writes import FreeWrites
from .http import Receive, Request, Send
from .protocol import Refused


class FreeStreamsHttp(FreeWrites, FreeReads):
    """The handlers: the write path (``free_writes``) and the read path (``free_reads``), on the tables as
    ``free_access`` reaches them; ``long_poll`` seconds a long-poll waits, ``max_body`` bytes an append
    may carry."""

    async def handle(self, request: Request, receive: Receive, send: Send) -> None:
        if request.path in ("", "/"):
            raise Refused(404, "a stream lives at a path: PUT /some/name creates one")
        method = request.method
        if method == "PUT":
            await self.create(request, receive, send)
        elif method == "POST":
            await self.append(request, receive, send)
        elif method in ("GET", "HEAD"):
            await self.read(request, receive, send)
        elif method == "DELETE":
            await self.delete(request, send)
        else:
            raise Refused(405, f"{method} is not a method of a stream: PUT, POST, GET, HEAD, DELETE",
                          {"allow": "PUT, POST, GET, HEAD, DELETE, OPTIONS"})
