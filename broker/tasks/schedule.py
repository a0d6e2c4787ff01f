"""Periodic jobs: what runs when, declared once and enqueued once per tick.

A :class:`Schedule` names a task and when it runs: a 5-field ``cron`` expression in an
explicit IANA ``timezone``, or a fixed interval ``every=timedelta(...)`` anchored to the
Unix epoch in UTC (so every main computes the same ticks); :mod:`broker.tasks.triggers` computes
the ticks, :mod:`broker.main.scheduler` enqueues them. Declare one on the task
(``@task(cron="0 3 * * *", timezone="Europe/Paris")``) or build it and :func:`register`
it; ``broker-main --schedules MODULE`` imports the module and runs what it declared.

Exactly once, without a table of its own: each tick is enqueued with the idempotency key
``schedule:<name>:<tick in UTC, ISO 8601>`` (:meth:`Schedule.key`). The store keeps one
job per key for as long as that job is stored, across processes, so a restarted main, or
several mains on one PostgreSQL, enqueueing the same tick all get the same job. The
limit follows: a key is forgotten when its job is pruned.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from broker.exceptions import ConfigurationError, InvalidJobError
from broker.jobs import (
    DEFAULT_MAX_RETRIES,
    DEFAULT_QUEUE,
    ExecutionMode,
    JobSpec,
    JSONValue,
    spec_from,
)
from broker.tasks.triggers import EPOCH, CronExpression, Interval, Trigger, aware

KEY_PREFIX = "schedule:"


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
        return f"{KEY_PREFIX}{self.name}:{aware('tick', tick).isoformat()}"

    def spec(self, tick: datetime) -> JobSpec:
        """The job for ``tick``: due at the tick, keyed so it is stored once."""
        return spec_from(self, run_at=aware("tick", tick), idempotency_key=self.key(tick))

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


__all__ = [
    "KEY_PREFIX",
    "Schedule",
    "ScheduleRegistry",
    "declared_in",
    "default_schedules",
    "register",
]
