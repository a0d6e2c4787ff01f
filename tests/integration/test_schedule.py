"""Periodic jobs: cron parsing and DST, interval grids, and each tick enqueued exactly once
across restarts and several mains on one store (memory, SQLite, PostgreSQL)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

import tests.schedule_app  # registers its schedules before the registry is snapshotted
from adapters.memory import MemoryAdapter
from adapters.sql import SQLAlchemyAdapter
from broker.exceptions import ConfigurationError, PayloadTooLargeError, StorageError
from broker.jobs import Clock, EnqueueResult, Job, JobSpec, utcnow
from broker.main.main import Main
from broker.main.retention import Retention
from broker.main.scheduler import Scheduler, catch_up_window
from broker.main.settings import MainSettings
from broker.ops import cli
from broker.storage import StorageAdapter
from broker.tasks.registry import TaskRegistry, task
from broker.tasks.schedule import (
    Schedule,
    ScheduleRegistry,
    declared_in,
    default_schedules,
    register,
)
from broker.tasks.triggers import EPOCH, CronExpression, Interval
from broker.testing import FakeClock
from tests.conftest import drop_schema, fresh_schema_name, require_postgres
from tests.support import until


def utc(*parts: int) -> datetime:
    return datetime(*parts, tzinfo=UTC)


def ticks(trigger: CronExpression | Interval, start: datetime, n: int) -> list[datetime]:
    out: list[datetime] = []
    for _ in range(n):
        start = trigger.next_after(start)
        out.append(start)
    return out


@pytest.fixture(autouse=True)
def _restore_default_schedules() -> Iterator[None]:
    saved = dict(default_schedules._schedules)
    yield
    default_schedules._schedules.clear()
    default_schedules._schedules.update(saved)


# ------------------------------------------------------------------ cron parsing


def test_fields_lists_ranges_steps_and_names() -> None:
    # Told by the ticks, since the fields are parsed by cronsim: minutes every 15, hours
    # 9-17 every 4 (9, 13, 17), the 1st or 15th or a weekday (both day fields restrict),
    # January to March, names in any case.
    cron = CronExpression("*/15 9-17/4 1,15 jan-MAR mon-fri", "UTC")
    assert ticks(cron, utc(2024, 1, 1), 6) == [
        utc(2024, 1, 1, 9),
        utc(2024, 1, 1, 9, 15),
        utc(2024, 1, 1, 9, 30),
        utc(2024, 1, 1, 9, 45),
        utc(2024, 1, 1, 13),
        utc(2024, 1, 1, 13, 15),
    ]
    # Friday 28 Feb 2025 17:45, then Saturday 1 March (the 1st), then Monday 3 March.
    assert ticks(cron, utc(2025, 2, 28, 17, 30), 3) == [
        utc(2025, 2, 28, 17, 45),
        utc(2025, 3, 1, 9),
        utc(2025, 3, 1, 9, 15),
    ]
    assert cron.next_after(utc(2025, 3, 2)) == utc(2025, 3, 3, 9)
    # After March, nothing until January.
    assert cron.next_after(utc(2024, 3, 29, 17, 45)) == utc(2025, 1, 1, 9)
    assert ticks(CronExpression("5/20 * * * *", "UTC"), utc(2024, 1, 1), 4) == [
        utc(2024, 1, 1, 0, 5),
        utc(2024, 1, 1, 0, 25),
        utc(2024, 1, 1, 0, 45),
        utc(2024, 1, 1, 1, 5),
    ]
    # 2024-01-05 is a Friday; day-of-week 0 and 7 are both Sunday.
    assert ticks(CronExpression("0 0 * * 7", "UTC"), utc(2024, 1, 1), 2) == [
        utc(2024, 1, 7),
        utc(2024, 1, 14),
    ]
    assert ticks(CronExpression("0 0 * * 5-7", "UTC"), utc(2024, 1, 1), 4) == [
        utc(2024, 1, 5),
        utc(2024, 1, 6),
        utc(2024, 1, 7),
        utc(2024, 1, 12),
    ]
    assert ticks(CronExpression("0 0 * * SUN,sat", "UTC"), utc(2024, 1, 1), 3) == [
        utc(2024, 1, 6),
        utc(2024, 1, 7),
        utc(2024, 1, 13),
    ]


@pytest.mark.parametrize(
    ("alias", "expanded"),
    [
        ("@hourly", "0 * * * *"),
        ("@daily", "0 0 * * *"),
        ("@weekly", "0 0 * * 0"),
        ("@monthly", "0 0 1 * *"),
        ("@yearly", "0 0 1 1 *"),
    ],
)
def test_shorthands_mean_their_expansion(alias: str, expanded: str) -> None:
    start = utc(2024, 5, 17, 13, 7)
    assert ticks(CronExpression(alias, "Europe/Paris"), start, 5) == ticks(
        CronExpression(expanded, "Europe/Paris"), start, 5
    )


def test_daily_fires_at_local_midnight() -> None:
    daily = CronExpression("@daily", "Europe/Paris")
    assert ticks(daily, utc(2024, 1, 10, 12), 2) == [utc(2024, 1, 10, 23), utc(2024, 1, 11, 23)]


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("61 * * * *", "minute field '61' is not valid; use 0-59"),
        ("* 24 * * *", "hour field '24' is not valid; use 0-23"),
        ("* * 0 * *", "day-of-month field '0' is not valid; use 1-31"),
        ("* * * 13 *", "month field '13' is not valid; use 1-12 or jan-dec"),
        ("* * * * 8", "day-of-week field '8' is not valid; use 0-7"),
        ("* * * foo *", "month field 'foo' is not valid"),
        ("* * * * funday", "day-of-week field 'funday' is not valid; use 0-7 (0 and 7 are Sunday)"),
        ("5-1 * * * *", "minute field '5-1' is not valid"),
        ("*/0 * * * *", "minute field '*/0' is not valid"),
        ("1,,2 * * * *", "minute field '1,,2' is not valid"),
        ("* * * *", "has 4 fields; expected 5"),
        ("* * * * * *", "has 6 fields; expected 5"),
        ("@reboot", "unknown shorthand"),
        ("0 0 30 feb *", "day-of-month field '30' is not valid; use 1-31, on a day the given"),
        ("", "non-empty"),
    ],
)
def test_invalid_expressions_name_the_field(expression: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        CronExpression(expression, "UTC")


def test_an_unknown_time_zone_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="not a known IANA time zone"):
        CronExpression("* * * * *", "Mars/Olympus_Mons")


def test_next_is_strictly_after_and_latest_is_at_or_before() -> None:
    cron = CronExpression("*/5 * * * *", "UTC")
    at_tick = utc(2024, 1, 1, 10, 5)
    assert cron.next_after(at_tick) == utc(2024, 1, 1, 10, 10)
    assert cron.latest_at_or_before(at_tick) == at_tick
    assert cron.latest_at_or_before(at_tick - timedelta(microseconds=1)) == utc(2024, 1, 1, 10)
    with pytest.raises(ValueError, match="timezone-aware"):
        cron.next_after(datetime(2024, 1, 1))


def test_day_of_month_or_day_of_week_when_both_are_restricted() -> None:
    # Vixie cron: the 13th *or* any Friday.
    either = CronExpression("0 0 13 * fri", "UTC")
    assert ticks(either, utc(2024, 1, 1), 4) == [
        utc(2024, 1, 5),
        utc(2024, 1, 12),
        utc(2024, 1, 13),
        utc(2024, 1, 19),
    ]
    # A day field starting with "*" does not restrict, so both must match (AND).
    both = CronExpression("0 0 */2 * fri", "UTC")
    assert ticks(both, utc(2024, 1, 1), 3) == [utc(2024, 1, 5), utc(2024, 1, 19), utc(2024, 2, 9)]
    assert ticks(CronExpression("0 0 * * fri", "UTC"), utc(2024, 1, 1), 2) == [
        utc(2024, 1, 5),
        utc(2024, 1, 12),
    ]
    assert CronExpression("0 0 29 2 *", "UTC").next_after(utc(2024, 3, 1)) == utc(2028, 2, 29)


def test_dst_a_local_time_that_does_not_exist_runs_at_the_end_of_the_gap() -> None:
    # Europe/Paris springs forward on 2024-03-31 at 02:00 -> 03:00: no 02:30 that day, so
    # a job at a named time runs at 03:00 instead (Debian cron), not skipped for the day.
    cron = CronExpression("30 2 * * *", "Europe/Paris")
    assert ticks(cron, utc(2024, 3, 29, 12), 3) == [
        utc(2024, 3, 30, 1, 30),  # 02:30 CET
        utc(2024, 3, 31, 1),  # 03:00 CEST, the first minute after the gap
        utc(2024, 4, 1, 0, 30),  # 02:30 CEST
    ]
    # An expression following elapsed time has no tick in the hour that does not exist.
    hourly = CronExpression("0 * * * *", "Europe/Paris")
    assert ticks(hourly, utc(2024, 3, 30, 23, 30), 3) == [
        utc(2024, 3, 31, 0),  # 01:00 CET
        utc(2024, 3, 31, 1),  # 03:00 CEST
        utc(2024, 3, 31, 2),  # 04:00 CEST
    ]


def test_dst_a_local_time_that_happens_twice_fires_once_at_its_first_occurrence() -> None:
    # Europe/Paris falls back on 2024-10-27 at 03:00 -> 02:00: 02:30 happens twice.
    cron = CronExpression("30 2 * * *", "Europe/Paris")
    assert ticks(cron, utc(2024, 10, 26, 12), 2) == [
        utc(2024, 10, 27, 0, 30),
        utc(2024, 10, 28, 1, 30),
    ]
    # Looking back from the second 02:45 (or 02:15) finds the first 02:30, not a second one.
    assert cron.latest_at_or_before(utc(2024, 10, 27, 1, 45)) == utc(2024, 10, 27, 0, 30)
    assert cron.latest_at_or_before(utc(2024, 10, 27, 1, 15)) == utc(2024, 10, 27, 0, 30)
    # From inside the second pass the next tick is the next day's, not the first pass's.
    assert cron.next_after(utc(2024, 10, 27, 1, 15)) == utc(2024, 10, 28, 1, 30)


def test_dst_an_expression_following_elapsed_time_fires_in_both_passes() -> None:
    # America/New_York falls back on 2024-11-03 at 02:00 -> 01:00: an hourly job runs
    # every hour that passes, the repeated one included (Debian cron).
    hourly = CronExpression("0 * * * *", "America/New_York")
    assert ticks(hourly, utc(2024, 11, 3, 3, 30), 4) == [
        utc(2024, 11, 3, 4),  # 00:00 EDT
        utc(2024, 11, 3, 5),  # 01:00 EDT
        utc(2024, 11, 3, 6),  # 01:00 EST
        utc(2024, 11, 3, 7),  # 02:00 EST
    ]
    half = CronExpression("*/30 1 * * *", "America/New_York")
    assert ticks(half, utc(2024, 11, 3, 4), 5) == [
        utc(2024, 11, 3, 5),
        utc(2024, 11, 3, 5, 30),
        utc(2024, 11, 3, 6),
        utc(2024, 11, 3, 6, 30),
        utc(2024, 11, 4, 6),
    ]
    assert half.latest_at_or_before(utc(2024, 11, 3, 6, 10)) == utc(2024, 11, 3, 6)


# ------------------------------------------------------------------ intervals


def test_intervals_sit_on_one_grid_from_the_epoch_whoever_computes_them() -> None:
    every = timedelta(minutes=15)
    first, second = Interval(every), Interval(every)
    a = ticks(first, utc(2024, 6, 1, 10, 7, 13), 4)
    b = ticks(second, utc(2024, 6, 1, 10, 22, 59), 3)
    assert a == [
        utc(2024, 6, 1, 10, 15),
        utc(2024, 6, 1, 10, 30),
        utc(2024, 6, 1, 10, 45),
        utc(2024, 6, 1, 11),
    ]
    assert b == a[1:]
    odd = Interval(timedelta(seconds=7))
    for start in (utc(2024, 6, 1), utc(2031, 2, 3, 4, 5, 6), utc(1999, 12, 31, 23, 59, 59)):
        tick = odd.next_after(start)
        assert (tick - EPOCH) % timedelta(seconds=7) == timedelta(0)
        assert start < tick <= start + timedelta(seconds=7)
        assert odd.latest_at_or_before(tick) == tick


# ------------------------------------------------------------------ declaring schedules


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cron": "* * * * *"}, "needs an explicit timezone="),
        ({"cron": "* * * * *", "every": timedelta(minutes=1), "timezone": "UTC"}, "exactly one"),
        ({}, "exactly one"),
        ({"every": timedelta(minutes=1), "timezone": "UTC"}, "timezone= applies to cron= only"),
        ({"every": timedelta(milliseconds=10)}, "at least one second"),
        ({"every": 60}, "must be a datetime.timedelta"),
        ({"cron": "* * * * 9", "timezone": "UTC"}, "cron= cron expression .*day-of-week"),
        ({"cron": "* * * * *", "timezone": "Nowhere/Land"}, "not a known IANA"),
        ({"every": timedelta(minutes=1), "args": [object()]}, "args is not JSON-serialisable"),
        ({"every": timedelta(minutes=1), "priority": "high"}, "priority must be an integer"),
    ],
)
def test_schedule_configuration_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=f"schedule 'job'.*{message}"):
        Schedule(name="job", task="app.job", **kwargs)


def test_the_tick_job_is_keyed_and_due_at_its_tick() -> None:
    schedule = Schedule(
        name="report",
        task="app.report",
        cron="0 9 * * mon",
        timezone="Europe/Paris",
        args=[1],
        kwargs={"x": "y"},
        queue="reports",
        priority=3,
        max_attempts=2,
    )
    tick = schedule.next_after(utc(2024, 1, 1, 12))
    assert tick == utc(2024, 1, 8, 8)
    spec = schedule.spec(tick)
    assert spec.idempotency_key == "schedule:report:2024-01-08T08:00:00+00:00"
    assert spec.run_at == tick
    assert (spec.task, spec.args, spec.kwargs) == ("app.report", (1,), {"x": "y"})
    assert (spec.queue, spec.priority, spec.max_attempts) == ("reports", 3, 2)


def test_task_decorator_declares_a_schedule_with_the_task_options() -> None:
    tasks = TaskRegistry()

    @task(
        name="app.cleanup",
        cron="0 3 * * *",
        timezone="Europe/Paris",
        catch_up=False,
        queue="maintenance",
        retries=2,
        mode="inline",
        registry=tasks,
    )
    def cleanup() -> None: ...

    @task(name="app.plain", registry=tasks)
    def plain() -> None: ...

    schedule = default_schedules.get("app.cleanup")
    assert (schedule.task, schedule.cron, schedule.timezone) == (
        "app.cleanup",
        "0 3 * * *",
        "Europe/Paris",
    )
    assert (schedule.catch_up, schedule.queue, schedule.max_attempts) == (False, "maintenance", 3)
    assert schedule.execution_mode.value == "inline"
    assert "app.plain" not in default_schedules
    assert tasks.names() == ["app.cleanup", "app.plain"]


def test_a_bad_schedule_on_a_task_fails_the_import_and_registers_nothing() -> None:
    tasks = TaskRegistry()
    with pytest.raises(ConfigurationError, match="needs an explicit timezone"):

        @task(name="app.local", cron="0 3 * * *", registry=tasks)
        def local() -> None: ...

    assert "app.local" not in tasks and "app.local" not in default_schedules


def test_schedule_names_are_unique() -> None:
    registry = ScheduleRegistry()
    one = Schedule(name="s", task="a", every=timedelta(minutes=1))
    register(one, registry=registry)
    register(Schedule(name="s", task="a", every=timedelta(minutes=1)), registry=registry)
    with pytest.raises(ConfigurationError, match="two different schedules are named 's'"):
        register(Schedule(name="s", task="b", every=timedelta(minutes=1)), registry=registry)
    with pytest.raises(ConfigurationError, match="names must be unique"):
        Scheduler(MemoryAdapter(), [one, Schedule(name="s", task="b", every=timedelta(hours=1))])


def test_declared_in_collects_task_declarations_and_module_lists() -> None:
    found = {s.name: s for s in declared_in(["tests.schedule_app"])}
    assert found["schedule_app.heartbeat"].every == timedelta(minutes=5)
    assert found["schedule_app.nightly-report"].catch_up is False
    default_schedules._schedules.clear()
    with pytest.raises(ConfigurationError, match=r"no schedules declared in tests\.conftest"):
        declared_in(["tests.conftest"])


def test_broker_main_takes_schedule_modules_from_flags_and_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert "BROKER_SCHEDULES" in cli.main_parser().format_help()
    monkeypatch.setenv("BROKER_SCHEDULES", "tests.schedule_app, ")
    args = cli.main_parser().parse_args(
        ["--port", "0", "--database-url", f"sqlite+aiosqlite:///{tmp_path / 'cli.db'}"]
    )
    seen: list[str] = []

    def ready(main: Main) -> None:
        seen.extend(s.name for s in main.leader.scheduler.schedules)
        asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGTERM)

    asyncio.run(cli.run_main(args, ready))
    assert {"schedule_app.heartbeat", "schedule_app.nightly-report"} <= set(seen)
    monkeypatch.setenv("BROKER_SCHEDULES", "tests.conftest")
    default_schedules._schedules.clear()
    with pytest.raises(ConfigurationError, match="no schedules declared"):
        asyncio.run(cli.run_main(cli.main_parser().parse_args(["--port", "0"])))


# ------------------------------------------------------------------ the scheduler, fake time


class RecordingStore:
    """Passes enqueues through, counting duplicates; fails the next ``failures`` calls."""

    def __init__(self, inner: StorageAdapter, error: Exception | None = None) -> None:
        self.inner = inner
        self.error = error or StorageError("injected")
        self.failures = 0
        self.results: list[EnqueueResult] = []

    async def enqueue(self, spec: JobSpec) -> EnqueueResult:
        if self.failures > 0:
            self.failures -= 1
            raise self.error
        result = await self.inner.enqueue(spec)
        self.results.append(result)
        return result


async def all_jobs(store: StorageAdapter) -> list[Job]:
    jobs: list[Job] = []
    cursor: str | None = None
    while True:
        page = await store.list_jobs(limit=500, cursor=cursor)
        jobs.extend(page.jobs)
        if page.next_cursor is None:
            return jobs
        cursor = page.next_cursor


async def keys(store: StorageAdapter) -> list[str]:
    return sorted(j.idempotency_key or "" for j in await all_jobs(store))


EVERY_MINUTE = Schedule(name="tick", task="app.tick", every=timedelta(minutes=1))
NO_CATCH_UP = Schedule(name="tick", task="app.tick", every=timedelta(minutes=1), catch_up=False)


def key(when: datetime) -> str:
    return EVERY_MINUTE.key(when)


async def test_a_tick_is_enqueued_once_and_never_early() -> None:
    clock = FakeClock(utc(2024, 1, 1, 10, 0, 30))
    store = MemoryAdapter(clock=clock)
    woken: list[int] = []
    scheduler = Scheduler(store, [NO_CATCH_UP], clock=clock, on_enqueued=lambda: woken.append(1))
    assert await scheduler.run_due() == 0
    assert scheduler.next_tick() == utc(2024, 1, 1, 10, 1)
    clock.set(utc(2024, 1, 1, 10, 0, 59, 999999))
    assert await scheduler.run_due() == 0 and await keys(store) == []
    clock.set(utc(2024, 1, 1, 10, 1))
    assert await scheduler.run_due() == 1
    assert await scheduler.run_due() == 0
    clock.advance(30)
    assert await scheduler.run_due() == 0
    assert await keys(store) == [key(utc(2024, 1, 1, 10, 1))]
    [job] = await all_jobs(store)
    assert job.run_at == utc(2024, 1, 1, 10, 1) and job.task == "app.tick"
    assert woken == [1]
    assert scheduler.next_tick() == utc(2024, 1, 1, 10, 2)


async def test_catch_up_enqueues_a_tick_missed_while_down_once() -> None:
    clock = FakeClock(utc(2024, 1, 1, 10, 0))
    store = MemoryAdapter(clock=clock)
    assert await Scheduler(store, [EVERY_MINUTE], clock=clock).run_due() == 1
    clock.set(utc(2024, 1, 1, 10, 3, 30))  # down for 10:01, 10:02 and 10:03
    restarted = Scheduler(store, [EVERY_MINUTE], clock=clock)
    assert await restarted.run_due() == 1
    assert await restarted.run_due() == 0
    # A second restart (or a second main) at the same moment finds the tick taken.
    again = RecordingStore(store)
    assert await Scheduler(again, [EVERY_MINUTE], clock=clock).run_due() == 0
    assert [r.duplicate for r in again.results] == [True]
    assert await keys(store) == [key(utc(2024, 1, 1, 10)), key(utc(2024, 1, 1, 10, 3))]


async def test_without_catch_up_a_tick_missed_while_down_is_skipped() -> None:
    clock = FakeClock(utc(2024, 1, 1, 10, 0))
    store = MemoryAdapter(clock=clock)
    assert await Scheduler(store, [NO_CATCH_UP], clock=clock).run_due() == 1  # on time
    clock.set(utc(2024, 1, 1, 10, 3, 30))
    restarted = Scheduler(store, [NO_CATCH_UP], clock=clock)
    assert await restarted.run_due() == 0
    clock.set(utc(2024, 1, 1, 10, 4))
    assert await restarted.run_due() == 1
    assert await keys(store) == [key(utc(2024, 1, 1, 10)), key(utc(2024, 1, 1, 10, 4))]


async def test_catch_up_skips_a_tick_older_than_retention_keeps_jobs() -> None:
    monthly = Schedule(name="monthly", task="app.m", cron="@monthly", timezone="UTC")
    clock = FakeClock(utc(2024, 1, 20))  # the last tick, Jan 1, is 19 days old
    store = MemoryAdapter(clock=clock)
    window = catch_up_window(Retention(completed_ttl=timedelta(days=7)))
    assert window == timedelta(days=7)
    kept_briefly = Scheduler(store, [monthly], clock=clock, catch_up_window=window)
    assert await kept_briefly.run_due() == 0  # its job may have been pruned: not again
    assert kept_briefly.next_tick() == utc(2024, 2, 1)
    kept_long = catch_up_window(Retention(completed_ttl=timedelta(days=40), dead_ttl=None))
    assert await Scheduler(store, [monthly], clock=clock, catch_up_window=kept_long).run_due() == 1
    assert catch_up_window(None) is None
    assert catch_up_window(Retention(completed_ttl=None, dead_ttl=None)) is None
    main = Main(store, MainSettings(port=0), schedules=[monthly], retention=Retention())
    # The default keeps completed jobs 7 days.
    assert main.leader.scheduler.catch_up_window == timedelta(days=7)


async def test_a_restart_just_after_a_tick_does_not_enqueue_it_again() -> None:
    clock = FakeClock(utc(2024, 1, 1, 10, 0, 59))
    store = MemoryAdapter(clock=clock)
    first = Scheduler(store, [EVERY_MINUTE], clock=clock)
    await first.run_due()
    clock.set(utc(2024, 1, 1, 10, 1))
    assert await first.run_due() == 1
    clock.advance(5)
    assert await Scheduler(store, [EVERY_MINUTE], clock=clock).run_due() == 0
    assert await keys(store) == [key(utc(2024, 1, 1, 10)), key(utc(2024, 1, 1, 10, 1))]


async def test_a_scheduler_that_fell_behind_enqueues_only_the_latest_tick() -> None:
    clock = FakeClock(utc(2024, 1, 1, 10, 0))
    store = MemoryAdapter(clock=clock)
    scheduler = Scheduler(store, [EVERY_MINUTE], clock=clock)
    await scheduler.run_due()
    clock.set(utc(2024, 1, 1, 10, 5, 30))
    assert await scheduler.run_due() == 1
    assert await keys(store) == [key(utc(2024, 1, 1, 10)), key(utc(2024, 1, 1, 10, 5))]
    assert scheduler.next_tick() == utc(2024, 1, 1, 10, 6)


async def test_store_errors_are_retried_later_and_the_tick_is_kept() -> None:
    clock = FakeClock(utc(2024, 1, 1, 10, 1))
    store = RecordingStore(MemoryAdapter(clock=clock))
    store.failures = 2
    other = Schedule(name="hourly", task="app.h", every=timedelta(hours=1), catch_up=False)
    scheduler = Scheduler(store, [NO_CATCH_UP, other], clock=clock, error_retry_interval=2)
    assert await scheduler.run_due() == 0
    assert scheduler.next_tick() == utc(2024, 1, 1, 10, 1, 2)  # the retry, not a busy loop
    clock.advance(2)
    assert await scheduler.run_due() == 0
    clock.advance(2)
    assert await scheduler.run_due() == 1
    assert await keys(store.inner) == [key(utc(2024, 1, 1, 10, 1))]
    assert scheduler.next_tick() == utc(2024, 1, 1, 10, 2)


async def test_a_tick_the_store_refuses_as_invalid_is_skipped() -> None:
    clock = FakeClock(utc(2024, 1, 1, 10, 1))
    store = RecordingStore(MemoryAdapter(clock=clock), PayloadTooLargeError("too big"))
    store.failures = 1
    scheduler = Scheduler(store, [NO_CATCH_UP], clock=clock)
    assert await scheduler.run_due() == 0
    assert scheduler.next_tick() == utc(2024, 1, 1, 10, 2)
    clock.advance(60)
    assert await scheduler.run_due() == 1


async def test_a_cron_schedule_in_a_time_zone_enqueues_its_local_tick() -> None:
    schedule = Schedule(name="paris", task="app.p", cron="0 9 * * *", timezone="Europe/Paris")
    clock = FakeClock(utc(2024, 7, 1, 6, 59, 59))
    store = MemoryAdapter(clock=clock)
    scheduler = Scheduler(store, [schedule], clock=clock)
    assert await scheduler.run_due() == 1  # catch-up: yesterday's 09:00
    clock.set(utc(2024, 7, 1, 7))  # 09:00 CEST
    assert await scheduler.run_due() == 1
    assert [j.run_at for j in sorted(await all_jobs(store), key=lambda j: j.run_at)] == [
        utc(2024, 6, 30, 7),
        utc(2024, 7, 1, 7),
    ]


# ------------------------------------------------------------------ shared stores, several mains


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def shared(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[Callable[..., SQLAlchemyAdapter]]:
    """Opens any number of adapter instances on one store, as separate mains would."""
    schema: str | None = None
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path / 'schedule.db'}"
    else:
        url, schema = require_postgres(), fresh_schema_name()
    opened: list[SQLAlchemyAdapter] = []

    def open_store(clock: Clock = utcnow) -> SQLAlchemyAdapter:
        store = SQLAlchemyAdapter(url, schema=schema, clock=clock)
        opened.append(store)
        return store

    setup = open_store()
    await setup.setup()
    yield open_store
    for store in opened:
        await store.close()
    if schema is not None:
        await drop_schema(schema)


async def test_two_schedulers_on_one_store_enqueue_each_cron_tick_once(
    shared: Callable[..., SQLAlchemyAdapter],
) -> None:
    schedule = Schedule(name="cron", task="app.c", cron="*/5 * * * *", timezone="Europe/Paris")
    clock = FakeClock(utc(2024, 1, 1, 10, 4, 59))
    a, b = RecordingStore(shared(clock)), RecordingStore(shared(clock))
    first = Scheduler(a, [schedule], clock=clock)
    second = Scheduler(b, [schedule], clock=clock)
    created = await asyncio.gather(first.run_due(), second.run_due())  # both catch up 10:00
    assert sum(created) == 1
    clock.set(utc(2024, 1, 1, 10, 5))
    for _ in range(3):
        created = await asyncio.gather(first.run_due(), second.run_due())
        assert sum(created) <= 1
    # A restart: a third scheduler on a fresh connection, a little later.
    clock.advance(20)
    assert await Scheduler(shared(clock), [schedule], clock=clock).run_due() == 0
    assert await keys(a.inner) == [
        schedule.key(utc(2024, 1, 1, 10)),
        schedule.key(utc(2024, 1, 1, 10, 5)),
    ]
    assert sum(r.duplicate for r in a.results + b.results) == 2


async def _run_for(scheduler: Scheduler) -> asyncio.Task[None]:
    return asyncio.create_task(scheduler.run())


async def _cancel(*tasks: asyncio.Task[None]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t


async def test_two_running_schedulers_and_a_restart_enqueue_every_second_once(
    shared: Callable[..., SQLAlchemyAdapter],
) -> None:
    schedule = Schedule(name="beat", task="app.beat", every=timedelta(seconds=1))
    a, b, c = (RecordingStore(shared()) for _ in range(3))
    first = await _run_for(Scheduler(a, [schedule]))
    second = await _run_for(Scheduler(b, [schedule]))

    def ticks() -> int:
        return len([r for r in a.results + b.results + c.results if not r.duplicate])

    # Waits on what was written, not on the clock, so a loaded machine only makes it slower.
    await until(lambda: ticks() >= 2 and any(r.duplicate for r in a.results + b.results))
    await _cancel(first)  # one main goes away; a replacement starts
    third = await _run_for(Scheduler(c, [schedule]))
    await until(lambda: ticks() >= 4 and c.results)
    await _cancel(second, third)

    jobs = await all_jobs(a.inner)
    assert Counter(j.idempotency_key for j in jobs).most_common(1)[0][1] == 1
    run_ats = sorted(j.run_at for j in jobs)
    assert len(run_ats) >= 4
    # Every second from the first tick to the last, each exactly once, none missing.
    assert run_ats == [run_ats[0] + timedelta(seconds=i) for i in range(len(run_ats))]
    assert all(j.idempotency_key == schedule.key(j.run_at) for j in jobs)
    assert max(run_ats) <= utcnow()
    attempts = a.results + b.results + c.results
    assert len([r for r in attempts if not r.duplicate]) == len(jobs)
    assert any(r.duplicate for r in attempts), "the schedulers never raced for a tick"


async def test_two_mains_and_a_restarted_main_enqueue_a_cron_tick_once(
    shared: Callable[..., SQLAlchemyAdapter],
) -> None:
    # Shift time so that a minute boundary (a cron tick) comes a few seconds after start.
    # On PostgreSQL one of the mains is elected and runs the schedules; when a main
    # stops, whichever leads next (a standby, or the restarted main) must not enqueue
    # the tick again.
    lead = 3.0
    boundary = utc(2031, 5, 6, 7, 8)
    offset = boundary - timedelta(seconds=lead) - utcnow()

    def clock() -> datetime:
        return utcnow() + offset

    schedule = Schedule(name="minutely", task="app.m", cron="* * * * *", timezone="Europe/Paris")
    settings = MainSettings(port=0, error_retry_interval=0.05, poll_interval=0.05)
    mains = [Main(shared(clock), settings, clock=clock, schedules=[schedule]) for _ in range(2)]
    await asyncio.gather(*(m.start() for m in mains))
    restarted: Main | None = None
    try:
        assert clock() < boundary, "the mains started after the tick: raise the lead"
        store = shared(clock)
        expected = [schedule.key(boundary - timedelta(minutes=1)), schedule.key(boundary)]

        async def both_ticks() -> bool:
            return await keys(store) == expected

        await until(both_ticks, timeout=lead + 5)
        await mains[0].stop()
        restarted = Main(shared(clock), settings, clock=clock, schedules=[schedule])
        await restarted.start()

        def past_the_tick() -> bool:
            # The leader's scheduler has dealt with the boundary's tick (caught up on it,
            # the store finding it there already) once its next tick is a later one.
            ticks = [m.leader.scheduler.next_tick() for m in (mains[1], restarted) if m.leading]
            return bool(ticks) and all(t is not None and t > boundary for t in ticks)

        await until(past_the_tick, timeout=10)
        assert await keys(store) == expected
        assert len(await all_jobs(store)) == 2
    finally:
        for main in [*mains, *([restarted] if restarted else [])]:
            await main.stop()


async def test_main_enqueues_a_schedule_declared_on_a_task() -> None:
    @task(name="app.every_second", every=timedelta(seconds=1), registry=TaskRegistry())
    def every_second() -> None: ...

    store = MemoryAdapter()
    main = Main(store, MainSettings(port=0), schedules=[default_schedules.get("app.every_second")])
    await main.start()
    try:

        async def two_ticks() -> bool:
            return len(await all_jobs(store)) >= 2

        await until(two_ticks, timeout=5)
    finally:
        await main.stop()
    jobs = await all_jobs(store)
    assert {j.task for j in jobs} == {"app.every_second"}
    assert all(j.run_at.microsecond == 0 for j in jobs)
    assert all((j.idempotency_key or "").startswith("schedule:app.every_second:") for j in jobs)
    assert tests.schedule_app.registry.names() == ["schedule_app.heartbeat"]
