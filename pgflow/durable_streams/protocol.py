"""The Durable Streams protocol's vocabulary: header names, offsets, cursors, and the checks of what a
client sends. Everything here is pure (no I/O), so each rule is tested and reused by both kinds of
stream; a check that fails raises ``Refused`` with the protocol's status and a message for people.
"""

from __future__ import annotations

import random
import re
import time
from datetime import UTC, datetime

import msgspec

NEXT_OFFSET = "stream-next-offset"
UP_TO_DATE = "stream-up-to-date"
CLOSED = "stream-closed"
CURSOR = "stream-cursor"
TTL = "stream-ttl"
EXPIRES_AT = "stream-expires-at"
SEQ = "stream-seq"
FORKED_FROM = "stream-forked-from"
FORK_OFFSET = "stream-fork-offset"
FORK_SUB_OFFSET = "stream-fork-sub-offset"
PRODUCER_ID = "producer-id"
PRODUCER_EPOCH = "producer-epoch"
PRODUCER_SEQ = "producer-seq"
EXPECTED_SEQ = "producer-expected-seq"
RECEIVED_SEQ = "producer-received-seq"
SSE_ENCODING = "stream-sse-data-encoding"

MAX_SAFE = 2**53 - 1  # producer epochs and seqs: JavaScript's exact integers
MAX_POSITION = 2**62  # no stream grows past it (bigint, with room for sums)
MAX_TTL = 10 * 365 * 24 * 3600  # seconds: ten years
MAX_MESSAGES = 10_000  # JSON messages in one request (each a row: a bound on one transaction's work)
MAX_TEXT_HEADER = 1024  # characters of a producer id, a Stream-Seq, a content type
OFFSET_WIDTH = 16
_OFFSET = re.compile(r"[0-9]{1,19}_[0-9]{1,19}")
_DECIMAL = re.compile(r"0|[1-9][0-9]{0,18}")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
CURSOR_EPOCH = 1728432000  # 2024-10-09T00:00:00Z, the protocol's default
CURSOR_INTERVAL = 20  # seconds


class Refused(Exception):  # noqa: N818 - a refusal is an answer, not a fault
    """An answer other than success: ``status``, a message, and headers to send with it."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


def offset_text(position: int) -> str:
    """A position as the offset clients see: fixed width, so offsets sort as text as they do as numbers
    (the reference server's shape, ``read-seq_position``, which clients and tests know)."""
    return f"{0:0{OFFSET_WIDTH}d}_{position:0{OFFSET_WIDTH}d}"


def parse_offset(text: str, *, what: str = "offset") -> int:
    """A position from an offset this server gave out; ``Refused`` (400) for anything else."""
    if not _OFFSET.fullmatch(text):
        raise Refused(400, f"{what} {text[:40]!r} is not an offset this server gave out: use -1 (the start), now"
                           " (the tail), or a Stream-Next-Offset")
    position = int(text.partition("_")[2])
    if position > MAX_POSITION:
        raise Refused(400, f"{what} is past any stream's end")
    return position


def check_read(offset: str | None, live: str | None) -> None:
    """A read's ``offset`` and ``live`` query parameters, as any stream takes them (a free stream's
    and a workflow's alike): live is long-poll or sse, and needs an offset; an offset is never empty."""
    if live not in (None, "long-poll", "sse"):
        raise Refused(400, "live is long-poll or sse")
    if offset == "":
        raise Refused(400, "offset is empty: give -1, now, or a Stream-Next-Offset")
    if live is not None and offset is None:
        raise Refused(400, f"live={live} needs an offset (-1 for the start, now for the tail)")


def cursor(client: str | None) -> str:
    """The live answers' cursor (PROTOCOL.md 10.1): the 20-second interval since the epoch, and never at
    or below the one the client echoed (jitter of 1 to 3600 s then), so a CDN's key always moves on."""
    now = (int(time.time()) - CURSOR_EPOCH) // CURSOR_INTERVAL
    if client is not None and _DECIMAL.fullmatch(client):
        echoed = int(client)
        if echoed >= now:
            return str(echoed + max(1, random.randint(1, 3600) // CURSOR_INTERVAL))  # noqa: S311 - not a secret
    return str(now)


def decimal(text: str, name: str, limit: int) -> int:
    """A non-negative decimal integer without sign, leading zero or exponent, at most ``limit``."""
    text = text.strip()
    if not _DECIMAL.fullmatch(text) or int(text) > limit:
        raise Refused(400, f"{name} is a non-negative integer in decimal (no sign, leading zero, point or"
                           f" exponent) up to {limit}, got {text[:40]!r}")
    return int(text)


def expiry(headers: dict[str, str]) -> tuple[int | None, datetime | None]:
    """Stream-TTL and Stream-Expires-At, checked; not both."""
    ttl_text, at_text = headers.get(TTL), headers.get(EXPIRES_AT)
    if ttl_text is not None and at_text is not None:
        raise Refused(400, "give Stream-TTL or Stream-Expires-At, not both")
    ttl = decimal(ttl_text, "Stream-TTL", MAX_TTL) if ttl_text is not None else None
    at = None
    if at_text is not None:
        try:
            at = datetime.fromisoformat(at_text.strip())
        except ValueError:
            raise Refused(400, f"Stream-Expires-At is an RFC 3339 time, got {at_text[:60]!r}") from None
        if at.tzinfo is None or not re.fullmatch(r"\d{4}-\d\d-\d\d[Tt ]\d\d:\d\d:\d\d(\.\d+)?([Zz]|[+-]\d\d:\d\d)",
                                                 at_text.strip()):
            raise Refused(400, f"Stream-Expires-At is an RFC 3339 time with its offset, got {at_text[:60]!r}")
        at = at.astimezone(UTC)
    return ttl, at


def http_time(at: datetime) -> str:
    return at.astimezone(UTC).isoformat().replace("+00:00", "Z")


def closing(headers: dict[str, str]) -> bool:
    """Stream-Closed counts only as exactly "true", in any case; anything else is as if absent."""
    return headers.get(CLOSED, "").strip().lower() == "true"


def content_type(value: str | None) -> str | None:
    """A Content-Type as sent, checked to be a media type (type/subtype[; params]); None when absent."""
    if value is None:
        return None
    value = value.strip()
    kind, _, _ = value.partition(";")
    major, slash, minor = kind.strip().partition("/")
    if len(value) > MAX_TEXT_HEADER or not slash or not _TOKEN.fullmatch(major) or not _TOKEN.fullmatch(minor):
        raise Refused(400, f"Content-Type is a media type such as application/json, got {value[:60]!r}")
    return value


def is_json(media: str) -> bool:
    return media.split(";", 1)[0].strip().lower() == "application/json"


def is_text(media: str) -> bool:
    base = media.split(";", 1)[0].strip().lower()
    return base.startswith("text/") or base == "application/json"


def json_messages(body: bytes, *, allow_empty: bool) -> list[bytes]:
    """A JSON body's messages: one level of array flattened (PROTOCOL.md 9.1), each as its own text.
    An empty array is a 400 on append and nothing on create."""
    try:
        value = msgspec.json.decode(body, type=msgspec.Raw)
        if body.lstrip()[:1] != b"[":
            return [bytes(value)]
        items = msgspec.json.decode(body, type=list[msgspec.Raw])
    except msgspec.DecodeError as exc:
        raise Refused(400, f"the body is not valid JSON: {exc}") from None
    if not items and not allow_empty:
        raise Refused(400, "an empty JSON array appends nothing: send at least one message")
    if len(items) > MAX_MESSAGES:
        raise Refused(413, f"{len(items)} JSON messages in one request: at most {MAX_MESSAGES}, split them")
    return [bytes(item) for item in items]


def text_header(headers: dict[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is not None and (len(value) > MAX_TEXT_HEADER or not value.isprintable()):
        raise Refused(400, f"{name} is printable text of at most {MAX_TEXT_HEADER} characters")
    return value
