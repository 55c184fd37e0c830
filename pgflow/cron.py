"""Cron schedules: five fields (minute hour day month weekday), or six with seconds first.

Each field takes ``*``, numbers, ranges ``a-b``, steps ``*/n`` or ``a-b/n``, and lists of those. As in
classic cron, when both day of month and weekday are restricted, a day matching either one fires.
Weekdays count from 0 (Sunday) to 6; 7 is Sunday too. Times are UTC.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

_FIELDS = (("second", 0, 59), ("minute", 0, 59), ("hour", 0, 23), ("day", 1, 31), ("month", 1, 12),
           ("weekday", 0, 7))


def _parse_field(text: str, name: str, low: int, high: int) -> frozenset[int]:
    values: set[int] = set()
    for part in text.split(","):
        body, _, step_text = part.partition("/")
        try:
            step = int(step_text) if step_text else 1
            if body == "*":
                start, end = low, high
            elif "-" in body:
                a, b = body.split("-", 1)
                start, end = int(a), int(b)
            else:
                start = int(body)
                end = high if step_text else start
        except ValueError:
            raise ValueError(
                f"cron {name} field {text!r} is not a number, range (a-b), step (*/n) or list of those"
            ) from None
        if step < 1 or not low <= start <= end <= high:
            raise ValueError(f"cron {name} field {text!r} is outside {low}-{high}")
        values.update(range(start, end + 1, step))
    return frozenset(values)


@dataclass(frozen=True)
class Cron:
    expression: str
    seconds: frozenset[int]
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]
    any_day: bool
    any_weekday: bool

    @classmethod
    def parse(cls, expression: str) -> Cron:
        fields = expression.split()
        if len(fields) == 5:
            fields = ["0", *fields]
        if len(fields) != 6:
            raise ValueError(
                f"cron expression {expression!r} needs 5 fields (minute hour day month weekday) "
                "or 6 (second first)"
            )
        try:
            sets = [_parse_field(f, name, low, high) for f, (name, low, high) in zip(fields, _FIELDS,
                                                                                     strict=True)]
        except ValueError as exc:
            raise ValueError(f"bad cron expression {expression!r}: {exc}") from exc
        seconds, minutes, hours, days, months, weekdays = sets
        cron = cls(expression, seconds, minutes, hours, days, months, frozenset(d % 7 for d in weekdays),
                   any_day=fields[3] == "*", any_weekday=fields[5] == "*")
        cron.next_after(datetime(2000, 1, 1, tzinfo=UTC))  # refuse "never fires" (Feb 30) now
        return cron

    def _day_matches(self, moment: datetime) -> bool:
        day_ok = moment.day in self.days
        weekday_ok = (moment.isoweekday() % 7) in self.weekdays
        if self.any_day or self.any_weekday:
            return day_ok and weekday_ok
        return day_ok or weekday_ok

    def next_after(self, moment: datetime) -> datetime:
        """The first tick strictly after ``moment`` (an aware datetime; the result is UTC)."""
        t = moment.astimezone(UTC).replace(microsecond=0) + timedelta(seconds=1)
        limit = t + timedelta(days=146097)  # 400 years: the calendar repeats after that
        while t < limit:
            if t.month not in self.months:
                t = (t.replace(day=1, hour=0, minute=0, second=0) + timedelta(days=32)).replace(day=1)
            elif not self._day_matches(t):
                t = t.replace(hour=0, minute=0, second=0) + timedelta(days=1)
            elif t.hour not in self.hours:
                t = t.replace(minute=0, second=0) + timedelta(hours=1)
            elif t.minute not in self.minutes:
                t = t.replace(second=0) + timedelta(minutes=1)
            elif t.second not in self.seconds:
                t += timedelta(seconds=1)
            else:
                return t
        raise ValueError(f"cron expression {self.expression!r} never fires")
