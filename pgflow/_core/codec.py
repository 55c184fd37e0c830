"""msgspec encoding of arguments, results, step outputs and stream chunks.

Values are stored as MessagePack: compact, fast, and it keeps ``bytes`` as bytes. A function's type
hints decide how its values come back: a parameter annotated with a Struct or a dataclass is rebuilt as
one, an unannotated one comes back as builtins. Arguments are checked at ``start`` by decoding them
exactly as the worker will, so a value that would fail on the worker fails in the caller instead, before
anything is written.
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable
from typing import Any

import msgspec

from ..errors import SerializationError

_encoder = msgspec.msgpack.Encoder()
_untyped = untyped = msgspec.msgpack.Decoder()  # ``untyped.decode``: the decoding of a value read as Any


DEFAULT_VALUE_LIMIT = 8 * 1024 * 1024  # bytes of one encoded value (App(max_value_bytes=...)); chunks too


def encode(value: object, what: str, limit: int | None = None) -> bytes:
    """Encode one value; ``what`` names it in the error ("the result of workflow 'x'"), which a value
    over ``limit`` bytes encoded raises too (checked before anything is written)."""
    try:
        data = _encoder.encode(value)
    except (TypeError, msgspec.EncodeError, OverflowError) as exc:
        raise SerializationError(
            f"{what} cannot be stored: {exc}. Use str, bytes, numbers, lists, dicts, "
            "msgspec Structs or dataclasses."
        ) from exc
    except UnicodeEncodeError as exc:
        raise SerializationError(
            f"{what} cannot be stored: it holds text that is not valid Unicode ({exc.reason} at "
            f"position {exc.start}, a lone surrogate?)"
        ) from exc
    except RecursionError as exc:
        raise SerializationError(f"{what} cannot be stored: it is nested too deeply") from exc
    if limit is not None and len(data) > limit:
        raise SerializationError(
            f"{what} is {len(data)} bytes encoded; the limit is {limit} (App(max_value_bytes=...)). Engine big"
            " data elsewhere and pass a reference, or stream it in chunks."
        )
    return data


def encode_quietly(value: object) -> bytes | None:
    """Encode one value, or None when it cannot be: the hot path of a stream write, which builds
    no error message unless it needs one (``encode`` then says why)."""
    try:
        return _encoder.encode(value)
    except Exception:  # noqa: BLE001 - whatever it was, ``encode`` reports it properly
        return None


def decode(data: bytes, type_: Any = Any) -> Any:
    """Decode a stored value, rebuilding it as ``type_`` where that is more than ``Any``."""
    if type_ is Any:
        return _untyped.decode(data)
    return msgspec.msgpack.decode(data, type=type_)


def checked(value: object, type_: Any, what: str, limit: int | None = None) -> tuple[bytes, Any]:
    """Encode ``value`` and decode it back as ``type_``: the stored form, and the value a reader of
    it will get; a value that does not match its type hint (or is over ``limit`` bytes) raises
    SerializationError now, rather than when somebody reads it."""
    data = encode(value, what, limit)
    try:
        return data, decode(data, type_)
    except msgspec.ValidationError as exc:
        raise SerializationError(f"{what} does not match its type hint: {exc}") from exc


def encode_unchecked(args: tuple[Any, ...], kwargs: dict[str, Any], what: str, limit: int | None = None) -> bytes:
    """The stored arguments of a call to a function this process does not know: a msgpack array
    ``[args, kwargs]``, which ``decode_arguments`` tells from the map a checked call is stored as."""
    return encode([list(args), kwargs], what, limit)


def _hints(fn: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn, include_extras=True)
    except Exception:  # noqa: BLE001 - unresolvable forward references: fall back to no checking
        return {}


class FunctionCodec:
    """Encodes a function's arguments and result, checked against its signature and type hints."""

    def __init__(self, fn: Callable[..., Any], label: str, limit: int | None = None) -> None:
        self._label = label
        self.limit = limit  # bytes of the encoded arguments, and of the encoded result
        self._signature = inspect.signature(fn)
        hints = _hints(fn)
        self.return_type: Any = hints.get("return", Any)
        fields: list[tuple[str, Any]] = []
        for name, param in self._signature.parameters.items():
            hint = hints.get(name, Any)
            if param.kind is inspect.Parameter.VAR_POSITIONAL:
                hint = tuple[hint, ...]  # type: ignore[valid-type]
            elif param.kind is inspect.Parameter.VAR_KEYWORD:
                hint = dict[str, hint]  # type: ignore[valid-type]
            fields.append((name, hint))
        self._arguments = msgspec.defstruct(f"{label}.arguments", fields, forbid_unknown_fields=True)

    def encode_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
        """Bind, encode and check the arguments; raise SerializationError naming the bad one."""
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise SerializationError(f"{self._label}: {exc}") from exc
        bound.apply_defaults()
        for name, value in bound.arguments.items():
            encode(value, f"argument {name!r} of {self._label}", self.limit)
        data = encode(bound.arguments, f"the arguments of {self._label}", self.limit)
        try:
            msgspec.msgpack.decode(data, type=self._arguments)
        except msgspec.ValidationError as exc:
            raise SerializationError(f"{self._label}: {_name_the_argument(str(exc))}") from exc
        return data

    def decode_arguments(self, data: bytes) -> tuple[list[Any], dict[str, Any]]:
        """Rebuild the positional and keyword arguments of a call from their stored form. Arguments
        stored unchecked by ``start_by_name`` are checked here, on the worker that knows the function:
        a call that does not fit raises SerializationError, which fails the workflow. So do stored
        arguments over this worker's limit, before they are decoded: a row is data from whoever could
        write it, and decoding multiplies its size in memory."""
        if self.limit is not None and len(data) > self.limit:
            raise SerializationError(f"the stored arguments of {self._label} are {len(data)} bytes; this worker's"
                                     f" limit is {self.limit} (App(max_value_bytes=...))")
        if data[:1] and (0x90 <= data[0] <= 0x9F or data[0] in (0xDC, 0xDD)):
            given, by_name = _untyped.decode(data)
            try:
                data = self.encode_arguments(tuple(given), by_name)
            except SerializationError as exc:
                raise SerializationError(f"started by name with arguments that do not fit: {exc}") from exc
        values = msgspec.msgpack.decode(data, type=self._arguments)
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for name, param in self._signature.parameters.items():
            value = getattr(values, name)
            if param.kind is inspect.Parameter.VAR_POSITIONAL:
                args.extend(value)
            elif param.kind is inspect.Parameter.VAR_KEYWORD:
                kwargs.update(value)
            elif param.kind is inspect.Parameter.KEYWORD_ONLY:
                kwargs[name] = value
            else:
                args.append(value)
        return args, kwargs

    def encode_result(self, value: object) -> bytes:
        return checked(value, self.return_type, f"the result of {self._label}", self.limit)[0]

    def decode_result(self, data: bytes) -> Any:
        return decode(data, self.return_type)


def _name_the_argument(message: str) -> str:
    """Turn msgspec's "Expected `int`, got `str` - at `$.x`" into "argument 'x': Expected ..."."""
    text, sep, path = message.rpartition(" - at `$.")
    if not sep:
        return message
    path = path.rstrip("`")
    name = re.split(r"[.\[]", path, maxsplit=1)[0]
    inside = path[len(name):]
    return f"argument {name!r}{' at ' + inside if inside else ''}: {text}"
