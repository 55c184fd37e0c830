"""The signals of one event loop: how news gets from whoever caused it to whoever waits for it.

This process's waiters are woken directly, with no round trip; other processes hear it through the
channel, sealed (``sealing.py``), either riding on the data statement's own commit or sent by the
notifier in a transaction of its own. Either way a ping is a hint: the table is the only truth, every
wait also polls it, and a ping can never be the reason a write fails. A statement refused for its
pings (a full notification queue refuses the commit of any transaction that notified) is sent again
without them, and its news goes to the notifier, which drops what the server refuses.

``Signals.run`` is the service: the notifier, the keyring's reloads, and the listener while something
waits. The runtime that owns it runs it in its task, for as long as the runtime lives.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import psycopg
from psycopg_pool import AsyncConnectionPool

from ..engine import unreachable
from ..engine.channel import NO_PINGS, Pings, SignalKey
from ..registry import Config
from .listener import Listener
from .notifier import QUEUE_FULL, Notifier, Refusals
from .payload import News
from .sealing import Keyring, sealed
from .waiters import Waiters, until

log = logging.getLogger("pgflow.signals")

T = TypeVar("T")
KEYS_EVERY = 30.0  # seconds between reloads of the keyring (a rotation is seen within this)
KEYS_AT_MOST_EVERY = 5.0  # seconds between reloads asked for by payloads sealed with an unknown key


class Signals:
    """News in and out for one event loop's runtime. ``elsewhere`` wakes this App's waiters on the
    process's other loops (their listeners skip this process's payloads); ``alone`` says whether
    this is the App's only loop in the process."""

    def __init__(self, keyring: Keyring, elsewhere: Callable[[News], None], alone: Callable[[], bool]) -> None:
        self.keyring = keyring
        self.waiters = Waiters(on_wait=self._want_listener, on_stream_wait=self._want_streams)
        self.refusals = Refusals()
        self.notifier: Notifier | None = None
        self.listener: Listener | None = None
        self.refused_statements = 0  # statements sent again without their pings
        self._elsewhere = elsewhere
        self._alone = alone
        self._config: Config | None = None
        self._load_keys: Callable[[], Awaitable[list[SignalKey]]] | None = None
        self._listen_wanted = anyio.Event()
        self._keys_wanted = anyio.Event()
        self._listening = False
        self._unsealed_warned = False

    def start(self, config: Config, pool: Callable[[], Awaitable[AsyncConnectionPool[Any]]],
              conninfo: Callable[[], str], load_keys: Callable[[], Awaitable[list[SignalKey]]]) -> None:
        """Configure the service once the runtime's store is open (``run`` then serves it)."""
        self._config = config
        self._load_keys = load_keys
        self.waiters.ticks.every = config.poll_interval
        self.notifier = Notifier(pool, config.notify_interval, self.seal, self.refusals)
        self.listener = Listener(conninfo, (config.channel, config.stream_channel), self.waiters, self.keyring,
                                 config.listen_idle,
                                 query_timeout=config.query_timeout, wants_keys=self._want_keys)

    @property
    def _telling_others(self) -> bool:
        return self._config is not None and self._config.notify != "off"

    # -- telling ----------------------------------------------------------------------------------------

    def seal(self, news: News) -> Pings:
        """The sealed payloads that tell ``news`` to other processes; none while the keyring is
        empty (this role may not read it, or sees no row of it, being unable to write workflows:
        waits elsewhere fall back to their poll)."""
        assert self._config is not None
        pings = sealed(self.keyring, (self._config.channel, self._config.stream_channel), news)
        if pings is None:
            if not self._unsealed_warned:
                self._unsealed_warned = True
                log.warning("no signal key is loaded (only a role that may insert into or update the schema's"
                            " workflows table, and is granted SELECT on its signal_keys, sees them): other"
                            " processes hear of this one's work only on their poll")
            return NO_PINGS
        return pings

    def wake_here(self, news: News) -> None:
        """Wake this process's waiters (on every loop), with no round trip."""
        self.waiters.hear(news)
        self._elsewhere(news)

    def announce(self, news: News) -> None:
        """Wake this process's waiters now, and every other process's within a notifier interval."""
        self.told(news, rode=False)

    def told(self, news: News, rode: bool) -> None:
        """A statement committed ``news`` (``rode``: its pings went out with the commit): wake this
        process's waiters, and have the notifier tell the others what the statement did not."""
        self.wake_here(news)
        if not rode and self._telling_others and self.notifier is not None:
            self.notifier.add(news)

    async def ride(self, news: News, statement: Callable[[Pings], Awaitable[T]], *,
                   when_quiet: bool = False) -> tuple[T, bool]:
        """Run ``statement`` with the payloads of ``news`` riding on its commit; the result, and
        whether they went out with it. With ``when_quiet`` only when no other statement of this
        process carries pings right now (see ``Notifier.may_carry``); never while the server refuses
        notifications. A statement refused with its pings is sent again without them (the error is
        the statement's own when it fails again); a full notification queue, the one refusal that
        NOTIFY itself makes, begins an episode in which no statement carries pings."""
        notifier = self.notifier
        if (not news or not self._telling_others or notifier is None or self.refusals.refusing
                or (when_quiet and not notifier.may_carry())):
            return await statement(NO_PINGS), False
        try:
            pings = self.seal(news)
            if not pings.payloads:
                return await statement(NO_PINGS), False
            try:
                return await statement(pings), True
            except psycopg.Error as exc:
                if unreachable(exc):
                    raise
                result = await statement(NO_PINGS)
                if exc.sqlstate == QUEUE_FULL:  # (not, say, a retried write that its first try had made)
                    self.refused_statements += 1
                    self.refusals.refused(exc)
                return result, False
        finally:
            if when_quiet:
                notifier.carried()

    # -- hearing ----------------------------------------------------------------------------------------

    def hearing(self) -> int | None:
        """While this loop's listener listens, the epoch of what it heard (see ``EndNews``); None
        when it does not, so news may pass it by."""
        listener = self.listener
        if not self._telling_others or listener is None or not listener.connected or not self._alone():
            # (With another loop of this process, that loop may end the workflow, and its news
            # reaches this loop only while something here waits.)
            return None
        return self.waiters.ends.epoch

    async def wait_for(self, keys: list[str], check: Callable[[], Awaitable[T | None]],
                       timeout: float | None) -> T | None:
        """Re-run ``check`` on every ping of ``keys`` and on the slow poll, until it returns a value."""
        with self.waiters.watching(keys) as waiter:
            return await until(waiter, check, timeout, self.waiters.ticks.every)

    def _want_keys(self) -> None:
        self._keys_wanted.set()

    def _want_streams(self) -> None:
        if self.listener is not None:
            self.listener.want_streams()

    def _want_listener(self) -> None:
        if not self._listening:
            self._listening = True
            self._listen_wanted.set()

    # -- the service ------------------------------------------------------------------------------------

    async def run(self) -> None:
        """The notifier, the keyring's reloads, and the listener whenever something waits, until
        cancelled (the notifier then sends what it still holds)."""
        assert self.notifier is not None and self.listener is not None
        async with anyio.create_task_group() as group:
            group.start_soon(self.notifier.run)
            group.start_soon(self._keep_keys)
            while True:
                await self._listen_wanted.wait()
                self._listen_wanted = anyio.Event()
                try:
                    await self.listener.run()  # returns once nothing has waited for a while
                finally:
                    self._listening = False
                    if len(self.waiters):  # somebody began to wait as it closed: listen again
                        self._want_listener()

    async def _keep_keys(self) -> None:
        """Reload the keyring every ``KEYS_EVERY`` seconds, and soon after a payload came sealed
        with a key this process does not know (a rotation is under way)."""
        assert self._load_keys is not None
        while True:
            with anyio.move_on_after(KEYS_EVERY):
                await self._keys_wanted.wait()
                await anyio.sleep(KEYS_AT_MOST_EVERY)
            self._keys_wanted = anyio.Event()
            try:
                self.keyring.load(await self._load_keys())
            except (psycopg.Error, OSError) as exc:
                log.warning("could not reload the signal keys: %s", exc)

    def stats(self) -> dict[str, Any]:
        notifier, listener = self.notifier, self.listener
        return {
            "notify_flushes": notifier.flushes if notifier else 0,
            "notify_failed_flushes": notifier.failed_flushes if notifier else 0,
            "listeners_connected": int(bool(listener and listener.connected)),
            "listener_backends": () if listener is None or listener.backend_pid is None else (listener.backend_pid,),
            "listener_reconnects": listener.reconnects if listener else 0,
            "notification_queue_usage": listener.queue_usage if listener else 0.0,
            "pings_rejected": listener.rejected if listener else 0,
            "pings_refused": self.refused_statements,
            "results_from_pings": self.waiters.ends.taken,
        }
