"""The first connection of a runtime: errors that waiting cannot fix become a ConfigurationError
that says what is wrong and what to check, within seconds, instead of a pool that retries for 30 s
and ends in "pool initialization incomplete"."""

from __future__ import annotations

import ipaddress
import os
import re
import urllib.parse
from typing import Any

import psycopg
import psycopg.conninfo
import psycopg.pq

from ..errors import ConfigurationError

CONNECT_TIMEOUT = 3  # seconds, for this first connection only

# What the server or libpq says, and what a user should check.
_EXPLANATIONS = (
    ("password authentication failed", "check the password in the DSN (or PGPASSWORD, ~/.pgpass)"),
    ("no password supplied", "the server wants a password: put it in the DSN, PGPASSWORD or ~/.pgpass"),
    ("does not exist", "check the database and user names in the DSN"),
    ("could not translate host name", "the host name does not resolve: check the DSN's host"),
    ("failed to resolve host", "the host name does not resolve: check the DSN's host"),  # psycopg's own lookup
    ("connection refused", "nothing accepts connections there: is PostgreSQL running, on that port?"),
    ("no such file or directory", "no server socket there: is PostgreSQL running, with that socket directory?"),
    ("timeout expired", f"no answer within {CONNECT_TIMEOUT} s: check the host, the port and any firewall"),
    # pgbouncer refuses the server settings pgflow sends at connect time (``options``) unless it is
    # told to ignore them, which would lose them instead.
    ("unsupported startup parameter", "a pooler (pgbouncer?) refused a connection parameter: when the DSN is a "
     "transaction-mode pooler, pass listen_dsn= (or set PGFLOW_LISTEN_DSN) pointing at the server itself, and "
     "pgflow sends nothing the pooler would refuse or lose (see workers/README.md)"),
)


_URI = re.compile(r"(?i)\s*postgres(?:ql)?://")
# The password of a URI's user info. Greedy, up to the last @: a password with an unencoded @ or / is
# cut short by libpq, whose error then shows the rest as a host or database name, and that rest is
# secret too. Wrong only by hiding more than the password (an @ further on in a URI without one).
_URI_PASSWORD = re.compile(r"(?i)^(\s*postgres(?:ql)?://[^@/:]*:)(.*)(?=@)")
_QUERY_PASSWORD = re.compile(r"(?i)([?&](?:ssl)?password=)([^&#]*)")
# key=value form: a quoted value (escapes allowed, possibly unterminated), or a bare one.
_KEYWORD_PASSWORD = re.compile(r"(?i)(\b(?:ssl)?password\s*=\s*)('(?:[^'\\]|\\.)*'?|[^\s']\S*)")


def redact(dsn: str, text: str | None = None) -> str:
    """``dsn`` with its passwords (``password``, ``sslpassword``) replaced by ``***``, parsable or not;
    or, given ``text`` (a message about ``dsn``, e.g. libpq's, which quotes pieces of a malformed
    DSN), that text with ``dsn`` and every piece of its passwords replaced. Every message or output
    that shows a DSN goes through here, so no log, error or ``--print`` shows a password."""
    redacted, secrets = _redacted(dsn)
    if text is None:
        return redacted
    text = text.replace(dsn, redacted)
    pieces: set[str] = set()
    for secret in secrets:
        for form in (secret, urllib.parse.unquote(secret), secret.strip("'")):
            pieces.add(form)
            pieces.update(re.split(r"[@/]", form))  # where libpq cuts a URI's user info short
    for piece in sorted(pieces - {"", "***"}, key=len, reverse=True):
        text = text.replace(piece, "***")
    return text


def _redacted(dsn: str) -> tuple[str, list[str]]:
    """``dsn`` redacted, and the secrets taken out of it as written (URI user info first)."""
    secrets: list[str] = []

    def hide(match: re.Match[str]) -> str:
        secrets.append(match.group(2))
        return match.group(1) + "***"

    if _URI.match(dsn):
        return _QUERY_PASSWORD.sub(hide, _URI_PASSWORD.sub(hide, dsn, count=1)), secrets
    return _KEYWORD_PASSWORD.sub(hide, dsn), secrets


def where(dsn: str) -> str:
    """Where a DSN points, for messages and logs: host (or socket directory), port and database,
    never a password."""
    try:
        params = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "(unparsable DSN)"
    host = str(params.get("host") or params.get("hostaddr") or "localhost")
    return redact(dsn, f"{host}:{params.get('port') or 5432}/{params.get('dbname') or params.get('user') or ''}")


def on_this_machine(host: str, hostaddr: str, server_addr: str | None) -> bool:
    """Whether the server a connection reaches runs on this machine, and so shares its cores (a
    worker's stream writer then sends writers in step as one batch a round: ``streams/writer.py``).
    ``host`` and ``hostaddr`` are libpq's for the connection: a unix-domain socket (a directory, or
    ``@`` for Linux's abstract namespace) or a loopback address is this machine. ``server_addr`` is the
    address the server itself was reached on (``inet_server_addr()``; None through a unix socket): a
    pooler on this machine passing the connection to a server elsewhere has a remote one there."""
    here = not host or host.startswith(("/", "@")) or _loopback(hostaddr or host)
    return here and (server_addr is None or _loopback(server_addr))


ON_THIS_MACHINE_VARIABLE = "PGFLOW_SERVER_ON_THIS_MACHINE"
_SAID = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False,
         "": None, "auto": None}


def server_on_this_machine_setting(given: bool | None) -> bool | None:
    """The ``server_on_this_machine`` an App is given, else ``$PGFLOW_SERVER_ON_THIS_MACHINE`` (1/0,
    true/false, yes/no, on/off; auto or unset: None, the guess of ``on_this_machine``). Where the server
    runs is a fact of the deployment, not of the code: the variable lets one deployment say it without
    a change of code, and a value it cannot read fails at once rather than leaving the guess in charge.
    Refusals are TypeError and ValueError, which ``App`` (under ``checks.setting_up``) makes
    ConfigurationErrors."""
    if given is not None:
        if not isinstance(given, bool):
            raise TypeError(f"server_on_this_machine is True, False or None (guess), got {given!r}")
        return given
    said = os.environ.get(ON_THIS_MACHINE_VARIABLE, "").strip().lower()
    if said not in _SAID:
        raise ValueError(f"{ON_THIS_MACHINE_VARIABLE} is 1 or 0 (true/false, yes/no, on/off), or auto to"
                                 f" guess, got {os.environ[ON_THIS_MACHINE_VARIABLE]!r}")
    return _SAID[said]


def _loopback(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address == "localhost"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # (::ffff:127.0.0.1)
    return ip.is_loopback


def split_password(dsn: str) -> tuple[str, str | None]:
    """``dsn`` without its password, and the password, for a program (psql) that gets the one on its
    command line, which every local user can read in ``ps``, and the other through its environment."""
    try:
        params = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise _malformed(dsn, exc) from None
    if params.get("sslpassword"):
        raise ConfigurationError("the DSN has an sslpassword, which psql can only get on its command line, "
                                 "where every local user can read it: use `pgflow psql --print --show-password` "
                                 "with a client of your own, or a key without a passphrase")
    password = params.pop("password", None)
    in_uri = _URI_PASSWORD.match(dsn)
    if in_uri and urllib.parse.unquote(in_uri.group(2)) != str(password or ""):
        # libpq cut the password short at an unencoded @ or /, and took the rest for a host or a database.
        raise ConfigurationError(f"the PostgreSQL DSN {redact(dsn)} is malformed: percent-encode any @ and / "
                                 "in its password (%40, %2F)")
    return psycopg.conninfo.make_conninfo("", **params), None if password is None else str(password)


async def check_connectable(dsn: str, query_timeout: float | None = None, *, session: bool = True) -> None:
    """Open and close one connection, or raise ConfigurationError explaining why it cannot be had.
    Given ``query_timeout``, it is sent what pgflow's own connections are (``link_settings``), so
    that a pooler refusing it (``options``) is told apart now, with what to do, too."""
    try:
        settings = {} if query_timeout is None else link_settings(dsn, query_timeout, session=session)
        extra = {"options": settings["options"]} if "options" in settings else {}
        conn = await psycopg.AsyncConnection.connect(dsn, connect_timeout=CONNECT_TIMEOUT, autocommit=True, **extra)
    except (psycopg.ProgrammingError, psycopg.OperationalError) as exc:
        raise unconnectable(dsn, exc) from None
    await conn.close()


def unconnectable(dsn: str, exc: psycopg.Error) -> ConfigurationError:
    """What a failure to connect to ``dsn`` means, and what to check (no password shown)."""
    if isinstance(exc, psycopg.ProgrammingError):
        return _malformed(dsn, exc)
    reason = redact(dsn, _first_line(exc))
    advice = next((hint for words, hint in _EXPLANATIONS if words in reason.lower()), "check the DSN")
    return ConfigurationError(f"cannot connect to PostgreSQL at {where(dsn)}: {reason}; {advice}")


def _malformed(dsn: str, exc: BaseException) -> ConfigurationError:
    return ConfigurationError(f"the PostgreSQL DSN is malformed ({redact(dsn, _first_line(exc))}); it looks "
                              "like postgresql://user:password@host:5432/dbname")


def link_settings(dsn: str, query_timeout: float, *, session: bool = True) -> dict[str, Any]:
    """The connection parameters of every connection pgflow opens: they bound how long a dead link
    goes unnoticed, on both ends. Here: a connect timeout, TCP keepalives and a TCP user timeout
    (a peer that stops acknowledging is given up within about ``query_timeout``). On the server,
    through ``options``: the same for the server's end, and a transaction of pgflow's left idle
    longer than ``query_timeout`` ends, so that a paused or cut-off worker cannot keep its row locks
    (and the workflows under them) past its lease. A parameter the DSN sets itself is left alone.

    The search path is the catalog alone (then pg_temp, last), so nothing another role creates can
    stand in for the built-ins pgflow's statements call. The server-side settings also keep
    pgflow's statements cheap: they are short, index-driven and
    the same on every call (ids, arrays and limits as parameters), so one generic plan suits them,
    while the default re-plans a prepared statement whenever the generic plan's estimate looks worse
    (seen: 0.6 ms of planning for a 0.3 ms claim); and no JIT, which on a big batch spends more on
    compiling than on running (seen: 14 ms for a 2 ms read). Set at connect time, they cost no round
    trip.

    Without ``session`` (a connection to a transaction-mode pooler, whose every transaction may run
    on another server session) the server is sent nothing: a pooler refuses ``options`` or drops
    it, and a setting made on one server session would not follow the next transaction. Those
    settings are then the pooler's to make (``connect_query``, see workers/README.md), and
    ``check_pooled_settings`` says which are missing. The client's end (timeouts, keepalives)
    stays: it is this process's link to the pooler."""
    own = psycopg.conninfo.conninfo_to_dict(dsn)
    seconds = max(2, round(query_timeout))
    settings: dict[str, Any] = {"connect_timeout": seconds, "keepalives": 1,
                                "keepalives_idle": max(1, seconds // 2), "keepalives_interval": 1,
                                "keepalives_count": 3}
    if psycopg.pq.version() >= 120000:  # libpq knows tcp_user_timeout from version 12
        settings["tcp_user_timeout"] = seconds * 1000
    settings = {name: value for name, value in settings.items() if name not in own}
    if not session:
        return settings
    # search_path pinned to the catalog: pgflow names its own tables with their schema, and no object
    # another role created (a function or an operator in a schema on the default path, such as
    # public) can stand in for a built-in one in pgflow's statements.
    server = (f"-c search_path=pg_catalog,pg_temp -c plan_cache_mode=force_generic_plan -c jit=off"
              f" -c idle_in_transaction_session_timeout={round(query_timeout * 1000)}"
              f" -c tcp_keepalives_idle={max(1, seconds // 2)} -c tcp_keepalives_interval=1"
              f" -c tcp_keepalives_count=3 -c tcp_user_timeout={seconds * 1000}")
    settings["options"] = f"{own.get('options') or ''} {server}".strip()
    return settings


def server_settings(query_timeout: float) -> dict[str, str]:
    """What pgflow wants of a server session, as ``SHOW`` spells it (see ``link_settings``)."""
    return {"search_path": "pg_catalog, pg_temp", "jit": "off",
            "idle_in_transaction_session_timeout": f"{round(query_timeout * 1000)}ms"}


def missing_settings(found: dict[str, str], query_timeout: float) -> list[str]:
    """The ``SET`` statements a pooler's ``connect_query`` lacks, given the settings a pooled
    connection ``found`` on its server session (``SHOW``'s spelling, any unit)."""
    wanted = server_settings(query_timeout)
    missing = []
    for name, value in wanted.items():
        have = found.get(name, "")
        if name == "idle_in_transaction_session_timeout":
            ok = 0 < _milliseconds(have) <= _milliseconds(value)
        elif name == "search_path":
            ok = have.replace(" ", "") == value.replace(" ", "")
        else:
            ok = have == value
        if not ok:
            missing.append(f"SET {name} = '{value}'" if name == "search_path" else f"SET {name} = {_bare(value)}")
    return missing


def _milliseconds(text: str) -> float:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|min|h|d)?\s*", text)
    if match is None:
        return 0.0
    factor = {"ms": 1, "s": 1000, "min": 60_000, "h": 3_600_000, "d": 86_400_000}[match.group(2) or "ms"]
    return float(match.group(1)) * factor


def _bare(value: str) -> str:
    return str(round(_milliseconds(value))) if value.endswith("ms") else value


def named(own: str) -> dict[str, str]:
    """The parameter that names a connection of pgflow's (``pgflow-<pid>``, ...) in pg_stat_activity
    and the server's log, unless the user named the application: their DSN's ``application_name``
    (URL or key=value), or ``PGAPPNAME``, is what their monitoring, log filters and per-application
    settings go by, so it is kept. That is libpq's own order for ``fallback_application_name``
    (a service file's name counts too), so pgflow's name is passed as that."""
    return {"fallback_application_name": own}


def users_application_name(dsn: str) -> str | None:
    """The application name the user gave: the DSN's, else ``PGAPPNAME``; None when neither names one
    (an empty name is none, as for libpq)."""
    try:
        own = psycopg.conninfo.conninfo_to_dict(dsn).get("application_name")
    except psycopg.ProgrammingError:
        own = None
    return str(own or os.environ.get("PGAPPNAME") or "") or None


def linked(dsn: str, query_timeout: float) -> str:
    """``dsn`` with ``link_settings``, for connections opened outside the pool."""
    return psycopg.conninfo.make_conninfo(dsn, **link_settings(dsn, query_timeout))


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    # libpq prefixes "connection failed: connection to server at ... failed:"; keep what follows.
    text = lines[0] if lines else type(exc).__name__
    return text.rsplit("failed: ", 1)[-1] if "failed: " in text else text
