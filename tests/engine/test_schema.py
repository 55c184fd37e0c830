"""The ports that keep the store itself: ``migrations`` (``migrate``, ``version``) and ``channel``'s
signal keyring (``signal_keys``, ``rotate_signal_key``, ``rotate_signal_key_when_due``)."""

from __future__ import annotations

import pytest

from pgflow._core.engine import Engine
from pgflow._core.engine.migrations import available

pytestmark = pytest.mark.anyio


class TestMigrations:
    """A store made ready by the factory is at the version of the newest migration shipped; migrating
    it again applies nothing (however many processes ask)."""

    async def test_a_ready_store_is_at_the_newest_version(self, engine: Engine) -> None:
        assert await engine.migrations.version() == max(m.version for m in available())
        assert await engine.migrations.migrate() == []


class TestSignalKeys:
    """The keyring that seals pings: a ready store has a key. ``rotate_signal_key(overlap)`` adds a key
    with a new 32-byte secret and a higher id, sealed with from ``overlap`` seconds on, and has every
    key before it accepted for ``2 * overlap`` more seconds, after which ``signal_keys`` no longer lists
    it. ``rotate_signal_key_when_due(period, overlap)`` rotates only when the newest key has been
    sealed with for ``period`` seconds, and answers the new key's id or None. (The store's keyring is
    shared by every test: these rules hold whatever keys other tests left.)"""

    async def test_keys_retired_and_past_their_acceptance_are_not_listed(self, engine: Engine) -> None:
        first = await engine.channel.rotate_signal_key(0.0)
        second = await engine.channel.rotate_signal_key(0.0)
        ids = [k.id for k in await engine.channel.signal_keys()]
        assert first not in ids and second in ids

    async def test_rotations(self, engine: Engine) -> None:
        # (one test: a key sealed with from a minute on, as the last rotation makes, is the newest for
        # a minute, and a rotation when due waits for it)
        newest = await engine.channel.rotate_signal_key(0.0)
        assert await engine.channel.rotate_signal_key_when_due(3600.0, 0.0) is None
        rotated = await engine.channel.rotate_signal_key_when_due(0.0, 0.0)
        assert rotated is not None and rotated > newest
        before = await engine.channel.signal_keys()
        assert before and all(len(k.secret) == 32 for k in before)
        new = await engine.channel.rotate_signal_key(60.0)
        keys = {k.id: k for k in await engine.channel.signal_keys()}
        assert new > max(k.id for k in before) and len(keys[new].secret) == 32
        assert keys[new].secret not in {k.secret for k in before}
        assert 55.0 < keys[new].seal_in <= 60.0 and keys[new].accept_for is None
        for key in before:
            accept_for = keys[key.id].accept_for
            assert accept_for is not None and accept_for <= 120.0
        assert await engine.channel.rotate_signal_key_when_due(0.0, 0.0) is None  # the newest is not sealed with yet
