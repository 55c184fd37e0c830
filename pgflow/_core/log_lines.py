"""The CLI's log lines: logging's own format, with the date and time of each second made once, and
the line of each workflow's end written without a ``LogRecord`` when nobody but the CLI's handler
would see it: pgflow's one bypass of logging, kept here.

A worker at INFO (the CLI's default) writes a line for every workflow that ends. ``logging.Formatter``
calls ``localtime`` and ``strftime`` for every line it stamps, which was about a third of such a line's
cost (11.0 against 7.7 µs a line, measured with the line ``outcomes.log_end`` writes). Every line of
one second carries the same text up to its milliseconds, so that text is made once per second
(``SecondStamps``, a formatter like any other).

What is left of a line's cost through logging is mostly its machinery: a ``LogRecord`` (the caller's
file name split, the thread, process and task names looked up), the handler's filters and locks, the
formatter's dictionary. ``write`` makes the same line from the message and its arguments alone, but only
when the line would reach the CLI's own handler and nothing else: an application that adds a handler,
a filter or a record factory, or hooks logging's own methods (an error reporter's breadcrumbs), gets
its records as before. What that buys, measured side by side (``python -m benchmarks.bypasses --only
log_lines,drain16,drain64``, benchmarks/README.md): 9.7 against 19.9 µs a line through ``Logger.info``,
and a draining worker spends 1.20x its CPU per no-op when every end line goes through logging. It reads
no private attribute of logging, so it needs no bound on Python's version; a logging that formats its
lines differently is caught by tests/test_log_lines.py, which compares the two lines character for
character.

(The lines of a batch of ends were once gathered into one write, about 4 µs a line less: under 5% of a
no-op's worker CPU, and not seen in a drain's, so they are written one by one again.)
"""

from __future__ import annotations

import logging
import time
from typing import Any

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class SecondStamps(logging.Formatter):
    """``logging.Formatter`` with its default time format (``2026-12-03 14:38:14,410``), the text of
    each second cached; a ``datefmt`` passed on is used as logging uses it, uncached."""

    def __init__(self, fmt: str = FORMAT) -> None:
        super().__init__(fmt)
        self.line_format = fmt  # (``write`` reads it: logging's own copy is private)
        self._second: int | None = None
        self._text = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 - logging's name
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        return self.stamp(record.created, record.msecs)

    def stamp(self, created: float, msecs: float) -> str:
        second = int(created)
        if second != self._second:
            self._text = time.strftime(self.default_time_format, self.converter(second))
            self._second = second
        return f"{self._text},{int(msecs):03d}"  # logging's default_msec_format, "%s,%03d"


class Lines(logging.StreamHandler):  # type: ignore[type-arg] # (generic in typeshed only)
    """The CLI's handler: stderr, stamped by ``SecondStamps``. Only its type tells ``write`` that a
    line may go to it directly."""


def configure(level: str) -> None:
    """The root logger writing to stderr at ``level``, as ``logging.basicConfig`` would, stamped by
    ``SecondStamps``."""
    handler = Lines()
    handler.setFormatter(SecondStamps())
    logging.basicConfig(level=level, handlers=[handler])


def write(logger: logging.Logger, level: int, msg: str, args: tuple[Any, ...]) -> bool:
    """Write the line ``logger.log(level, msg, *args)`` would write, straight to the CLI's handler,
    if that handler alone would get the record, unfiltered, and format it as ``configure`` set it up;
    False, having written nothing, when the record must go through logging: then logging's own path
    also says what went wrong (a message its arguments do not fit, a closed or broken stream). (The
    caller has checked ``logger.isEnabledFor(level)``.)"""
    handler = _alone(logger, level)
    if handler is None:
        return False
    formatter = handler.formatter
    assert isinstance(formatter, SecondStamps)
    handler.acquire()  # (stamped under the handler's lock, as logging's own lines are: in order)
    try:
        now = time.time()
        try:
            text = (f"{formatter.stamp(now, (now - int(now)) * 1000)} {logging.getLevelName(level)} {logger.name}:"
                    f" {msg % args}{handler.terminator}")
        except Exception:  # noqa: BLE001 - a message its arguments do not fit: logging reports it its way
            return False
        try:
            handler.stream.write(text)
        except (OSError, ValueError):  # a closed or broken stream: logging's own path says so its way
            return False
        try:
            handler.stream.flush()
        except (OSError, ValueError):  # (written: the next line's write says what broke)
            pass
        return True
    finally:
        handler.release()


# What logging runs between a logger and its handlers: patched (an error reporter's breadcrumbs hook
# ``Logger.callHandlers``) or overridden, it must see every record. Looked at as they were when this
# module was imported, and then by identity (a few attribute loads a line).
_HOOKS = frozenset({"handle", "makeRecord", "callHandlers", "filter"})
_HANDLER_HOOKS = frozenset({"handle", "emit", "format", "filter"})
_LOGGER = logging.Logger


def _hooks() -> tuple[Any, ...]:
    """Those methods, as they are now (the names of ``_HOOKS`` and ``_HANDLER_HOOKS``)."""
    return (_LOGGER.handle, _LOGGER.makeRecord, _LOGGER.callHandlers, _LOGGER.filter,
            Lines.handle, Lines.emit, Lines.format, Lines.filter)


_STOCK = _hooks()
_STOCK_AT_IMPORT = all(hook.__module__ == "logging" for hook in _STOCK)


def _stock(logger: logging.Logger) -> bool:
    """Whether logging's path from ``logger`` to a ``Lines`` handler is logging's own."""
    return (_STOCK_AT_IMPORT and type(logger) is _LOGGER and _HOOKS.isdisjoint(logger.__dict__)
            and _hooks() == _STOCK)


def _alone(logger: logging.Logger, level: int) -> Lines | None:
    """The CLI's handler when it is the only place a record of ``logger`` at ``level`` would go."""
    if not _stock(logger):
        return None
    node: logging.Logger | None = logger
    root = logging.getLogger()
    while node is not root:
        assert node is not None
        if node.handlers or node.filters or not node.propagate:
            return None
        node = node.parent
    if root.filters or len(root.handlers) != 1 or logging.getLogRecordFactory() is not logging.LogRecord:
        return None
    handler = root.handlers[0]
    if type(handler) is not Lines or handler.filters or level < handler.level or not _HANDLER_HOOKS.isdisjoint(
            handler.__dict__):
        return None
    formatter = handler.formatter
    if type(formatter) is not SecondStamps or formatter.line_format != FORMAT or formatter.datefmt is not None:
        return None
    return handler
