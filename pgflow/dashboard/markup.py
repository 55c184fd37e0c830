"""Escaped HTML, built from small helpers instead of a template engine.

Everything the dashboard shows from the database (ids, names, arguments, errors, stream chunks) was
written by somebody else's code, so no string reaches a page unescaped: ``Html`` marks markup this
module built, and every other value passes through ``html.escape`` (quotes too, for attributes) on
its way in. A page has no inline script or style (the Content-Security-Policy forbids both), so a
value that slipped through would still not run.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any
from urllib.parse import quote, urlencode


class Html(str):
    """Markup built here: inserted as it is, where any other str is escaped."""

    __slots__ = ()


def esc(value: object) -> Html:
    """``value`` as text in a page: escaped, and kept as it is when it is already ``Html``."""
    if isinstance(value, Html):
        return value
    return Html(html.escape("" if value is None else str(value), quote=True))


def tag(element: str, /, *children: object, **attributes: object) -> Html:
    """``<element attributes>children</element>``; attribute names take ``_`` for ``-`` and drop a trailing
    ``_`` (``class_``); an attribute that is None or False is left out, True stands alone."""
    attrs = []
    for key, value in attributes.items():
        if value is None or value is False:
            continue
        key = key.rstrip("_").replace("_", "-")
        attrs.append(f" {key}" if value is True else f' {key}="{esc(value)}"')
    inner = "".join(esc(child) for child in children if child is not None)
    if element in ("input", "meta", "link", "br"):
        return Html(f"<{element}{''.join(attrs)}>")
    return Html(f"<{element}{''.join(attrs)}>{inner}</{element}>")


def join(parts: Iterable[object]) -> Html:
    return Html("".join(esc(part) for part in parts))


def link(href: str, *children: object, **attributes: object) -> Html:
    return tag("a", *children, href=href, **attributes)


def path(*segments: str, **query: object) -> str:
    """A URL path of the dashboard: each segment percent-encoded (an id may hold '/', '?' or '#'),
    and the query's values that are not None."""
    url = "/" + "/".join(quote(segment, safe="") for segment in segments)
    given = {k: str(v) for k, v in query.items() if v is not None and v != ""}
    return url + ("?" + urlencode(given) if given else "")


def table(headers: list[str], rows: Sequence[Sequence[object]], empty: str = "none", **attributes: object) -> Html:
    if not rows:
        return tag("p", empty, class_="empty", id=attributes.get("id"))
    head = tag("thead", tag("tr", *(tag("th", h) for h in headers)))
    body = tag("tbody", *(tag("tr", *(tag("td", cell) for cell in row)) for row in rows))
    return tag("table", head, body, **attributes)


def status(value: str) -> Html:
    return tag("span", value, class_=f"status status-{value if value.isalpha() else 'other'}")


def when(value: datetime | None) -> Html:
    """A time in UTC, to the millisecond, with its ISO form for machines."""
    if value is None:
        return esc("-")
    return tag("time", value.strftime("%Y-%m-%d %H:%M:%S.") + f"{value.microsecond // 1000:03d}",
               datetime=value.isoformat())


def seconds(value: float | None) -> str:
    """A duration as people read it: 850 ms, 12.4 s, 3 min 5 s, 2 h 10 min, 3 d 4 h."""
    if value is None:
        return "-"
    if value < 0:
        return "-" + seconds(-value)
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 60:
        return f"{value:.1f} s"
    minutes, secs = divmod(int(value), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h"


def count(value: int, cap: int) -> str:
    """A bounded count: at the bound it means "at least"."""
    return f"{cap:,}+" if value >= cap else f"{value:,}"


def shown_value(value: Any, limit: int = 20_000) -> str:
    """A decoded value as indented JSON-like text (bytes as their repr), cut at ``limit`` characters."""
    try:
        text = json.dumps(value, indent=2, ensure_ascii=False, default=_fallback)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"\n... ({len(text) - limit:,} more characters)"


def _fallback(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return f"<{len(value)} bytes: {bytes(value[:64])!r}{'...' if len(value) > 64 else ''}>"
    if isinstance(value, datetime):
        return value.isoformat()
    return repr(value)


def page(title: str, body: object, *, nav: str | None = "", refresh_note: str = "") -> Html:
    """A whole page: the stylesheet and the script are the package's own files, no CDN. ``nav``
    None: no menu (the sign-in page, whose visitor may go nowhere else)."""
    menu = "" if nav is None else tag("nav", link("/", "Overview", class_="active" if nav == "overview" else None),
               link("/workflows", "Workflows", class_="active" if nav == "workflows" else None),
               tag("form", tag("input", name="id", placeholder="workflow id", aria_label="workflow id",
                               required=True),
                   tag("button", "Go", type="submit"), action="/find", method="get", class_="find"))
    return Html("<!doctype html>" + tag(
        "html",
        tag("head", tag("meta", charset="utf-8"),
            tag("meta", name="viewport", content="width=device-width, initial-scale=1"),
            tag("title", f"{title} · pgflow"),
            tag("link", rel="stylesheet", href="/static/dashboard.css"),
            tag("script", src="/static/dashboard.js", defer=True)),
        tag("body", tag("header", tag("strong", "pgflow", class_="brand"), menu),
            tag("main", tag("h1", title), body),
            tag("footer", refresh_note)),
        lang="en"))
