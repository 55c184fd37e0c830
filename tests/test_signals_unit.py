"""The pure parts of the signals layer and of recorded outcomes, with no server: the key vocabulary,
the payload format and its packing, the keyring's sealing, and exceptions recorded as data."""

from __future__ import annotations

import ast
import binascii
import sys
from pathlib import Path

import msgspec

import pgflow
from pgflow._core.engine.channel import SignalKey
from pgflow._core.outcomes import describe, rebuilt
from pgflow._core.signals import Chunk, End, Keyring, News, payload
from pgflow._core.signals import keys as signal_keys
from pgflow._core.signals.sealing import VERSION
from pgflow.errors import LeaseLost

PACKAGE = Path(pgflow.__file__).parent
SECRET = bytes(range(32))
OTHER = bytes(range(1, 33))


# -- the vocabulary -------------------------------------------------------------------------------------


def test_stream_keys_are_one_to_one_and_ended_keys_parse() -> None:
    assert signal_keys.stream("a", "b:c") != signal_keys.stream("a:b", "c")
    # A stream is named by a digest of one length, however long its workflow id and key.
    assert len(signal_keys.stream("w" * 300, "k" * 300)) == len(signal_keys.stream("w", "k")) < 20
    assert signal_keys.ended_workflow(signal_keys.ended("w:1")) == "w:1"
    for other in (signal_keys.queue("w"), signal_keys.stream("w", "k"), signal_keys.event("w"),
                  signal_keys.message("w"), signal_keys.WAKE_ALL):
        assert signal_keys.ended_workflow(other) is None


def test_no_prefix_of_the_vocabulary_is_spelled_outside_it() -> None:
    prefixes = ("wf:", "q:", "s:", "e:", "m:", "o:", "c:")
    for path in PACKAGE.rglob("*.py"):
        if path.name == "keys.py" and path.parent.name == "signals":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            text = node.values[0] if isinstance(node, ast.JoinedStr) and node.values else node
            if isinstance(text, ast.Constant) and isinstance(text.value, str):
                assert not text.value.startswith(prefixes), f"{path}:{node.lineno} spells {text.value[:12]!r}"


# -- the payload format ---------------------------------------------------------------------------------


def test_news_is_cut_into_payloads_that_fit_and_lose_nothing() -> None:
    ends = [End(f"w{n}", n, 1, "wf", "succeeded", b"\x01" * 40, None) for n in range(60)]
    chunks = [Chunk(signal_keys.stream(f"w{n}", "k"), n, 3, b"v" * 100) for n in range(300)]
    keys = [signal_keys.queue(f"q{n}") for n in range(400)]
    texts = payload.plaintexts(News(keys, ends, chunks))
    assert len(texts) > 3 and all(len(t) <= payload.PLAINTEXT_LIMIT for t in texts)
    back = [payload.decode(t) for t in texts]
    assert all(b is not None for b in back)
    assert sorted(k for b in back for k in b.keys) == sorted(keys)  # type: ignore[union-attr]
    assert [e for b in back for e in b.ends] == ends  # type: ignore[union-attr]
    assert [c for b in back for c in b.chunks] == chunks  # type: ignore[union-attr]


def test_very_wide_news_and_one_thing_too_big_wake_everybody() -> None:
    wide = payload.plaintexts(News([signal_keys.queue(str(n)) for n in range(payload.WAKE_ALL_ABOVE + 1)]))
    huge = payload.plaintexts(News([signal_keys.ended("x" * 9000), signal_keys.queue("ordinary")]))
    assert [payload.decode(t) for t in wide] == [News([signal_keys.WAKE_ALL])]
    assert News([signal_keys.queue("ordinary")]) in [payload.decode(t) for t in huge]
    assert News([signal_keys.WAKE_ALL]) in [payload.decode(t) for t in huge]


def test_a_payload_that_verified_but_does_not_decode_is_none() -> None:
    assert payload.decode(b"\x93\x01\x02") is None
    assert payload.decode(b"not msgpack") is None


def test_an_end_too_big_is_not_carried() -> None:
    small = End("w", 1, 1, "wf", "failed", None, {"type": "E", "message": "m"})
    big = End("w", 1, 1, "wf", "failed", None, {"traceback": "x" * payload.CARRY_END_AT_MOST})
    assert payload.carried_end(small) and not payload.carried_end(big)
    assert News(ends=[small]).plain() == News([signal_keys.ended("w")])


# -- sealing --------------------------------------------------------------------------------------------


def ring(*keys: SignalKey, channel: str = "pgflow_x") -> Keyring:
    keyring = Keyring(channel)
    keyring.load(list(keys))
    return keyring


def test_a_sealed_payload_opens_with_the_key_and_hides_what_it_says() -> None:
    sender, receiver = ring(SignalKey(1, SECRET, 0, None)), ring(SignalKey(1, SECRET, 0, None))
    text = sender.seal(b"workflow-42 result")
    assert text is not None and len(text) < 8000
    assert b"workflow-42" not in binascii.a2b_base64(text[1:]) and "workflow-42" not in text
    opened = receiver.open(text)
    assert opened is not None and opened.plaintext == b"workflow-42 result" and opened.sender == sender.sender
    assert receiver.sender_of(text) == sender.sender
    assert sender.seal(b"same") != sender.seal(b"same")  # a counter nonce: never the same twice


def test_a_payload_does_not_open_when_tampered_with_foreign_or_of_another_channel() -> None:
    sender = ring(SignalKey(1, SECRET, 0, None))
    text = sender.seal(b"news")
    assert text is not None
    raw = bytearray(binascii.a2b_base64(text[1:]))
    raw[-1] ^= 1
    tampered = VERSION + binascii.b2a_base64(bytes(raw), newline=False).decode()
    assert ring(SignalKey(1, SECRET, 0, None)).open(tampered) is None
    assert ring(SignalKey(1, OTHER, 0, None)).open(text) is None  # another schema's key
    assert ring(SignalKey(1, SECRET, 0, None), channel="pgflow_y").open(text) is None
    # Sealed for the schema's stream channel, it opens there and not on the main channel, nor the
    # other way round: news sent again on the other channel is dropped, not opened by every worker.
    for_streams = sender.seal(b"chunks", "pgflows_x")
    receiver = ring(SignalKey(1, SECRET, 0, None))
    assert for_streams is not None and receiver.open(for_streams) is None
    assert receiver.open(for_streams, "pgflow_x") is None
    assert (opened := receiver.open(for_streams, "pgflows_x")) is not None and opened.plaintext == b"chunks"
    assert receiver.open(text, "pgflows_x") is None and receiver.open(text, "pgflow_x") is not None
    for garbage in ("", VERSION, "1" + text[1:], "3" + text[1:], VERSION + "!!!", VERSION + "A" * 40, text[:30]):
        assert ring(SignalKey(1, SECRET, 0, None)).open(garbage) is None


def test_an_empty_keyring_seals_nothing() -> None:
    assert Keyring("pgflow_x").seal(b"news") is None


def test_a_rotation_accepts_both_keys_and_seals_with_the_new_one_from_its_time() -> None:
    old, new = SignalKey(1, SECRET, 0, None), SignalKey(2, OTHER, 3600, None)
    moving = ring(old, new)  # the new key is known, not sealed with yet
    text = moving.seal(b"news")
    assert text is not None and binascii.a2b_base64(text[1:])[:2] == (1).to_bytes(2, "big")
    switched = ring(SignalKey(1, SECRET, -60, 60), SignalKey(2, OTHER, 0, None))
    later = switched.seal(b"news")
    assert later is not None and binascii.a2b_base64(later[1:])[:2] == (2).to_bytes(2, "big")
    assert switched.open(text) is not None and moving.open(later) is not None  # both accepted meanwhile
    retired = ring(SignalKey(1, SECRET, -60, -1), SignalKey(2, OTHER, 0, None))
    assert retired.open(text) is None
    unknown = ring(old)
    assert unknown.open(later) is None and unknown.unknown_key  # asks for a reload


# -- outcomes are data ----------------------------------------------------------------------------------


class Rejected(Exception):
    def __init__(self, reason: str, code: int) -> None:
        super().__init__(reason, code)


def test_a_recorded_exception_comes_back_as_its_type_with_its_arguments() -> None:
    for exc in (ValueError("bad", 3), KeyError("k"), Rejected("no", 7), pgflow.StepTimeout("slow")):
        error = msgspec.json.decode(msgspec.json.encode(describe(exc)))  # as jsonb gives it back
        again = rebuilt(error)
        assert type(again) is type(exc) and again.args == exc.args


def test_what_cannot_be_rebuilt_is_step_failed_and_nothing_is_imported_for_a_row() -> None:
    class Local(Exception):
        pass

    assert "antigravity" not in sys.modules
    cases = [
        describe(Local("local")),
        {"type": "antigravity.Fly", "message": "up", "args": ["up"]},  # a module not loaded
        {"type": "os.system", "message": "echo", "args": ["echo hi"]},  # no exception class
        {"type": "pgflow.errors.LeaseLost", "message": "x", "args": ["x"]},  # an interrupt, not an exception
        {"type": "builtins.ValueError", "message": "x", "args": None},  # arguments that did not encode
        {"type": "tests.test_signals_unit.Rejected", "message": "no", "args": ["too", "many", "args"]},
    ]
    for error in cases:
        again = rebuilt(error)
        assert isinstance(again, pgflow.StepFailed) and again.error_type == error["type"], error
    assert "antigravity" not in sys.modules
    assert not isinstance(rebuilt({"type": "x", "message": "y"}), LeaseLost)


def test_a_row_of_an_older_version_replays_from_its_type_and_message() -> None:
    again = rebuilt({"type": "ValueError", "message": "old row", "traceback": "..."})
    assert type(again) is ValueError and str(again) == "old row"


def test_arguments_that_do_not_come_back_as_they_went_are_not_kept() -> None:
    assert describe(ValueError(b"bytes"))["args"] is None
    assert describe(ValueError("nul \x00 inside"))["args"] is None
    assert describe(ValueError(object()))["args"] is None
    assert describe(ValueError((1, 2)))["args"] is None  # a tuple would come back a list
    assert describe(ValueError("fine", 1, None))["args"] == ["fine", 1, None]


def test_pgflow_never_imports_a_deserialiser_of_code() -> None:
    """No pickle (nor its kin) anywhere in the package: a row read back is data, never code."""
    banned = {"pickle", "_pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "copyreg"}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
                names = [getattr(node.args[0], "value", "")] if node.args else []
            assert not banned & set(names), f"{path}:{getattr(node, 'lineno', '?')} imports {names}"
