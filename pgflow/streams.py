"""The stream functions called from inside a workflow or a step run by a worker.

Writes go to the worker's group-committing writer (``_core/streams/writer.py``); readers use
``WorkflowHandle.stream`` and ``stream_items``.
"""

from __future__ import annotations

from ._core.checks import MAX_CHUNK_BYTES, MAX_KEY_BYTES, check_key, encode_chunk
from ._core.current import from_thread, running
from ._core.execution import Execution

__all__ = ["MAX_CHUNK_BYTES", "MAX_KEY_BYTES", "close_stream", "close_stream_async", "stream_offset",
           "write_stream", "write_stream_async"]


async def write_stream_async(key: str, value: object) -> None:
    """Append a chunk to the workflow's stream ``key``; returns once the chunk is committed."""
    check_key(key)
    written = running("write_stream_async").streams.put(key, encode_chunk(key, value))
    if written is not None:
        await written


async def close_stream_async(key: str) -> None:
    """Close the stream: its readers stop after the chunks written so far."""
    check_key(key)
    await running("close_stream_async").streams.write(key, None)


def write_stream(key: str, value: object) -> None:
    """Sync twin of ``write_stream_async``, for sync workflows and steps."""
    check_key(key)
    _write_from_thread("write_stream", key, encode_chunk(key, value))


def close_stream(key: str) -> None:
    """Sync twin of ``close_stream_async``."""
    check_key(key)
    _write_from_thread("close_stream", key, None)


def stream_offset(key: str) -> int:
    """Inside a step: how many chunks this step call has already committed to ``key``, counting
    its earlier attempts, so a retried step can resume where it stopped instead of repeating itself.
    In the workflow body: how many chunks the stream holds."""
    check_key(key)
    return running("stream_offset").streams.offset(key)


def _write_from_thread(what: str, key: str, value: bytes | None) -> None:
    from_thread(what, _write, key, value)


async def _write(execution: Execution, key: str, value: bytes | None) -> None:
    await execution.streams.write(key, value)
