"""The CLI's log lines read exactly as logging's own: the stamps across second boundaries, and the end
line written without a LogRecord, which steps aside for anything an application adds (no server needed)."""

from __future__ import annotations

import contextlib
import io
import logging
import re
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest

from pgflow._core import log_lines
from pgflow._core.log_lines import FORMAT, SecondStamps
from pgflow._core.outcomes import Outcome, log_end
from pgflow._core.status import Status

from .helpers import RecordingHandler


def record_at(created: float) -> logging.LogRecord:
    record = logging.LogRecord("pgflow.runs", logging.INFO, __file__, 1, "workflow %s ended", ("w1",), None)
    record.created = created
    record.msecs = int((created - int(created)) * 1000) + 0.0  # as LogRecord makes it from its own time
    return record


def test_every_line_is_stamped_as_logging_stamps_it_across_seconds_and_days() -> None:
    ours, logging_own = SecondStamps(), logging.Formatter(FORMAT)
    start = 1_764_806_399.0  # a second before midnight UTC: the cached text must follow the day over
    times = [start + step / 7 for step in range(30)] + [start + 0.9999, start + 1.0, start - 3600.0, start + 0.5]
    for created in times:
        assert ours.format(record_at(created)) == logging_own.format(record_at(created)), created


def test_a_date_format_of_its_own_is_used_as_logging_uses_it() -> None:
    record = record_at(1_764_806_399.25)
    assert SecondStamps().formatTime(record, "%H:%M") == logging.Formatter().formatTime(record, "%H:%M")


# -- the end line, written without a LogRecord --------------------------------------------------------------

END = "workflow %s %s %s in %.3fs (attempt %d)"
ARGS = ("shop.checkout", "wf-1", Status.SUCCEEDED, 0.0123, 2)
STAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")


@contextlib.contextmanager
def cli_logging() -> Iterator[tuple[io.StringIO, logging.Logger]]:
    """The root logger alone with the CLI's handler (writing to a string), as ``pgflow worker`` sets it up;
    the test's own logging (pytest's handlers) put back after."""
    root, runs = logging.root, logging.getLogger("pgflow.workflows")
    saved = root.handlers[:], root.level
    root.handlers = []
    stream = io.StringIO()
    try:
        log_lines.configure("INFO")
        root.handlers[0].setStream(stream)  # type: ignore[attr-defined]
        yield stream, runs
    finally:
        root.handlers = saved[0]
        root.setLevel(saved[1])


def test_the_end_line_written_directly_reads_as_logging_writes_it() -> None:
    with cli_logging() as (stream, runs):
        assert log_lines.write(runs, logging.INFO, END, ARGS)
        direct = stream.getvalue()
        standard = logging.root.handlers[0].format(runs.makeRecord(runs.name, logging.INFO, __file__, 1, END, ARGS,
                                                                   None)) + "\n"
    assert STAMP.match(direct) and STAMP.match(standard)
    assert direct[24:] == standard[24:] == "INFO pgflow.workflows: workflow shop.checkout wf-1 succeeded in 0.012s" \
                                           " (attempt 2)\n"


def test_the_end_line_of_a_workflow_is_written_without_a_log_record_under_the_cli() -> None:
    with cli_logging() as (stream, _), mock.patch.object(logging.LogRecord, "__init__", side_effect=AssertionError):
        log_end("shop.checkout", SimpleNamespace(id="wf-1", run=2), Outcome(Status.SUCCEEDED), 0.0123)  # type: ignore[arg-type]
    line = stream.getvalue()
    assert STAMP.match(line)
    assert line[24:] == "INFO pgflow.workflows: workflow shop.checkout wf-1 succeeded in 0.012s (attempt 2)\n"


@pytest.mark.parametrize("change", ["handler on pgflow", "filter on its logger", "filter on the handler",
                                    "second root handler", "record factory", "own format",
                                    "own format, stamped as the CLI's", "not propagated",
                                    "patched callHandlers", "patched emit", "logger subclass", "handler level"])
def test_whatever_the_application_adds_to_logging_gets_the_records_as_before(change: str) -> None:
    kept = RecordingHandler()
    with cli_logging() as (stream, runs), contextlib.ExitStack() as undo:
        handler, factory = logging.root.handlers[0], logging.getLogRecordFactory()
        if change == "handler on pgflow":
            logging.getLogger("pgflow").addHandler(kept)
            undo.callback(logging.getLogger("pgflow").removeHandler, kept)
        elif change == "filter on its logger":
            runs.addFilter(kept.records.append)  # (a filter that keeps the record and lets it pass)
            undo.callback(runs.removeFilter, kept.records.append)
        elif change == "filter on the handler":
            handler.addFilter(kept.records.append)
            undo.callback(handler.removeFilter, kept.records.append)
        elif change == "second root handler":
            logging.root.addHandler(kept)
            undo.callback(logging.root.removeHandler, kept)
        elif change == "record factory":
            def factory_keeping(*args: Any, **kwargs: Any) -> logging.LogRecord:
                record = factory(*args, **kwargs)
                kept.records.append(record)
                return record
            logging.setLogRecordFactory(factory_keeping)
            undo.callback(logging.setLogRecordFactory, factory)
        elif change == "own format":
            handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        elif change == "own format, stamped as the CLI's":
            handler.setFormatter(SecondStamps("%(levelname)s %(message)s"))
        elif change == "patched callHandlers":  # as an error reporter's breadcrumbs do
            def breadcrumbs(self: logging.Logger, record: logging.LogRecord) -> None:
                kept.records.append(record)
                call_handlers(self, record)
            call_handlers = logging.Logger.callHandlers
            undo.enter_context(mock.patch.object(logging.Logger, "callHandlers", breadcrumbs))
        elif change == "patched emit":
            emit = logging.StreamHandler.emit
            def emit_kept(self: logging.StreamHandler, record: logging.LogRecord) -> None:  # type: ignore[type-arg]
                kept.records.append(record)
                emit(self, record)
            undo.enter_context(mock.patch.object(logging.StreamHandler, "emit", emit_kept))
        elif change == "logger subclass":
            class Counting(logging.Logger):
                def handle(self, record: logging.LogRecord) -> None:
                    kept.records.append(record)
                    super().handle(record)
            runs.__class__ = Counting
            undo.callback(setattr, runs, "__class__", logging.Logger)
        elif change == "handler level":
            handler.setLevel(logging.WARNING)
        else:
            runs.propagate = False
            runs.addHandler(kept)
            undo.callback(setattr, runs, "propagate", True)
            undo.callback(runs.removeHandler, kept)
        assert not log_lines.write(runs, logging.INFO, END, ARGS)
        assert stream.getvalue() == ""  # nothing written by the direct path
        log_end("shop.checkout", SimpleNamespace(id="wf-1", run=2), Outcome(Status.SUCCEEDED), 0.0123)  # type: ignore[arg-type]
    if change.startswith("own format"):
        assert stream.getvalue() == "INFO workflow shop.checkout wf-1 succeeded in 0.012s (attempt 2)\n"
    elif change == "handler level":
        assert stream.getvalue() == ""  # the CLI's handler takes no INFO line
    else:
        assert [r.getMessage() for r in kept.records] == ["workflow shop.checkout wf-1 succeeded in 0.012s (attempt 2)"]


# -- what goes wrong is said by logging ------------------------------------------------------------------------


def test_a_line_for_a_broken_stream_goes_through_logging_which_says_what_broke() -> None:
    class Broken(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError("the pipe is gone")

    with cli_logging() as (_, runs), mock.patch.object(log_lines.Lines, "handleError") as said:
        logging.root.handlers[0].setStream(Broken())  # type: ignore[attr-defined]
        assert not log_lines.write(runs, logging.INFO, END, ARGS)
        log_end("shop.checkout", SimpleNamespace(id="wf-1", run=2), Outcome(Status.SUCCEEDED), 0.0123)  # type: ignore[arg-type]
    assert said.call_count == 1 and said.call_args.args[0].getMessage().startswith("workflow shop.checkout wf-1")


def test_a_line_whose_arguments_do_not_fit_is_left_to_logging_and_nothing_is_written() -> None:
    with cli_logging() as (stream, runs), mock.patch.object(log_lines.Lines, "handleError") as said:
        assert not log_lines.write(runs, logging.INFO, "workflow %d", ("not a number",))
        runs.info("workflow %d", "not a number")  # (what the caller then does)
    assert said.call_count == 1 and stream.getvalue() == ""  # logging's own report of the bad line
