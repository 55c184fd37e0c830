"""What every statement of the catalogue declares besides its SQL, once, for mypy and the executor alike:
the type of its rows (``row=``) and of its parameters (``params=``). A ``Statement[R, P]`` returns rows
of type ``R`` and is run with the parameters ``P`` (``Database.rows(statement, *args, **kwargs)``).

``row=``:

- a ``NamedTuple``: each row is one, read by name (``row.pid``), made in psycopg's loop from the tuple
  it read, with no check of its length (tests/test_engine_catalogue.py checks it against the server's
  description of the statement instead);
- ``tuple[int, str | None]``: each row is the tuple psycopg read, typed as such, at no cost per row:
  for the hot statements, whose rows are read by millions, and for rows of one column;
- ``None``: the statement returns no rows.

``params=``:

- a ``TypedDict``: the statement names its parameters (``%(id)s``) and is run with keywords,
  ``db.row(RECORD_WAKE, id=..., lease=...)``;
- a ``NamedTuple``: its parameters are positional (``%s``), and so are the arguments, in order;
- none: the statement takes no parameters.

Keywords rather than a dict typed as the TypedDict: mypy cannot check a dict literal against a TypedDict
it has to infer from the statement beside it ("Cannot infer value of type parameter"), where a ParamSpec
taken from the TypedDict's (or the NamedTuple's) constructor checks each argument's name and type at every
call, a ``**`` of a TypedDict too (``**new.parameters()``). It costs what the dict did: Python builds the
same dict of the keywords. (A ``tuple[...]`` row is written out in ``row=``: mypy takes the expression
for the type it names, but not an alias of it, unless cast: ``row=cast("type[ClaimRow]", ClaimRow)``.)

A statement that declares neither (``Sql(text)``) is one the catalogue has not typed yet: its rows are
plain tuples of anything, and it is run as before typing, with its parameters in one argument (a mapping
or a sequence). None of the catalogue's is left (tests/test_engine_catalogue.py's NOT_TYPED_YET would
name its module).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, NamedTuple, ParamSpec, TypedDict, TypeVar, is_typeddict

R = TypeVar("R", covariant=True)  # a row
P = ParamSpec("P")  # the parameters

Untyped = tuple[Any, ...]  # a row of a statement not typed yet
Params = Mapping[str, Any] | Sequence[Any] | None  # what psycopg or libpq is given
UNDECLARED: Any = object()  # (``row=`` not given: a statement not typed yet)


class Statement(Generic[R, P]):
    """The declarations shared by ``database.Sql`` and ``wire.Statement``; see the module's docstring.
    ``make_row``: what makes a row of the tuple psycopg reads (``tuple``: the tuple itself)."""

    __slots__ = ("row", "params", "make_row", "named", "untyped")

    def __init__(self, row: Any, params: Any) -> None:
        self.untyped = row is UNDECLARED
        if self.untyped and params is not None:
            raise TypeError("a statement that declares its parameters declares its rows too (row=...; None: none)")
        self.row = None if self.untyped else row
        self.params = params
        self.make_row: Callable[[Any], Any] = tuple
        if _is_named_tuple(row):
            # (tuple.__new__ bound to the class: what NamedTuple._make calls, less a Python frame per row)
            self.make_row = types.MethodType(tuple.__new__, row)
        elif not (row is None or self.untyped or _is_tuple_type(row)):
            raise TypeError(f"a row is a NamedTuple, a tuple[...] type or None, not {row!r}")
        if params is not None and not (is_typeddict(params) or _is_named_tuple(params)):
            raise TypeError(f"parameters are a TypedDict (by name) or a NamedTuple (in order), not {params!r}")
        self.named = params is None or is_typeddict(params)

    def given(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Params:
        """What the executor sends for the arguments a call gave (see the module's docstring)."""
        if kwargs:
            return kwargs if self.named else self.params(*args, **kwargs)
        if args:
            return args[0] if self.untyped else args
        return None


def _is_named_tuple(cls: Any) -> bool:
    return isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")


def _is_tuple_type(row: Any) -> bool:
    return isinstance(row, types.GenericAlias) and row.__origin__ is tuple


class Id(NamedTuple):
    """The parameters of the many statements of one workflow, by its id (``WHERE id = %s``)."""

    id: str


class ById(TypedDict):
    """The same, named (``WHERE id = %(id)s``)."""

    id: str


class Batch(TypedDict):
    """The parameters of a clean-up's statement: how many rows it deletes at most (``%(batch)s``)."""

    batch: int
