"""What a stream key, offset and chunk may be: checked before anything is queued or batched, so one
bad value fails its own caller and never a batch shared with others."""

from __future__ import annotations

from ... import codec

MAX_CHUNK_BYTES = 8 * 1024 * 1024
MAX_KEY_BYTES = 256


def check_text(value: object, what: str, limit: int) -> str:
    """A non-empty str that PostgreSQL can store (no NUL, no lone surrogate) within ``limit`` bytes."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} is a non-empty string, got {value!r}")
    try:
        size = len(value.encode())
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} must be valid Unicode text (it holds a lone surrogate): {value!r}") from exc
    if "\x00" in value:
        raise ValueError(f"{what} must not contain NUL characters: {value!r}")
    if size > limit:
        raise ValueError(f"{what} is at most {limit} bytes, got {size}")
    return value


def check_key(key: str) -> None:
    check_text(key, "a stream key", MAX_KEY_BYTES)


def check_reader(key: str, offset: int) -> None:
    check_key(key)
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise ValueError(f"a stream offset is a position >= 0, got {offset!r}")


def encode_chunk(key: str, value: object) -> bytes:
    data = codec.encode(value, f"a chunk of stream {key!r}")
    if len(data) > MAX_CHUNK_BYTES:
        raise ValueError(
            f"a chunk of stream {key!r} is {len(data)} bytes encoded; the limit is {MAX_CHUNK_BYTES}. "
            "Split it into several chunks."
        )
    return data
