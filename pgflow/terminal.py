"""What the command line prints for people: stored text escaped, values as cells, tables.

Stored text (ids, names, stream values, error messages, tracebacks) is anyone's, and a terminal acts
on the control characters in what it prints: ESC starts sequences that clear the screen, retitle the
window or write the clipboard (OSC 52), a bare CR overwrites what the line showed. So in what is
printed for people every C0 control, DEL and every C1 control (which some terminals take as ESC
sequences in one character) becomes a visible \\xNN escape. \\n and \\t too: every output here is a
line per record or a table cell, whose layout (its own tabs and newlines) stored text must not forge.
"""

from __future__ import annotations

import os
import sys
from datetime import datetime
from typing import Any, TextIO

import msgspec

_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))} | {
    ord("\n"): "\\n", ord("\t"): "\\t", ord("\r"): "\\r"}
# JSON escapes C0 itself, and msgspec leaves DEL and C1 raw: those can only be inside a string of
# the document, where \u00NN stands for the same character.
_JSON_CONTROLS = {c: f"\\u{c:04x}" for c in range(0x7F, 0xA0)}


def styled(text: str, style: str, stream: TextIO | None = None) -> str:
    """``text`` in an SGR ``style`` ("2" dim, "1" bold, "31" red) when ``stream`` (stdout unless
    given) is a terminal and ``NO_COLOR`` is unset or empty (no-color.org); plain otherwise, for in
    a file or a pipe escape codes are only noise to whoever reads it next."""
    out = sys.stdout if stream is None else stream
    if os.environ.get("NO_COLOR") or not _is_terminal(out):
        return text
    return f"\033[{style}m{text}\033[0m"


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a stand-in without isatty, or a closed stream
        return False


def safe(text: str) -> str:
    return text.translate(_CONTROLS)


def json_text(value: Any) -> str:
    """One JSON document on one line, safe for a terminal."""
    return msgspec.json.encode(value).decode().translate(_JSON_CONTROLS)


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    if isinstance(value, list):
        return safe(",".join(map(str, value)))
    if isinstance(value, datetime):
        return value.isoformat(sep=" ", timespec="milliseconds")
    return safe(str(value))


def table(rows: list[dict[str, Any]], columns: list[str], cells: dict[str, Any] | None = None) -> None:
    """Print ``rows`` as aligned columns; ``cells`` maps a column to its own formatter."""
    shown = [[(cells or {}).get(c, cell)(row[c]) for c in columns] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in shown)]) for i, c in enumerate(columns)]
    print("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())
    for r in shown:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
    if not rows:
        print("(none)")
