"""Periodic jobs: cron expressions and fixed intervals, each tick enqueued exactly once.

A :class:`Schedule` names a task and when it runs: a 5-field ``cron`` expression in an
explicit IANA ``timezone``, or a fixed interval ``every=timedelta(...)`` anchored to the
Unix epoch in UTC (so every main computes the same ticks). Declare one on the task
(``@task(cron="0 3 * * *", timezone="Europe/Paris")``) or build it and :func:`register`
it; ``broker-main --schedules MODULE`` imports the module and runs what it declared.

Exactly once, without a table of its own: the :class:`Scheduler` enqueues each tick with
the idempotency key ``schedule:<name>:<tick in UTC, ISO 8601>``. The store keeps one job
per key for as long as that job is stored, across processes, so a restarted main, or
several mains on one PostgreSQL, enqueueing the same tick all get the same job. The
limit follows: a key is forgotten when its job is pruned.

Cron follows Vixie cron: ``minute hour day-of-month month day-of-week``, with ``*``,
lists ``a,b``, ranges ``a-b``, steps ``*/n``, ``a-b/n`` and ``a/n`` (``a`` to the
field's end), names ``jan``-``dec`` and ``sun``-``sat`` (day-of-week ``0`` and ``7`` are
both Sunday), and ``@yearly``, ``@monthly``, ``@weekly``, ``@daily``, ``@hourly``. When
both day fields are restricted (neither starts with ``*``) a day matches if *either*
does. Across daylight-saving changes a local time that does not exist is skipped, and
one that happens twice fires once, at its first occurrence.
"""

from __future__ import annotations

import asyncio
import calendar
import logging
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from broker.exceptions import ConfigurationError, InvalidJobError
from broker.jobs import (
    DEFAULT_MAX_RETRIES,
    DEFAULT_QUEUE,
    Clock,
    EnqueueResult,
    ExecutionMode,
    JobSpec,
    JSONValue,
    utcnow,
)

if TYPE_CHECKING:
    from broker.retention import Retention
    from broker.tasks import Task

logger = logging.getLogger("broker.schedule")

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
"""Where fixed intervals are anchored: every main derives the same ticks from it."""

KEY_PREFIX = "schedule:"

_ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
_MONTHS = {name.lower(): i for i, name in enumerate(calendar.month_abbr) if name}
_WEEKDAYS = {"sun": 0, "mon": 1, "tue": 2, "wed": 3, "thu": 4, "fri": 5, "sat": 6}
_SEARCH_YEARS = 100
"""How far ahead (or back) a tick is looked for; any valid expression matches far sooner."""
_ITEM = re.compile(r"^(?P<range>\*|[a-z0-9]+(?:-[a-z0-9]+)?)(?:/(?P<step>[0-9]+))?$")


@dataclass(frozen=True)
class _Field:
    name: str
    low: int
    high: int
    names: Mapping[str, int]


_FIELDS = (
    _Field("minute", 0, 59, {}),
    _Field("hour", 0, 23, {}),
    _Field("day-of-month", 1, 31, {}),
    _Field("month", 1, 12, _MONTHS),
    _Field("day-of-week", 0, 7, _WEEKDAYS),
)


def _value(spec: _Field, token: str, expr: str) -> int:
    if token.isdigit():
        number = int(token)
    elif token in spec.names:
        number = spec.names[token]
    else:
        allowed = f"{spec.low}-{spec.high}"
        if spec.names:
            allowed += " or a name (" + ", ".join(spec.names) + ")"
        raise ConfigurationError(
            f"cron expression {expr!r}: {spec.name} value {token!r} is not valid; use {allowed}"
        )
    if not spec.low <= number <= spec.high:
        raise ConfigurationError(
            f"cron expression {expr!r}: {spec.name} value {number} is out of range "
            f"{spec.low}-{spec.high}"
        )
    return number


def _parse_field(spec: _Field, text: str, expr: str) -> frozenset[int]:
    values: set[int] = set()
    for item in text.lower().split(","):
        match = _ITEM.match(item)
        if match is None:
            raise ConfigurationError(
                f"cron expression {expr!r}: {spec.name} item {item!r} is not valid; expected "
                "*, a number, a range a-b, or a step */n or a-b/n"
            )
        step = int(match["step"]) if match["step"] is not None else 1
        if step < 1:
            raise ConfigurationError(f"cron expression {expr!r}: {spec.name} step must be >= 1")
        part = match["range"]
        if part == "*":
            low, high = spec.low, spec.high
        elif "-" in part:
            first, last = part.split("-", 1)
            low, high = _value(spec, first, expr), _value(spec, last, expr)
            if low > high:
                raise ConfigurationError(
                    f"cron expression {expr!r}: {spec.name} range {part!r} runs backwards"
                )
        else:
            low = _value(spec, part, expr)
            high = spec.high if match["step"] is not None else low
        values.update(range(low, high + 1, step))
    if spec.name == "day-of-week" and 7 in values:
        values.discard(7)
        values.add(0)
    return frozenset(values)


def _zone(timezone: str) -> ZoneInfo:
    try:
        return ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ConfigurationError(
            f"timezone {timezone!r} is not a known IANA time zone (such as 'UTC' or "
            "'Europe/Paris'); on systems without a zone database, install the tzdata package"
        ) from exc


def _aware(name: str, value: datetime) -> datetime:
    if value.tzinfo is None:
        raise ValueError(f"{name} must be timezone-aware (got naive {value.isoformat()})")
    return value.astimezone(UTC)


def _instant(day: date, hour: int, minute: int, zone: ZoneInfo) -> datetime | None:
    """The UTC instant of a local wall time: ``None`` if it does not exist (a DST gap), the
    first occurrence if it happens twice (``fold=0``)."""
    wall = datetime(day.year, day.month, day.day, hour, minute)
    utc = wall.replace(tzinfo=zone).astimezone(UTC)
    if utc.astimezone(zone).replace(tzinfo=None) != wall:
        return None
    return utc


class Trigger(Protocol):
    """When a schedule fires: every tick is a UTC instant."""

    def next_after(self, when: datetime) -> datetime:
        """The first tick strictly after ``when``."""

    def latest_at_or_before(self, when: datetime) -> datetime:
        """The last tick at or before ``when``."""


class CronExpression:
    """A 5-field cron expression evaluated in one explicit time zone."""

    def __init__(self, expression: str, timezone: str) -> None:
        if not isinstance(expression, str) or not expression.strip():
            raise ConfigurationError("cron expression must be a non-empty string")
        self.expression = expression.strip()
        self.timezone = timezone
        self.zone = _zone(timezone)
        text = self.expression
        if text.startswith("@"):
            if text.lower() not in _ALIASES:
                raise ConfigurationError(
                    f"cron expression {text!r}: unknown shorthand; use one of "
                    + ", ".join(_ALIASES)
                )
            text = _ALIASES[text.lower()]
        parts = text.split()
        if len(parts) != 5:
            raise ConfigurationError(
                f"cron expression {self.expression!r} has {len(parts)} fields; expected 5: "
                "minute hour day-of-month month day-of-week"
            )
        fields = [
            _parse_field(spec, part, self.expression)
            for spec, part in zip(_FIELDS, parts, strict=True)
        ]
        self.minutes, self.hours, self.days, self.months, self.weekdays = fields
        # Vixie cron: a day field "restricts" unless it starts with "*"; with both
        # restricted, either may match (OR); otherwise both must (AND).
        self._day_or = not parts[2].startswith("*") and not parts[4].startswith("*")
        self._times = sorted((h, m) for h in self.hours for m in self.minutes)
        if not self._day_or and not any(
            day <= _days_in(month) for month in self.months for day in self.days
        ):
            raise ConfigurationError(
                f"cron expression {self.expression!r}: day-of-month never occurs in the "
                "given month(s), so it would never fire"
            )

    def __repr__(self) -> str:
        return f"CronExpression({self.expression!r}, {self.timezone!r})"

    def matches_day(self, day: date) -> bool:
        if day.month not in self.months:
            return False
        dom = day.day in self.days
        dow = day.isoweekday() % 7 in self.weekdays
        return (dom or dow) if self._day_or else (dom and dow)

    def _days(self, start: date, step: int) -> Iterator[date]:
        day = start
        limit = start.replace(year=start.year + step * _SEARCH_YEARS, day=1)
        while (day < limit) if step > 0 else (day > limit):
            if self.matches_day(day):
                yield day
            day += timedelta(days=step)

    def next_after(self, when: datetime) -> datetime:
        after = _aware("when", when)
        local = after.astimezone(self.zone)
        wall = (local.hour, local.minute)
        start = local.date()
        for day in self._days(start, 1):
            for hour, minute in self._times:
                # First occurrences keep wall order, so an earlier wall time today is
                # an earlier instant and can be passed over without converting it.
                if day == start and (hour, minute) < wall:
                    continue
                tick = _instant(day, hour, minute, self.zone)
                if tick is not None and tick > after:
                    return tick
        raise ConfigurationError(f"{self!r} has no tick within {_SEARCH_YEARS} years")

    def latest_at_or_before(self, when: datetime) -> datetime:
        until = _aware("when", when)
        local = until.astimezone(self.zone)
        start = local.date()
        # During a repeated hour, a later wall time may be an earlier instant; no DST
        # shift is longer than three hours.
        horizon = local.hour * 60 + local.minute + 180
        for day in self._days(start, -1):
            for hour, minute in reversed(self._times):
                if day == start and hour * 60 + minute > horizon:
                    continue
                tick = _instant(day, hour, minute, self.zone)
                if tick is not None and tick <= until:
                    return tick
        raise ConfigurationError(f"{self!r} has no tick within {_SEARCH_YEARS} years")


def _days_in(month: int) -> int:
    return 29 if month == 2 else calendar.monthrange(2001, month)[1]


class Interval:
    """Ticks every ``every``, at whole multiples of it since the Unix epoch (UTC)."""

    def __init__(self, every: timedelta) -> None:
        if not isinstance(every, timedelta):
            raise ConfigurationError(f"every must be a datetime.timedelta (got {every!r})")
        if every < timedelta(seconds=1):
            raise ConfigurationError(f"every must be at least one second (got {every})")
        self.every = every

    def __repr__(self) -> str:
        return f"Interval({self.every!r})"

    def latest_at_or_before(self, when: datetime) -> datetime:
        return EPOCH + ((_aware("when", when) - EPOCH) // self.every) * self.every

    def next_after(self, when: datetime) -> datetime:
        return self.latest_at_or_before(when) + self.every


@dataclass(frozen=True)
class Schedule:
    """A task to enqueue on every tick of a cron expression or a fixed interval.

    ``name`` is unique among a main's schedules and part of every tick's key, so keep it
    stable across deployments. ``timezone`` is required with ``cron`` (``"UTC"`` is
    fine): there is no silent local time. ``catch_up``: when the main starts, the most
    recent tick that has passed is enqueued once (``True``, the default) or skipped.
    The remaining fields are the jobs' options, as in :class:`broker.jobs.JobSpec`.
    """

    name: str
    task: str
    cron: str | None = None
    every: timedelta | None = None
    timezone: str | None = None
    args: Sequence[JSONValue] = ()
    kwargs: Mapping[str, JSONValue] = field(default_factory=dict)
    catch_up: bool = True
    queue: str = DEFAULT_QUEUE
    priority: int = 0
    max_attempts: int = DEFAULT_MAX_RETRIES + 1
    timeout: float | None = None
    execution_mode: ExecutionMode = ExecutionMode.POOLED
    concurrency_key: str | None = None
    concurrency_limit: int | None = None
    trigger: Trigger = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigurationError("schedule name must be a non-empty string")
        where = f"schedule {self.name!r}"
        if (self.cron is None) == (self.every is None):
            raise ConfigurationError(f"{where}: give exactly one of cron= or every=")
        trigger: Trigger
        if self.cron is not None:
            if not self.timezone:
                raise ConfigurationError(
                    f"{where}: cron= needs an explicit timezone= (for example 'UTC' or "
                    "'Europe/Paris'); the main's local time is never assumed"
                )
            try:
                trigger = CronExpression(self.cron, self.timezone)
            except ConfigurationError as exc:
                raise ConfigurationError(f"{where}: cron= {exc}") from None
        else:
            if self.timezone is not None:
                raise ConfigurationError(
                    f"{where}: timezone= applies to cron= only; every= ticks are anchored to "
                    "the Unix epoch in UTC (use cron= for local wall-clock times)"
                )
            assert self.every is not None
            try:
                trigger = Interval(self.every)
            except ConfigurationError as exc:
                raise ConfigurationError(f"{where}: {exc}") from None
        if not isinstance(self.catch_up, bool):
            raise ConfigurationError(f"{where}: catch_up must be True or False")
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "kwargs", dict(self.kwargs))
        object.__setattr__(self, "trigger", trigger)
        try:
            self.spec(EPOCH)
        except InvalidJobError as exc:
            raise ConfigurationError(f"{where}: {exc}") from None

    def key(self, tick: datetime) -> str:
        """The idempotency key of this schedule's job for ``tick``."""
        return f"{KEY_PREFIX}{self.name}:{_aware('tick', tick).isoformat()}"

    def spec(self, tick: datetime) -> JobSpec:
        """The job for ``tick``: due at the tick, keyed so it is stored once."""
        return JobSpec(
            task=self.task,
            args=self.args,
            kwargs=self.kwargs,
            queue=self.queue,
            priority=self.priority,
            run_at=_aware("tick", tick),
            max_attempts=self.max_attempts,
            idempotency_key=self.key(tick),
            concurrency_key=self.concurrency_key,
            concurrency_limit=self.concurrency_limit,
            timeout=self.timeout,
            execution_mode=self.execution_mode,
        )

    def next_after(self, when: datetime) -> datetime:
        return self.trigger.next_after(when)

    def latest_at_or_before(self, when: datetime) -> datetime:
        return self.trigger.latest_at_or_before(when)


class ScheduleRegistry:
    """Schedules by name; registering the same definition again is harmless."""

    def __init__(self) -> None:
        self._schedules: dict[str, Schedule] = {}

    def add(self, schedule: Schedule) -> Schedule:
        if not isinstance(schedule, Schedule):
            raise ConfigurationError(f"expected a Schedule (got {schedule!r})")
        existing = self._schedules.get(schedule.name)
        if existing is not None and existing != schedule:
            raise ConfigurationError(
                f"two different schedules are named {schedule.name!r}; schedule names must "
                "be unique (for @task, give the task an explicit name=)"
            )
        self._schedules[schedule.name] = schedule
        return schedule

    def get(self, name: str) -> Schedule:
        try:
            return self._schedules[name]
        except KeyError:
            raise ConfigurationError(f"no schedule is named {name!r}") from None

    def discard(self, name: str) -> None:
        self._schedules.pop(name, None)

    def all(self) -> list[Schedule]:
        return [self._schedules[name] for name in sorted(self._schedules)]

    def __contains__(self, name: object) -> bool:
        return name in self._schedules

    def __len__(self) -> int:
        return len(self._schedules)


default_schedules = ScheduleRegistry()
"""The process-wide schedules that ``@task(cron=...)``, ``@task(every=...)`` and
:func:`register` fill, and ``broker-main --schedules`` runs."""


def register(*schedules: Schedule, registry: ScheduleRegistry | None = None) -> list[Schedule]:
    """Register schedules (in :data:`default_schedules` unless told otherwise)."""
    target = default_schedules if registry is None else registry
    return [target.add(schedule) for schedule in schedules]


def schedule_for_task(
    task: Task[..., Any],
    *,
    cron: str | None,
    every: timedelta | None,
    timezone: str | None,
    catch_up: bool | None,
) -> Schedule | None:
    """The schedule ``@task(cron=..., every=..., ...)`` declares, named after the task, with
    the task's job options; ``None`` when the decorator declares none."""
    if cron is None and every is None and timezone is None and catch_up is None:
        return None
    return Schedule(
        name=task.name,
        task=task.name,
        cron=cron,
        every=every,
        timezone=timezone,
        catch_up=True if catch_up is None else catch_up,
        queue=task.queue,
        priority=task.priority,
        max_attempts=task.retries + 1,
        timeout=task.timeout,
        execution_mode=task.execution_mode,
        concurrency_key=task.concurrency_key,
        concurrency_limit=task.concurrency_limit,
    )


def declared_in(modules: Sequence[str]) -> list[Schedule]:
    """Every registered schedule once ``modules`` are imported: ``@task`` declarations, any
    :func:`register` calls, and each module's ``schedules`` list if it has one."""
    for name in modules:
        declared = getattr(sys.modules.get(name), "schedules", None)
        if declared is None:
            continue
        if isinstance(declared, Schedule) or not isinstance(declared, Sequence):
            raise ConfigurationError(f"{name}.schedules must be a list of Schedule objects")
        register(*declared)
    found = default_schedules.all()
    if modules and not found:
        raise ConfigurationError(
            f"no schedules declared in {', '.join(modules)}: use @task(cron=..., timezone=...) "
            "or @task(every=...), register(Schedule(...)), or a module-level schedules list"
        )
    return found


def catch_up_window(retention: Retention | None) -> timedelta | None:
    """How far back a catch-up tick's key can be trusted: the shortest time retention keeps
    a finished job (``None``: forever). ``max_terminal_rows`` is not counted; keep it well
    above the number of jobs made in a schedule's longest period."""
    if retention is None:
        return None
    ttls = [t for t in (retention.completed_ttl, retention.dead_ttl) if t is not None]
    return min(ttls, default=None)


class _Store(Protocol):
    async def enqueue(self, spec: JobSpec) -> EnqueueResult: ...


class Scheduler:
    """Enqueues each schedule's ticks as they come due, each under its tick key.

    On start, a schedule with ``catch_up`` enqueues its most recent past tick (a no-op if
    that tick's job is already stored); one without starts at its next tick. Then it
    sleeps until the earliest next tick, re-reads the clock on waking, and never enqueues
    a tick before its time. If it falls behind by more than one tick (a long store
    outage, a stalled process), only the most recent tick is enqueued: the ones in
    between count as missed. Store errors are logged and retried; the key makes a retry
    safe. A job the store refuses as invalid (too large, say) is logged and its tick
    skipped, as retrying could not help.

    ``catch_up_window``: how long the store keeps a finished job (the retention TTL, see
    :func:`catch_up_window`). A past tick older than that may have run already and had
    its job, and so its key, pruned; catching it up could run it twice, so it is skipped
    with a warning. ``None``: jobs are kept forever and any past tick is caught up.
    """

    def __init__(
        self,
        store: _Store,
        schedules: Sequence[Schedule],
        *,
        clock: Clock = utcnow,
        on_enqueued: Callable[[], None] | None = None,
        error_retry_interval: float = 1.0,
        max_sleep: float = 60.0,
        catch_up_window: timedelta | None = None,
    ) -> None:
        names = [s.name for s in schedules]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigurationError(f"schedule names must be unique; repeated: {duplicates}")
        if not error_retry_interval > 0 or not max_sleep > 0:
            raise ConfigurationError("error_retry_interval and max_sleep must be positive")
        self.store = store
        self.schedules = list(schedules)
        self._clock = clock
        self._on_enqueued = on_enqueued
        self._retry = timedelta(seconds=error_retry_interval)
        self._max_sleep = max_sleep
        self._window = catch_up_window
        self._due: dict[str, datetime] = {}
        """Per schedule, the earliest tick not yet enqueued."""
        self._retry_at: datetime | None = None

    def start(self) -> None:
        """Decide each schedule's first tick from the clock (``run`` calls this)."""
        now = self._clock()
        for schedule in self.schedules:
            latest = schedule.latest_at_or_before(now)
            if latest == now:
                self._due[schedule.name] = latest
                continue
            self._due[schedule.name] = schedule.next_after(now)
            if not schedule.catch_up:
                continue
            if self._window is not None and latest < now - self._window:
                logger.warning(
                    "schedule not catching up: its last tick is older than retention keeps "
                    "jobs, so it may have run and been pruned schedule=%s tick=%s retention=%s",
                    schedule.name,
                    latest.isoformat(),
                    self._window,
                )
                continue
            self._due[schedule.name] = latest

    def next_tick(self) -> datetime | None:
        """When ``run_due`` next has work: the earliest tick still to enqueue, or the retry
        time after a store error."""
        retry = self._retry_at
        # A tick held back by a store error waits for the retry time, not zero seconds.
        return min(
            (t if retry is None else max(t, retry) for t in self._due.values()), default=None
        )

    async def run_due(self) -> int:
        """Enqueue every schedule's due tick; returns how many new jobs were stored."""
        if not self._due:
            self.start()
        now = self._clock()
        self._retry_at = None
        created = 0
        for schedule in self.schedules:
            if self._due[schedule.name] > now:
                continue
            tick = schedule.latest_at_or_before(now)
            if tick > self._due[schedule.name]:
                logger.warning(
                    "schedule fell behind, enqueueing only the latest tick schedule=%s "
                    "missed_from=%s tick=%s",
                    schedule.name,
                    self._due[schedule.name].isoformat(),
                    tick.isoformat(),
                )
            try:
                result = await self.store.enqueue(schedule.spec(tick))
            except asyncio.CancelledError:
                raise
            except InvalidJobError as exc:
                logger.error(
                    "schedule tick refused by the store, skipping it schedule=%s tick=%s error=%s",
                    schedule.name,
                    tick.isoformat(),
                    exc,
                )
            except Exception as exc:
                logger.warning(
                    "schedule enqueue failed, retrying schedule=%s tick=%s error=%r",
                    schedule.name,
                    tick.isoformat(),
                    exc,
                )
                self._retry_at = now + self._retry
                continue
            else:
                logger.info(
                    "schedule tick enqueued schedule=%s tick=%s job_id=%s duplicate=%s",
                    schedule.name,
                    tick.isoformat(),
                    result.job.id,
                    result.duplicate,
                )
                created += not result.duplicate
            self._due[schedule.name] = schedule.next_after(tick)
        if created and self._on_enqueued is not None:
            self._on_enqueued()
        return created

    async def run(self) -> None:
        """Run until cancelled."""
        if not self.schedules:
            return
        self.start()
        logger.info(
            "scheduler started schedules=%s",
            ",".join(f"{s.name}@{self._due[s.name].isoformat()}" for s in self.schedules),
        )
        while True:
            try:
                await self.run_due()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("scheduler pass failed, retrying")
                await asyncio.sleep(self._retry.total_seconds())
                continue
            wake = self.next_tick()
            assert wake is not None
            delay = (wake - self._clock()).total_seconds()
            # asyncio sleeps on the monotonic clock; the cap bounds the error if the wall
            # clock is stepped meanwhile, and run_due re-reads it on every wake.
            await asyncio.sleep(min(max(delay, 0.0), self._max_sleep))


__all__ = [
    "EPOCH",
    "CronExpression",
    "Interval",
    "Schedule",
    "ScheduleRegistry",
    "Scheduler",
    "Trigger",
    "catch_up_window",
    "declared_in",
    "default_schedules",
    "register",
    "schedule_for_task",
]
