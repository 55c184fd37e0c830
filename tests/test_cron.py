"""Cron schedules: the parser and ``next_after`` (pure unit tests), and a schedule served by several
worker processes at once, each tick of which must run exactly once."""

from __future__ import annotations

import re
import signal
from collections import Counter
from datetime import UTC, datetime, timedelta, timezone

import pytest

import pgflow
from pgflow.cron import Cron

from .apps import fleet
from .helpers import query_sync, registered_pids
from .processes import Processes, fleet_worker, wait_until


def at(text: str) -> datetime:
    """A UTC moment from 'YYYY-MM-DD HH:MM:SS'."""
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)


def ticks(expression: str, start: str, n: int) -> list[str]:
    """The first ``n`` ticks strictly after ``start``, formatted like ``start``."""
    cron, moment, found = Cron.parse(expression), at(start), []
    for _ in range(n):
        moment = cron.next_after(moment)
        found.append(moment.strftime("%Y-%m-%d %H:%M:%S"))
    return found


# -- parsing ---------------------------------------------------------------------------------------------


def test_five_fields_mean_minute_hour_day_month_weekday_at_second_zero() -> None:
    cron = Cron.parse("30 4 15 6 3")
    assert cron.seconds == {0}
    assert (cron.minutes, cron.hours, cron.days, cron.months, cron.weekdays) == ({30}, {4}, {15}, {6}, {3})


def test_six_fields_put_seconds_first() -> None:
    cron = Cron.parse("10 30 4 15 6 3")
    assert (cron.seconds, cron.minutes, cron.hours) == ({10}, {30}, {4})
    assert (cron.days, cron.months, cron.weekdays) == ({15}, {6}, {3})


@pytest.mark.parametrize(("field", "values"), [
    ("*", set(range(60))),
    ("7", {7}),
    ("10-14", {10, 11, 12, 13, 14}),
    ("*/15", {0, 15, 30, 45}),
    ("5/20", {5, 25, 45}),  # a start with a step runs to the end of the field's range
    ("10-30/10", {10, 20, 30}),
    ("1,2,40-42,*/30", {0, 1, 2, 30, 40, 41, 42}),
    ("0-59", set(range(60))),
])
def test_field_syntax(field: str, values: set[int]) -> None:
    assert Cron.parse(f"{field} * * * *").minutes == values


def test_field_bounds_per_field() -> None:
    cron = Cron.parse("59 23 31 12 6")
    assert (cron.minutes, cron.hours, cron.days, cron.months, cron.weekdays) == ({59}, {23}, {31}, {12}, {6})
    cron = Cron.parse("0 0 0 1 1 0")
    assert (cron.seconds, cron.minutes, cron.hours, cron.days, cron.months, cron.weekdays) == (
        {0}, {0}, {0}, {1}, {1}, {0})


def test_weekday_seven_is_sunday() -> None:
    assert Cron.parse("0 0 * * 7").weekdays == {0}
    assert Cron.parse("0 0 * * 5-7").weekdays == {5, 6, 0}
    assert Cron.parse("0 0 * * *").weekdays == set(range(7))


@pytest.mark.parametrize(("expression", "field"), [
    ("60 * * * *", "minute"),
    ("* 24 * * *", "hour"),
    ("* * 0 * *", "day"),
    ("* * 32 * *", "day"),
    ("* * * 0 *", "month"),
    ("* * * 13 *", "month"),
    ("* * * * 8", "weekday"),
    ("60 * * * * *", "second"),
    ("*/0 * * * *", "minute"),
    ("* 5-3 * * *", "hour"),
    ("* * * 1-13 *", "month"),
])
def test_out_of_range_field_raises_value_error_naming_the_field(expression: str, field: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{field} field\b") as raised:
        Cron.parse(expression)
    assert expression in str(raised.value)


@pytest.mark.parametrize(("expression", "field"), [
    ("x * * * *", "minute"),
    ("* */x * * *", "hour"),
    ("* * 1,,2 * *", "day"),
    ("* * * jan *", "month"),
    ("* * * * 1-2-3", "weekday"),
    ("-1 * * * * *", "second"),
])
def test_non_numeric_field_raises_value_error_naming_the_field(expression: str, field: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{field} field\b"):
        Cron.parse(expression)


@pytest.mark.parametrize("expression", ["", "* * * *", "* * * * * * *", "0 0 * *"])
def test_wrong_number_of_fields_raises_value_error(expression: str) -> None:
    with pytest.raises(ValueError, match="needs 5 fields"):
        Cron.parse(expression)


def test_a_schedule_that_never_fires_is_refused_when_parsed() -> None:
    with pytest.raises(ValueError, match="never fires"):
        Cron.parse("0 0 30 2 *")  # February 30th


def test_a_bad_schedule_is_refused_when_the_workflow_is_registered() -> None:
    app = pgflow.App(dsn="postgresql://nobody@127.0.0.1:1/unused")
    with pytest.raises(ValueError, match="hour field"):
        @app.workflow(schedule="0 25 * * *")
        def never() -> None: ...
    assert app.workflows == {}


# -- next_after ------------------------------------------------------------------------------------------


def test_every_second() -> None:
    assert ticks("* * * * * *", "2025-03-01 12:00:00", 3) == [
        "2025-03-01 12:00:01", "2025-03-01 12:00:02", "2025-03-01 12:00:03"]


def test_next_after_is_strictly_after_even_on_a_tick() -> None:
    cron = Cron.parse("0 12 * * *")
    assert cron.next_after(at("2025-03-01 12:00:00")) == at("2025-03-02 12:00:00")
    assert cron.next_after(at("2025-03-01 11:59:59")) == at("2025-03-01 12:00:00")
    assert cron.next_after(at("2025-03-01 11:59:59") + timedelta(microseconds=999_999)) == at("2025-03-01 12:00:00")
    every = Cron.parse("* * * * * *")
    assert every.next_after(at("2025-03-01 12:00:00") + timedelta(microseconds=1)) == at("2025-03-01 12:00:01")


def test_result_is_utc_and_other_zones_are_converted() -> None:
    cron = Cron.parse("0 12 * * *")
    moment = datetime(2025, 3, 1, 13, 30, tzinfo=timezone(timedelta(hours=2)))  # 11:30 UTC
    tick = cron.next_after(moment)
    assert tick == at("2025-03-01 12:00:00")
    assert tick.utcoffset() == timedelta(0)


def test_minutes_hours_and_rollovers() -> None:
    assert ticks("*/20 * * * *", "2025-12-31 23:30:00", 3) == [
        "2025-12-31 23:40:00", "2026-01-01 00:00:00", "2026-01-01 00:20:00"]
    assert ticks("15 9-10 * * *", "2025-03-01 10:15:00", 2) == ["2025-03-02 09:15:00", "2025-03-02 10:15:00"]
    assert ticks("0 0 1 * *", "2025-01-31 08:00:00", 3) == [
        "2025-02-01 00:00:00", "2025-03-01 00:00:00", "2025-04-01 00:00:00"]
    assert ticks("30 0 0 1 1 *", "2025-06-01 00:00:00", 2) == ["2026-01-01 00:00:30", "2027-01-01 00:00:30"]


def test_a_day_that_some_months_lack_is_skipped_in_those_months() -> None:
    assert ticks("0 0 31 * *", "2025-01-31 00:00:00", 3) == [
        "2025-03-31 00:00:00", "2025-05-31 00:00:00", "2025-07-31 00:00:00"]


def test_february_29th_fires_in_leap_years_only() -> None:
    assert ticks("0 12 29 2 *", "2025-01-01 00:00:00", 3) == [
        "2028-02-29 12:00:00", "2032-02-29 12:00:00", "2036-02-29 12:00:00"]
    assert ticks("0 12 29 2 *", "2399-03-01 00:00:00", 1) == ["2400-02-29 12:00:00"]  # divisible by 400


def test_february_29th_across_a_century_without_leap_day() -> None:
    # 2100 is not a leap year (divisible by 100, not by 400): 2096 is followed by 2104.
    assert ticks("0 12 29 2 *", "2096-03-01 00:00:00", 1) == ["2104-02-29 12:00:00"]


def test_weekday_alone_restricts_to_that_weekday() -> None:
    # 2025-03-01 is a Saturday.
    assert ticks("0 9 * * 1", "2025-03-01 00:00:00", 2) == ["2025-03-03 09:00:00", "2025-03-10 09:00:00"]
    assert ticks("0 9 * * 7", "2025-03-01 00:00:00", 1) == ["2025-03-02 09:00:00"]
    assert ticks("0 9 * * 1-5", "2025-03-07 10:00:00", 2) == ["2025-03-10 09:00:00", "2025-03-11 09:00:00"]


def test_day_of_month_alone_restricts_to_that_day() -> None:
    assert ticks("0 9 13 * *", "2025-03-01 00:00:00", 2) == ["2025-03-13 09:00:00", "2025-04-13 09:00:00"]


def test_day_of_month_and_weekday_both_restricted_fire_on_either() -> None:
    # The 13th, or any Friday: classic cron's OR (2025-03-07, -14, -21 are Fridays; the 13th a Thursday).
    assert ticks("0 0 13 * 5", "2025-03-01 00:00:00", 5) == [
        "2025-03-07 00:00:00", "2025-03-13 00:00:00", "2025-03-14 00:00:00", "2025-03-21 00:00:00",
        "2025-03-28 00:00:00"]
    # Both restricted, and the month still must match: only in June (2025-06-01 is a Sunday).
    assert ticks("0 0 1 6 0", "2025-05-01 00:00:00", 3) == [
        "2025-06-01 00:00:00", "2025-06-08 00:00:00", "2025-06-15 00:00:00"]


# -- a schedule served by a fleet ------------------------------------------------------------------------


@pytest.mark.slow
def test_every_second_schedule_served_by_four_workers_runs_each_tick_once(
    app: pgflow.App, dsn: str, schema: str, worker_env: dict[str, str], procs: Processes,
) -> None:
    flows = fleet.build(app)
    name = flows.every_second.name
    app.migrate()
    query_sync(dsn, f'CREATE TABLE "{schema}".tick_runs (tick text NOT NULL, pid int NOT NULL)')
    workers = [fleet_worker(procs, f"worker-{i}", worker_env, queues=fleet.TICKS) for i in range(4)]
    wait_until(lambda: registered_pids(dsn, schema) == {w.pid for w in workers}, "4 workers to register",
               procs, *workers)
    [(all_up,)] = query_sync(dsn, "SELECT now()")

    def succeeded_since_all_up() -> int:
        return sum(1 for id, status in query_sync(dsn, f'SELECT id, status FROM "{schema}".workflows')
                   if status == "succeeded" and datetime.fromisoformat(id.partition("@")[2]) > all_up)

    wait_until(lambda: succeeded_since_all_up() >= 4, "4 ticks with all 4 workers up", procs, *workers)
    for w in workers:
        w.signal(signal.SIGTERM)
    for w in workers:
        assert w.wait_exit() == 0, procs.logs()

    rows = query_sync(dsn, f'SELECT id, name, status, attempt FROM "{schema}".workflows ORDER BY id')
    pattern = re.compile(rf"{re.escape(name)}@(.+)")
    by_tick: dict[datetime, tuple[str, int]] = {}
    for id, row_name, status, attempt in rows:
        assert row_name == name
        match = pattern.fullmatch(id)
        assert match, id
        tick = datetime.fromisoformat(match.group(1))
        assert tick.utcoffset() == timedelta(0) and tick.microsecond == 0, id
        by_tick[tick] = (status, attempt)
    succeeded = sorted(t for t, (status, _) in by_tick.items() if status == "succeeded")
    assert len(succeeded) >= 4
    # Every tick up to the last one run ran; only ticks started as the workers stopped may still wait,
    # never started.
    for tick, (status, attempt) in by_tick.items():
        if tick <= succeeded[-1]:
            assert (status, attempt) == ("succeeded", 1), (tick, status, rows)
        else:
            assert (status, attempt) == ("queued", 0), (tick, status, rows)
    # Each tick ran once, though four workers each started it; the tick it was given is its id's.
    runs = Counter(tick for tick, _ in query_sync(dsn, f'SELECT tick, pid FROM "{schema}".tick_runs'))
    assert runs == Counter({t.isoformat(): 1 for t in succeeded})
    for tick in succeeded:
        assert app.handle(f"{name}@{tick.isoformat()}").result(timeout=30) == tick.isoformat()
    # Several workers started ticks (the schedule loop runs in each); they were served by the fleet.
    pids = {pid for _, pid in query_sync(dsn, f'SELECT tick, pid FROM "{schema}".tick_runs')}
    assert pids <= {w.pid for w in workers}
    print(f"\n[cron] {len(succeeded)} ticks, run by {len(pids)} of 4 workers, each once")
