"""The CLI's log stamps read exactly as logging's own, across second boundaries (no server needed)."""

from __future__ import annotations

import logging

from pgflow._core.log_lines import FORMAT, SecondStamps


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
