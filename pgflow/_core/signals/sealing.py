"""Sealed payloads: what goes on pgflow's channels is authenticated and encrypted, because PostgreSQL
lets every role that can connect LISTEN and NOTIFY on them.

The schema's keyring (table ``signal_keys``: only roles that may write pgflow's tables see its rows,
migration 0027) holds 32-byte secrets. A payload is AES-256-GCM under a key that is the sender's own:
a keyed BLAKE2b of a random 16-byte ``sender`` id under the secret. The sender is drawn once per App
in each process, and again in a process forked from it (``forks.py``): a child that sealed with its
parent's sender and counter would reuse its nonces. The nonce is a counter of that sender, so no
(key, nonce) pair is ever used twice, however many payloads a fleet sends (random 96-bit nonces under
one shared key would wear out after about 2**32 of them). The channel's name is the additional data:
a payload opens only on the channel it was sealed for, so one of another schema does not open, nor a
stream payload sent again on the main channel (where every worker would open it).

What a listener believes of a payload is bounded: each listener remembers, per sender, the counters
it took (``Replays``), so a payload recorded and sent again, any number of times, opens once.

On the wire: ``2`` (the format's version), then base64 of: the key's id modulo 2**16 (2 bytes: the
ids in use at once are a handful, so they never collide there), the sender (16), the counter (8), and
the ciphertext with its 16-byte tag. The plaintext is padded to one of a few sizes (``SIZES``), so a
listener cannot tell a 1-byte token from a 64-byte one by a payload's length. Nothing else is
readable: not the keys it names, not the values it carries, not its sender's process.

A payload that does not open (a forgery, garbage, a replay, a key this process no longer or not yet
accepts) is dropped and counted; one sealed with a key id this process does not know asks for a
reload of the keyring (a rotation under way).
"""

from __future__ import annotations

import binascii
import hashlib
import itertools
import os
import secrets
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .. import forks
from ..engine.channel import Pings, SignalKey
from . import payload
from .payload import News

VERSION = "2"
_HEADER = struct.Struct(">H16sQ")  # key id (modulo 2**16), sender, counter
_HEADER_CHARS = 36  # base64 of the first 27 bytes: the header and one byte more
_PERSON = b"pgflow.signal.v1"  # BLAKE2b's personalisation: these keys are for nothing else
_SENDERS_KEPT = 1024  # senders' keys kept once derived (a fleet has a few per process)
# The sizes a plaintext is padded to (a marker byte, then zeros): a stream's ping with one token, of
# 1 or 100 bytes, is 256 either way. The last holds the largest plaintext a payload may have.
SIZES = (256, 1024, 4096, payload.PLAINTEXT_LIMIT + 1)
_MARK = 0x80
REPLAY_WINDOW = 4096  # counters of a sender below its highest taken that may still come (out of order)


class Opened(NamedTuple):
    sender: bytes
    key_id: int
    counter: int
    plaintext: bytes


def pad(plaintext: bytes) -> bytes:
    """``plaintext``, a marker and zeros, to the first of ``SIZES`` that holds it."""
    size = next((n for n in SIZES if n > len(plaintext)), None)
    if size is None:
        raise ValueError(f"a plaintext of {len(plaintext)} bytes does not fit a payload")
    return plaintext + b"\x80" + bytes(size - len(plaintext) - 1)


def unpad(padded: bytes) -> bytes | None:
    """The plaintext ``pad`` was given; None for a text that was not padded so."""
    end = len(padded.rstrip(b"\0")) - 1
    return padded[:end] if end >= 0 and padded[end] == _MARK else None


class Keyring:
    """The keys of one schema's channel in one process (shared by the App's loops: sealing and
    opening are thread-safe, and a reload replaces the keys at once)."""

    def __init__(self, channel: str) -> None:
        self._channel = channel  # the schema's main channel: what seal and open are for unless told
        self._aads: dict[str, bytes] = {}
        self._keys: dict[int, tuple[bytes, float | None]] = {}  # wire id -> (secret, accepted until, monotonic)
        self._sealing: list[tuple[float, int]] = []  # (sealed with from, monotonic; key id), by id
        self._theirs: OrderedDict[tuple[int, bytes], AESGCM] = OrderedDict()
        self.loaded = False
        self.unknown_key = False  # a payload came sealed with a key id not loaded: reload soon
        self.forked()
        forks.watch(self)

    def forked(self) -> None:
        """A sender of this process's own: drawn when the keyring is made, and again in every
        process forked from it, with a counter from zero (the nonce is the pair)."""
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._sender = secrets.token_bytes(16)
        self._counter = itertools.count()
        self._own: dict[int, AESGCM] = {}

    @property
    def sender(self) -> bytes:
        """This process's sender id (a fork that skipped Python's hooks is noticed here)."""
        if self._pid != os.getpid():
            self.forked()
        return self._sender

    def load(self, keys: Sequence[SignalKey]) -> None:
        """Take the keys the server gives (``Channel.signal_keys``), replacing the others."""
        now = time.monotonic()
        loaded = {k.id & 0xFFFF: (k.secret, None if k.accept_for is None else now + k.accept_for) for k in keys}
        sealing = sorted((now + max(0.0, k.seal_in), k.id) for k in keys)
        with self._lock:
            if {i: s for i, (s, _) in loaded.items()} != {i: s for i, (s, _) in self._keys.items()}:
                self._own.clear()
                self._theirs.clear()
            self._keys, self._sealing = loaded, sealing
            self.loaded = bool(loaded)
            self.unknown_key = False

    def _sealing_key(self) -> int | None:
        """The wire id of the newest key that may be sealed with now."""
        now = time.monotonic()
        usable = [key_id for since, key_id in self._sealing if since <= now and self._accepted(key_id & 0xFFFF, now)]
        return max(usable) & 0xFFFF if usable else None

    def _accepted(self, key_id: int, now: float) -> bool:
        entry = self._keys.get(key_id)
        return entry is not None and (entry[1] is None or entry[1] > now)

    def _aad(self, channel: str | None) -> bytes:
        channel = self._channel if channel is None else channel
        aad = self._aads.get(channel)
        if aad is None:
            aad = self._aads[channel] = f"pgflow-signal-v{VERSION}:{channel}".encode()
        return aad

    def seal(self, plaintext: bytes, channel: str | None = None) -> str | None:
        """A payload of ``plaintext`` for ``channel`` (by default the main one); None when no key is
        loaded (the keyring could not be read)."""
        sender = self.sender
        key_id = self._sealing_key()
        if key_id is None:
            return None
        aead = self._own.get(key_id)
        if aead is None:
            aead = self._own[key_id] = AESGCM(self._derive(key_id, sender))
        header = _HEADER.pack(key_id, sender, next(self._counter))
        sealed = aead.encrypt(b"\0\0\0\0" + header[-8:], pad(plaintext), self._aad(channel))
        return VERSION + binascii.b2a_base64(header + sealed, newline=False).decode()

    def sender_of(self, payload: str) -> bytes | None:
        """The sender a payload claims, read without opening it (so a process skips its own
        payloads cheaply; a forged claim only makes that process skip a forgery)."""
        if not payload.startswith(VERSION):
            return None
        try:
            head = binascii.a2b_base64(payload[1:1 + _HEADER_CHARS])
        except binascii.Error:
            return None
        return head[2:18] if len(head) >= 18 else None

    def open(self, payload: str, channel: str | None = None) -> Opened | None:
        """The sender, counter and plaintext of a payload heard on ``channel`` (by default the main
        one), or None when it does not open. (Whether it was heard before is ``Replays``' to say.)"""
        if not payload.startswith(VERSION):
            return None
        try:
            raw = binascii.a2b_base64(payload[1:], strict_mode=True)
        except binascii.Error:
            return None
        if len(raw) < _HEADER.size + 16:
            return None
        key_id, sender, counter = _HEADER.unpack_from(raw)
        if not self._accepted(key_id, time.monotonic()):
            if key_id not in self._keys:
                self.unknown_key = True
            return None
        aead = self._theirs.get((key_id, sender))
        fresh = aead is None
        if aead is None:
            aead = AESGCM(self._derive(key_id, sender))
        try:
            padded = aead.decrypt(b"\0\0\0\0" + raw[18:26], raw[_HEADER.size:], self._aad(channel))
        except InvalidTag:
            return None
        if fresh:  # kept only once it verified: forgeries cannot crowd out real senders
            with self._lock:
                self._theirs[(key_id, sender)] = aead
                if len(self._theirs) > _SENDERS_KEPT:
                    self._theirs.popitem(last=False)
        plaintext = unpad(padded)
        return None if plaintext is None else Opened(sender, key_id, counter, plaintext)

    def _derive(self, key_id: int, sender: bytes) -> bytes:
        secret = self._keys[key_id][0]
        return hashlib.blake2b(sender, key=secret, digest_size=32, person=_PERSON).digest()


class Replays:
    """The counters one listener has taken, per sender: a payload opens once, however often it is
    sent again. A sender's counters may arrive out of order (pings ride on commits of several
    connections), so those up to ``REPLAY_WINDOW`` below the highest taken are still taken, once
    each; older ones are dropped (a ping is a hint: a late one costs latency, never data). Senders
    are remembered up to ``_SENDERS_KEPT``, the least recently heard forgotten first: a payload of a
    forgotten sender opens once more, which is all a replay of it can cost."""

    def __init__(self, senders: int = _SENDERS_KEPT, window: int = REPLAY_WINDOW) -> None:
        self._seen: OrderedDict[tuple[int, bytes], list[int]] = OrderedDict()  # -> [highest, bits below]
        self._senders = senders
        self._window = window
        self._mask = (1 << window) - 1

    def fresh(self, opened: Opened) -> bool:
        """Whether ``opened`` was not taken before (and take it)."""
        sender = (opened.key_id, opened.sender)
        seen = self._seen.get(sender)
        if seen is None:
            seen = self._seen[sender] = [-1, 0]
            if len(self._seen) > self._senders:
                self._seen.popitem(last=False)
        else:
            self._seen.move_to_end(sender)
        highest, below = seen
        counter = opened.counter
        if counter > highest:
            step = counter - highest
            seen[0] = counter
            seen[1] = ((below << step) | (1 << (step - 1))) & self._mask if step <= self._window else 0
            return True
        age = highest - counter - 1  # bit n: counter highest - 1 - n was taken
        if age >= self._window or below >> age & 1:
            return False
        seen[1] = below | 1 << age
        return True


def sealed(keyring: Keyring, channels: tuple[str, str], news: News) -> Pings | None:
    """The sealed payloads that tell ``news``, each with its channel: ``channels`` are the schema's
    main channel and its stream channel, and stream news goes on the second. None while the
    keyring has no key to seal with."""
    channel_of: list[str] = []
    texts: list[str] = []
    for channel, part in zip(channels, payload.by_channel(news), strict=True):
        for text in payload.plaintexts(part):
            sealed_text = keyring.seal(text, channel)
            if sealed_text is None:
                return None
            channel_of.append(channel)
            texts.append(sealed_text)
    return Pings(channel_of, texts)
