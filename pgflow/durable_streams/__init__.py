"""Durable Streams (the open HTTP protocol for append-only, offset-addressed streams) on pgflow's tables.

``asgi_app(app)`` is the server (``pgflow streams serve`` runs it with uvicorn): a workflow's stream
at ``/workflows/{workflow_id}/{key}``, read-only, in JSON mode; a free-standing stream at every other
path, with the whole protocol. ``read_free_stream_async`` reads a free-standing stream from Python
(from a step, say), waiting for more as the server's own readers do.
"""

from .reading import read_free_stream, read_free_stream_async
from .server import StreamsApp, asgi_app

__all__ = ["StreamsApp", "asgi_app", "read_free_stream", "read_free_stream_async"]
