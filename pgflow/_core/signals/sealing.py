"""Sealed payloads: what goes on pgflow's channels is authenticated and encrypted, because PostgreSQL
lets every role that can connect LISTEN and NOTIFY on them.

The schema's keyring (table ``signal_keys``, readable only by the roles granted it) holds 32-byte
secrets. A payload is AES-256-GCM under a key that is the sender's own: a keyed BLAKE2b of a random
16-byte ``sender`` id, drawn once per App in each process, under the secret. Its nonce is a counter
of that sender, so no (key, nonce) pair is ever used twice, however many payloads a fleet sends
(random 96-bit nonces under one shared key would wear out after about 2**32 of them). The channel's
name is the additional data: a payload opens only on the channel it was sealed for, so one of another
schema does not open, nor a stream payload sent again on the main channel (where every worker would
open it, whether it reads streams or not).

On the wire: ``1`` (the format's version), then base64 of: the key's id (2 bytes), the sender (16),
the counter (8), and the ciphertext with its 16-byte tag. Nothing else is readable: not the keys it
names, not the values it carries, not its sender's process.

A payload that does not open (a forgery, garbage, a key this process no longer or not yet accepts)
is dropped and counted; one sealed with a key id this process does not know asks for a reload of
the keyring (a rotation under way).
"""

from __future__ import annotations

import binascii
import hashlib
import itertools
import secrets
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..store.channel import Pings, SignalKey
from . import payload
from .payload import News

VERSION = "1"
_HEADER = struct.Struct(">H16sQ")  # key id, sender, counter
_HEADER_CHARS = 36  # base64 of the first 27 bytes: the header and one byte more
_PERSON = b"pgflow.signal.v1"  # BLAKE2b's personalisation: these keys are for nothing else
_SENDERS_KEPT = 1024  # senders' keys kept once derived (a fleet has a few per process)


class Opened(NamedTuple):
    sender: bytes
    plaintext: bytes


class Keyring:
    """The keys of one schema's channel in one process (shared by the App's loops: sealing and
    opening are thread-safe, and a reload replaces the keys at once)."""

    def __init__(self, channel: str) -> None:
        self.sender = secrets.token_bytes(16)
        self._channel = channel  # the schema's main channel: what seal and open are for unless told
        self._aads: dict[str, bytes] = {}
        self._counter = itertools.count()
        self._keys: dict[int, tuple[bytes, float | None]] = {}  # id -> (secret, accepted until, monotonic)
        self._sealing: list[tuple[float, int]] = []  # (sealed with from, monotonic; key id), by id
        self._own: dict[int, AESGCM] = {}
        self._theirs: OrderedDict[tuple[int, bytes], AESGCM] = OrderedDict()
        self._lock = threading.Lock()
        self.loaded = False
        self.unknown_key = False  # a payload came sealed with a key id not loaded: reload soon

    def load(self, keys: Sequence[SignalKey]) -> None:
        """Take the keys the server gives (``ChannelStatements.signal_keys``), replacing the others."""
        now = time.monotonic()
        loaded = {k.id: (k.secret, None if k.accept_for is None else now + k.accept_for) for k in keys}
        sealing = sorted((now + max(0.0, k.seal_in), k.id) for k in keys)
        with self._lock:
            if {i: s for i, (s, _) in loaded.items()} != {i: s for i, (s, _) in self._keys.items()}:
                self._own.clear()
                self._theirs.clear()
            self._keys, self._sealing = loaded, sealing
            self.loaded = bool(loaded)
            self.unknown_key = False

    def _sealing_key(self) -> int | None:
        """The newest key that may be sealed with now."""
        now = time.monotonic()
        usable = [key_id for since, key_id in self._sealing if since <= now and self._accepted(key_id, now)]
        return max(usable) if usable else None

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
        key_id = self._sealing_key()
        if key_id is None:
            return None
        aead = self._own.get(key_id)
        if aead is None:
            aead = self._own[key_id] = AESGCM(self._derive(key_id, self.sender))
        header = _HEADER.pack(key_id, self.sender, next(self._counter))
        sealed = aead.encrypt(b"\0\0\0\0" + header[-8:], plaintext, self._aad(channel))
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
        """The sender and plaintext of a payload heard on ``channel`` (by default the main one), or
        None when it does not open."""
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
            plaintext = aead.decrypt(b"\0\0\0\0" + raw[18:26], raw[_HEADER.size:], self._aad(channel))
        except InvalidTag:
            return None
        if fresh:  # kept only once it verified: forgeries cannot crowd out real senders
            with self._lock:
                self._theirs[(key_id, sender)] = aead
                if len(self._theirs) > _SENDERS_KEPT:
                    self._theirs.popitem(last=False)
        return Opened(sender, plaintext)

    def _derive(self, key_id: int, sender: bytes) -> bytes:
        secret = self._keys[key_id][0]
        return hashlib.blake2b(sender, key=secret, digest_size=32, person=_PERSON).digest()


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
