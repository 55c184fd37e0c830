"""Who may see the dashboard and act through it.

- **The Host header** is checked before anything else: a page on the web whose DNS name is turned to
  127.0.0.1 (DNS rebinding) is same-origin with the dashboard in its visitor's browser, but its
  requests still carry its own name as Host. So only loopback names, the address the server binds
  and the hosts the operator names (``allowed_hosts``) are answered; any other gets a 421.
- **A token** (``PGFLOW_DASHBOARD_TOKEN``, ``--token-file``), when set, is asked of every request but
  the static files and the login form: as ``Authorization: Bearer <token>`` (scripts, a proxy that adds
  it) or as the session cookie the login form sets. The token is compared in constant time, on digests
  of equal length. The cookie holds a random session id that this process keeps in memory with its
  expiry (under an HMAC of the token: changing the token, which restarts the process, ends every
  session): logout forgets it, so a copied cookie dies with the session. Wrong tokens are bounded per
  client address, since each one is a guess.
- **Cross-site requests.** Any page on the web can make a browser send a POST here, cookies and all.
  So a POST must carry the CSRF token of this browser (an HMAC, under a key of this process, of a
  random cookie that other sites can neither read nor set: HttpOnly, SameSite=Strict), and its
  Origin, when the browser sends one (they all do on a POST), must be this server's own host.
- **Bounds.** Live answers (Server-Sent Events) hold a connection each: at most ``max_live`` at once
  per process, a 503 beyond.
- **Headers.** Every answer forbids framing, inline script and style, other origins' resources,
  sniffing and caching: the pages show other people's data.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
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
LIVE_PATHS = ("/live/",)  # answers that stay open (Server-Sent Events)
SESSION_HOURS = 12.0
MAX_SESSION_HOURS = 24.0 * 366
MAX_SESSIONS = 10_000  # signed-in browsers kept at once; past it the one that expires first goes
MAX_LIVE = 100  # live answers open at once in one process
LOGIN_FAILURES, LOGIN_WINDOW = 10, 60.0  # wrong tokens one client address may send per window (seconds)
MAX_CLIENTS = 10_000  # client addresses whose wrong tokens are remembered
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
WILDCARDS = frozenset({"", "0.0.0.0", "::"})  # noqa: S104 - names of "every address", not a bind
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


# -- the Host header -----------------------------------------------------------------------------------------

_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-._")
_IPV6_CHARS = frozenset("0123456789abcdef:.")


def split_host(text: str) -> tuple[str, str] | None:
    """(name, port) of a Host header or an ``allowed_hosts`` entry, the name lowercased without a
    trailing dot, the port "" when not given; None when it is not a host at all (so nothing odd is
    ever compared, or echoed in an answer)."""
    text = text.strip().lower()
    if text.startswith("["):
        name, bracket, port = text[1:].partition("]")
        if not bracket or not name or not set(name) <= _IPV6_CHARS or (port and not port.startswith(":")):
            return None
        port = port[1:] if port else ""
    else:
        name, _, port = text.partition(":")
        name = name.removesuffix(".")
        if not name or not set(name) <= _NAME_CHARS or ":" in port:
            return None
    if port and not (port.isascii() and port.isdigit() and len(port) <= 5):
        return None
    return name, port


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def is_loopback(name: str) -> bool:
    ip = _ip(name)
    return name in LOOPBACK_NAMES if ip is None else ip.is_loopback


class Hosts:
    """The names this dashboard answers to: loopback names (any port), the address it binds when that
    is not loopback, and the operator's ``allowed`` ("name" for any port, "name:port" for that one).
    Bound to every address (0.0.0.0, ::), it also answers to any IP literal: a browser sends an IP as
    Host only to a page whose origin is that IP, so no rebinding page can; names must be allowed."""

    def __init__(self, allowed: Iterable[str] = (), bind: str | None = None) -> None:
        self.entries: set[tuple[str, str]] = set()
        for entry in allowed:
            parsed = split_host(entry)
            if parsed is None or not entry.strip():
                raise ValueError(f"not a host name: {entry[:80]!r} (allowed hosts are names such as"
                                 " dash.example.com, dash.example.com:8443 or 10.0.0.5)")
            self.entries.add(parsed)
        self.any_ip = bind is not None and bind.strip("[]") in WILDCARDS
        if bind is not None and not self.any_ip and not is_loopback(bind.strip("[]")):
            self.entries.add((bind.strip("[]").lower(), ""))

    def refusal(self, header: str | None) -> tuple[int, str] | None:
        """None when ``header`` names this dashboard, else the status and one line saying why not."""
        parsed = split_host(header) if header else None
        if parsed is None:
            return 400, "this request has no Host header this dashboard can read"
        name, port = parsed
        if is_loopback(name) or (name, "") in self.entries or (name, port) in self.entries:
            return None
        if self.any_ip and _ip(name) is not None:
            return None
        return 421, (f"this dashboard does not answer to the host {name!r}: if that name is yours, start it"
                     " with --allowed-host (or PGFLOW_DASHBOARD_ALLOWED_HOSTS)")


# -- the token and the sessions ------------------------------------------------------------------------------


class Attempts:
    """Wrong tokens per client address over a sliding window: past ``LOGIN_FAILURES`` in
    ``LOGIN_WINDOW`` seconds a client is refused (429) until the oldest one leaves the window."""

    def __init__(self, limit: int = LOGIN_FAILURES, window: float = LOGIN_WINDOW) -> None:
        self.limit, self.window = limit, window
        self._failures: dict[str, deque[float]] = {}

    def _recent(self, client: str, now: float) -> deque[float]:
        times = self._failures.get(client, deque())
        while times and times[0] <= now - self.window:
            times.popleft()
        return times

    def blocked(self, client: str) -> float:
        """Seconds until ``client`` may try again; 0 when it may now."""
        now = time.monotonic()
        times = self._recent(client, now)
        if len(times) < self.limit:
            return 0.0
        return max(1.0, times[0] + self.window - now)

    def failed(self, client: str) -> None:
        now = time.monotonic()
        if client not in self._failures and len(self._failures) >= MAX_CLIENTS:
            self._forget(now)
        times = self._recent(client, now)
        times.append(now)
        self._failures[client] = times

    def _forget(self, now: float) -> None:
        """Keep the table bounded: drop the clients with nothing left in the window, else the oldest."""
        for client in [c for c, t in self._failures.items() if not t or t[-1] <= now - self.window]:
            del self._failures[client]
        while len(self._failures) >= MAX_CLIENTS:
            del self._failures[next(iter(self._failures))]


class Access:
    """The token, the sessions and the CSRF key of one dashboard process."""

    def __init__(self, token: str | None, session_hours: float = SESSION_HOURS) -> None:
        if token is not None and len(token) < 16:
            raise ValueError("the dashboard token must be at least 16 characters long: make one with"
                             " python -c 'import secrets; print(secrets.token_urlsafe(24))'")
        if not (math.isfinite(session_hours) and 0 < session_hours <= MAX_SESSION_HOURS):
            raise ValueError(f"session hours are more than 0 and at most {MAX_SESSION_HOURS:g},"
                             f" got {session_hours!r}")
        self.token = token
        self.session_seconds = session_hours * 3600.0
        self._csrf_key = secrets.token_bytes(32)
        self._sessions: dict[bytes, float] = {}  # the session id's HMAC under the token -> expiry (monotonic)
        self.attempts = Attempts()

    def _key(self, session: str) -> bytes:
        """What the session is kept under: an id is only good with the token it was made under, and
        a lookup compares digests, never the id itself."""
        assert self.token is not None
        return hmac.new(self.token.encode(), session.encode("utf-8", "surrogateescape"), hashlib.sha256).digest()

    def start_session(self) -> str:
        """A new random session id, good for ``session_hours``."""
        now = time.monotonic()
        if len(self._sessions) >= MAX_SESSIONS:
            for key in [k for k, until in self._sessions.items() if until <= now]:
                del self._sessions[key]
            while len(self._sessions) >= MAX_SESSIONS:
                del self._sessions[min(self._sessions, key=self._sessions.__getitem__)]
        session = secrets.token_urlsafe(32)
        self._sessions[self._key(session)] = now + self.session_seconds
        return session

    def end_session(self, session: str | None) -> None:
        if session and self.token is not None:
            self._sessions.pop(self._key(session), None)

    def session_ok(self, session: str | None) -> bool:
        if not session or self.token is None:
            return False
        key = self._key(session)
        until = self._sessions.get(key)
        if until is None:
            return False
        if until <= time.monotonic():
            del self._sessions[key]
            return False
        return True

    def bearer(self, headers: dict[str, str]) -> str | None:
        """The credential of an ``Authorization: Bearer`` header, if the request sent one."""
        scheme, _, credential = headers.get("authorization", "").partition(" ")
        return credential.strip() if scheme.lower() == "bearer" and credential.strip() else None

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


def client_of(scope: Scope) -> str:
    """The client's address (behind a proxy uvicorn trusts, the one it forwarded)."""
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


async def plain(send: Send, status: int, text: str, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """A one-line text answer, sent before any route (so before anything is read from the database)."""
    body = (text + "\n").encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """ASGI middleware: the Host header, then the token, a CSRF cookie for every browser, the bound
    on live answers, and the security headers on every answer. ``refuse(scope)`` makes the answer to a
    request without the token (the login form for a page, a bare 401 for anything else)."""

    def __init__(self, app: ASGIApp, access: Access, hosts: Hosts,
                 refuse: Callable[[Scope, Receive, Send], Awaitable[None]], max_live: int = MAX_LIVE) -> None:
        self.app = app
        self.access = access
        self.hosts = hosts
        self.refuse = refuse
        self.max_live = max_live
        self.live = 0  # live answers open now (one event loop: no lock needed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refused = self.hosts.refusal(headers.get("host"))
        if refused is not None:
            await plain(send, *refused, SECURITY_HEADERS)
            return
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
        if not path.startswith(OPEN_PATHS):
            wait = self._signed_in(scope, headers, cookies)
            if wait is None:
                await self.refuse(scope, receive, send_with_headers)
                return
            if wait > 0:
                await plain(send_with_headers, 429, "too many wrong tokens from this address: try again later",
                            [(b"retry-after", str(math.ceil(wait)).encode())])
                return
        if path.startswith(LIVE_PATHS):
            await self._live(scope, receive, send_with_headers)
            return
        await self.app(scope, receive, send_with_headers)

    def _signed_in(self, scope: Scope, headers: dict[str, str], cookies: dict[str, str]) -> float | None:
        """0 when the request may go on; None when it lacks the token; the seconds to wait when its
        client has sent too many wrong ones (a bearer header is a guess like a login form's)."""
        if self.access.token is None or self.access.session_ok(cookies.get(SESSION_COOKIE)):
            return 0.0
        credential = self.access.bearer(headers)
        if credential is None:
            return None
        client = client_of(scope)
        wait = self.access.attempts.blocked(client)
        if wait > 0:
            return wait
        if self.access.login(credential):
            return 0.0
        self.access.attempts.failed(client)
        return None

    async def _live(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A live answer holds its connection until the client leaves: bounded per process, so that
        open pages (or one client opening them in a loop) cannot take every socket and task."""
        if self.live >= self.max_live:
            await plain(send, 503, f"this dashboard serves {self.max_live} live connections at most: try again"
                                   " later", [(b"retry-after", b"5")])
            return
        self.live += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.live -= 1
