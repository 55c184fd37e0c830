"""The first connection of a runtime: errors that waiting cannot fix become a ConfigurationError
that says what is wrong and what to check, within seconds, instead of a pool that retries for 30 s
and ends in "pool initialization incomplete"."""

from __future__ import annotations

import psycopg
import psycopg.conninfo

from ..errors import ConfigurationError

CONNECT_TIMEOUT = 3  # seconds, for this first connection only

# What the server or libpq says, and what a user should check.
_EXPLANATIONS = (
    ("password authentication failed", "check the password in the DSN (or PGPASSWORD, ~/.pgpass)"),
    ("no password supplied", "the server wants a password: put it in the DSN, PGPASSWORD or ~/.pgpass"),
    ("does not exist", "check the database and user names in the DSN"),
    ("could not translate host name", "the host name does not resolve: check the DSN's host"),
    ("connection refused", "nothing accepts connections there: is PostgreSQL running, on that port?"),
    ("no such file or directory", "no server socket there: is PostgreSQL running, with that socket directory?"),
    ("timeout expired", f"no answer within {CONNECT_TIMEOUT} s: check the host, the port and any firewall"),
)


def where(dsn: str) -> str:
    """Where a DSN points, for messages and logs: host (or socket directory), port and database,
    never a password."""
    try:
        params = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "(unparsable DSN)"
    host = str(params.get("host") or params.get("hostaddr") or "localhost")
    return f"{host}:{params.get('port') or 5432}/{params.get('dbname') or params.get('user') or ''}"


async def check_connectable(dsn: str) -> None:
    """Open and close one connection, or raise ConfigurationError explaining why it cannot be had."""
    try:
        conn = await psycopg.AsyncConnection.connect(dsn, connect_timeout=CONNECT_TIMEOUT, autocommit=True)
    except psycopg.ProgrammingError as exc:
        raise ConfigurationError(f"the PostgreSQL DSN is malformed ({_first_line(exc)}); it looks like "
                                 "postgresql://user:password@host:5432/dbname") from None
    except psycopg.OperationalError as exc:
        reason = _first_line(exc)
        advice = next((hint for words, hint in _EXPLANATIONS if words in reason.lower()), "check the DSN")
        raise ConfigurationError(f"cannot connect to PostgreSQL at {where(dsn)}: {reason}; {advice}") from None
    await conn.close()


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    # libpq prefixes "connection failed: connection to server at ... failed:"; keep what follows.
    text = lines[0] if lines else type(exc).__name__
    return text.rsplit("failed: ", 1)[-1] if "failed: " in text else text
