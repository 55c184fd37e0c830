"""Who may see the dashboard and act through it.

- **A token** (``--token`` / ``PGFLOW_DASHBOARD_TOKEN``), when set, is asked of every request but the
  static files and the login form: as ``Authorization: Bearer <token>`` (scripts, a proxy that adds
  it) or as the session cookie the login form sets. Both are compared in constant time, on digests
  of equal length. The cookie holds an HMAC of the token, not the token: changing the token ends
  every session.
- **Cross-site requests.** Any page on the web can make a browser send a POST here, cookies and all.
  So a POST must carry the CSRF token of this browser (an HMAC, under a key of this process, of a
  random cookie that other sites can neither read nor set: HttpOnly, SameSite=Strict), and its
  Origin, when the browser sends one (they all do on a POST), must be this server's own host.
- **Headers.** Every answer forbids framing, inline script and style, other origins' resources,
  sniffing and caching: the pages show other people's data.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import urlsplit

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

SESSION_COOKIE = "pgflow_dashboard_session"
CSRF_COOKIE = "pgflow_dashboard_csrf"
OPEN_PATHS = ("/static/", "/login")  # reachable without the token: the login form needs its stylesheet
SECURITY_HEADERS = [
    (b"content-security-policy", b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self';"
                                 b" connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),  # no-referrer would make Chromium send "Origin: null"
    (b"cache-control", b"no-store"),
]


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()


def same(given: str, expected: str) -> bool:
    """Constant time for any two strings: the digests compared have the same length."""
    return hmac.compare_digest(_digest(given), _digest(expected))


class Access:
    """The token, the session cookie and the CSRF key of one dashboard process."""

    def __init__(self, token: str | None) -> None:
        if token is not None and len(token) < 16:
            raise ValueError("the dashboard token must be at least 16 characters long: make one with"
                             " python -c 'import secrets; print(secrets.token_urlsafe(24))'")
        self.token = token
        self._csrf_key = secrets.token_bytes(32)

    def session_value(self) -> str:
        assert self.token is not None
        return hmac.new(self.token.encode(), b"pgflow-dashboard-session", hashlib.sha256).hexdigest()

    def allowed(self, headers: dict[str, str], cookies: dict[str, str]) -> bool:
        if self.token is None:
            return True
        scheme, _, credential = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and credential and same(credential.strip(), self.token):
            return True
        session = cookies.get(SESSION_COOKIE)
        return session is not None and same(session, self.session_value())

    def login(self, given: str) -> bool:
        return self.token is not None and same(given, self.token)

    def csrf_token(self, cookie: str) -> str:
        return hmac.new(self._csrf_key, cookie.encode(), hashlib.sha256).hexdigest()

    def csrf_ok(self, cookie: str | None, given: str) -> bool:
        return bool(cookie) and bool(given) and same(given, self.csrf_token(cookie or ""))


def same_origin(headers: dict[str, str]) -> bool:
    """Whether a POST comes from a page of this server: its Origin (sent by browsers on every POST)
    names the host it was sent to, and Sec-Fetch-Site, where sent, says so too. A client that sends
    neither (curl, a script) is no browser that another site could drive; it still needs the token
    and, for an action, the CSRF token."""
    site = headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        return False
    origin = headers.get("origin")
    if origin is None:
        return True
    if origin == "null":
        return False
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and bool(parts.netloc) and parts.netloc == headers.get("host")


def parse_cookies(header: str) -> dict[str, str]:
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(header)
    except Exception:  # noqa: BLE001 - a garbled Cookie header is a client's mistake: no cookies
        return {}
    return {name: morsel.value for name, morsel in jar.items()}


def cookie_header(name: str, value: str, secure: bool, max_age: int | None = None) -> bytes:
    parts = [f"{name}={value}", "Path=/", "HttpOnly", "SameSite=Strict"]
    if secure:
        parts.append("Secure")
    if max_age is not None:
        parts.append(f"Max-Age={max_age}")
    return "; ".join(parts).encode()


class Guard:
    """ASGI middleware: the token before anything else, a CSRF cookie for every browser, and the
    security headers on every answer. ``refuse(scope)`` makes the answer to a request without the
    token (the login form for a page, a bare 401 for anything else)."""

    def __init__(self, app: ASGIApp, access: Access,
                 refuse: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app
        self.access = access
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        cookies = parse_cookies(headers.get("cookie", ""))
        secure = scope.get("scheme") == "https"
        new_csrf = None
        if not cookies.get(CSRF_COOKIE):
            new_csrf = secrets.token_urlsafe(24)
        scope["pgflow.csrf_cookie"] = cookies.get(CSRF_COOKIE) or new_csrf
        scope["pgflow.cookies"] = cookies

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra = list(SECURITY_HEADERS)
                if new_csrf is not None:
                    extra.append((b"set-cookie", cookie_header(CSRF_COOKIE, new_csrf, secure)))
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        path: str = scope.get("path", "")
        if not path.startswith(OPEN_PATHS) and not self.access.allowed(headers, cookies):
            await self.refuse(scope, receive, send_with_headers)
            return
        await self.app(scope, receive, send_with_headers)
