"""The SQL of pgflow's notification channel: NOTIFY, LISTEN, the queue's usage, the signal keys, and
the one branch that lets a data statement send its pings with its own commit.

Only the signals layer (``_core/signals``) decides what is sent; this module only says how. Payloads
are opaque text here (sealed by the signals layer before they reach a statement).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, TypedDict

from psycopg import AsyncConnection

from . import arrays, wire
from .database import Port, Session, Sql, quote_identifier


class Pings(NamedTuple):
    """NOTIFY payloads that a data statement sends with its commit: ``payloads[n]`` on ``channels[n]``."""

    channels: Sequence[str]
    payloads: Sequence[str]


NO_PINGS = Pings((), ())


def riding(columns: int, condition: str = "") -> str:
    """The branch a data statement (a SELECT of ``columns`` columns) ends with to send
    ``%(pings)s``, each on its channel in ``%(pings_channels)s``, with its commit: it returns no row,
    and is always run. ``condition`` (SQL over the statement's CTEs) keeps the pings back when it is
    false, for pings that may only go out when every row of the statement was written. A statement
    refused because its pings could not be queued is sent again without them (``Signals.ride``)."""
    nulls = ", ".join(["NULL"] * columns)
    where = f" WHERE {condition}" if condition else ""
    return (f" UNION ALL SELECT {nulls} FROM (SELECT count(pg_notify(x.c, x.p)) AS n FROM"
            f" unnest(%(pings_channels)s::text[], %(pings)s::text[]) AS x(c, p){where}) AS pinged WHERE pinged.n < 0")


class Riding(TypedDict):
    """The parameters of ``riding``'s branch, in a statement's own (``class Starting(New, Riding)``)."""

    pings_channels: wire.Texts
    pings: wire.Texts


def ping_parameters(conn: AsyncConnection[Any], pings: Pings) -> Riding:
    """The parameters of ``riding``'s branch, for a statement on ``conn``. The payloads go as one
    packed binary array: psycopg would dump a text array element by element, escaping every
    character of every payload (seen: a tenth of a stream writer's CPU)."""
    arrays.ready(conn)
    return {"pings_channels": arrays.texts(pings.channels), "pings": arrays.texts(pings.payloads)}


# The statements of the signals layer's own connections (the notifier's checkout, the listener's
# session): they name no table, and run through a Session made over the connection.
class Notifying(NamedTuple):
    channels: arrays.TextArray
    payloads: arrays.TextArray


NOTIFY = Sql("SELECT pg_notify(x.c, x.p) FROM unnest(%s::text[], %s::text[]) AS x(c, p)", row=tuple[None],
             params=Notifying)
QUEUE_USAGE = Sql("SELECT pg_notification_queue_usage()", row=tuple[float])


async def notify(conn: AsyncConnection[Any], pings: Pings) -> None:
    """Send ``pings`` in one transaction (the notifier's flush)."""
    arrays.ready(conn)
    await Session(conn).run(NOTIFY, arrays.texts(pings.channels), arrays.texts(pings.payloads))


async def listen(conn: AsyncConnection[Any], channel: str) -> None:
    # (built for the channel: an identifier is no parameter; a process listens on two)
    await Session(conn).run(Sql(f"LISTEN {quote_identifier(channel)}", row=None))


async def unlisten(conn: AsyncConnection[Any], channel: str) -> None:
    await Session(conn).run(Sql(f"UNLISTEN {quote_identifier(channel)}", row=None))


async def queue_usage(conn: AsyncConnection[Any]) -> float:
    row = await Session(conn).row(QUEUE_USAGE)
    return row[0] if row else 0.0


class SignalKey(NamedTuple):
    """A key of the schema's signal keyring as the server tells it: the seconds until payloads may
    be sealed with it (<= 0: now) and until it stops being accepted (None: no end yet)."""

    id: int
    secret: bytes
    seal_in: float
    accept_for: float | None


# The keys pings may be sealed with or opened by.
SIGNAL_KEYS = Sql(
    "SELECT id, secret, extract(epoch FROM seal_from - now())::float8,"
    " extract(epoch FROM accept_until - now())::float8 FROM {s}.signal_keys"
    " WHERE accept_until IS NULL OR accept_until > now() ORDER BY id", row=SignalKey)
# 32 random bytes from the server's strong random source (gen_random_uuid, PostgreSQL 13 and later,
# needs no extension): two version-4 UUIDs, 244 random bits. The signals layer derives its keys
# from these with a keyed hash, so the fixed bits do not matter.
NEW_SECRET = ("decode(replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex')")
# A rotation of the keyring, in one transaction under its lock: whether the newest key is due for it,
# a new key sealed with after the overlap, the keys before it accepted for a while after that, and the
# keys retired a day ago gone.
class Period(TypedDict):
    period: float


class Overlap(TypedDict):
    overlap: float


class Retiring(Overlap):
    id: int  # the new key: those before it are retired


LOCK_KEYS = Sql("LOCK TABLE {s}.signal_keys IN EXCLUSIVE MODE", row=None)
ROTATION_DUE = Sql(
    "SELECT coalesce(max(seal_from) < now() - make_interval(secs => %(period)s), true)"
    " FROM {s}.signal_keys", row=tuple[bool], params=Period)
NEW_KEY = Sql(
    "INSERT INTO {s}.signal_keys (id, secret, seal_from)"
    " SELECT coalesce(max(id), 0) + 1, " + NEW_SECRET + ","
    "  now() + make_interval(secs => %(overlap)s) FROM {s}.signal_keys RETURNING id", row=tuple[int], params=Overlap)
RETIRE_KEYS = Sql(
    "UPDATE {s}.signal_keys SET accept_until = now() + make_interval(secs => 2 * %(overlap)s::float8)"
    " WHERE id < %(id)s AND (accept_until IS NULL OR accept_until > now() + make_interval("
    "  secs => 2 * %(overlap)s::float8))", row=None, params=Retiring)
FORGET_KEYS = Sql("DELETE FROM {s}.signal_keys WHERE accept_until < now() - interval '1 day'", row=None)


class Channel(Port):
    """The keyring statements of ``Engine`` (which provides the pool and the schema)."""

    async def signal_keys(self) -> list[SignalKey]:
        """The keys pings may be sealed with or opened by; only roles that may read
        ``signal_keys`` get them (PostgreSQL lets any role LISTEN and NOTIFY)."""
        return await self.db.rows(SIGNAL_KEYS)

    async def rotate_signal_key(self, overlap: float) -> int:
        """Add a new key, sealed with from ``overlap`` seconds on, and have the keys before it
        accepted for ``overlap`` seconds after that: every process reloads the keyring within that
        time, so none drops another's pings during the change. Keys retired a day ago go. Returns
        the new key's id."""
        rotated = await self._rotate(overlap, None)
        assert rotated is not None
        return rotated

    async def rotate_signal_key_when_due(self, period: float, overlap: float) -> int | None:
        """``rotate_signal_key`` when the newest key has been sealed with for ``period`` seconds
        (the workers' maintenance asks, however many of them); the new key's id, or None."""
        return await self._rotate(overlap, period)

    async def _rotate(self, overlap: float, period: float | None) -> int | None:
        async with self.db.session() as s, s.transaction():
            await s.run(LOCK_KEYS)
            if period is not None:
                due = await s.row(ROTATION_DUE, period=period)
                if not (due and due[0]):
                    return None
            row = await s.row(NEW_KEY, overlap=overlap)
            assert row is not None
            await s.run(RETIRE_KEYS, overlap=overlap, id=row[0])
            await s.run(FORGET_KEYS)
            return row[0]
