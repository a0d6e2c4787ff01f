"""The scheduler loop: enqueues each schedule's ticks as they come due, each once.

The rules of a schedule live in :mod:`broker.tasks.schedule` and its ticks in
:mod:`broker.tasks.triggers`; this module owns the clock, the sleeping and the store errors.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Protocol

from broker.exceptions import ConfigurationError, InvalidJobError
from broker.jobs import Clock, EnqueueResult, JobSpec, utcnow
from broker.main.loops import retrying
from broker.main.retention import Retention
from broker.model.logs import log_event
from broker.tasks.schedule import Schedule

logger = logging.getLogger("broker.schedule")
"""Named as before the split, so operators' log filters keep matching."""


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
        self.catch_up_window = catch_up_window
        """How far back a missed tick is still enqueued (``None``: any tick)."""
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
            if self.catch_up_window is not None and latest < now - self.catch_up_window:
                log_event(
                    logger,
                    logging.WARNING,
                    "schedule not catching up: its last tick is older than retention keeps "
                    "jobs, so it may have run and been pruned",
                    schedule=schedule.name,
                    tick=latest.isoformat(),
                    retention=self.catch_up_window,
                )
                continue
            self._due[schedule.name] = latest

    def ticks(self) -> dict[str, datetime]:
        """Each started schedule's next tick to enqueue, by name (the dashboard shows them)."""
        return dict(self._due)

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
                log_event(
                    logger,
                    logging.WARNING,
                    "schedule fell behind, enqueueing only the latest tick",
                    schedule=schedule.name,
                    missed_from=self._due[schedule.name].isoformat(),
                    tick=tick.isoformat(),
                )
            try:
                result = await self.store.enqueue(schedule.spec(tick))
            except asyncio.CancelledError:
                raise
            except InvalidJobError as exc:
                log_event(
                    logger,
                    logging.ERROR,
                    "schedule tick refused by the store, skipping it",
                    schedule=schedule.name,
                    tick=tick.isoformat(),
                    error=exc,
                )
            except Exception as exc:
                log_event(
                    logger,
                    logging.WARNING,
                    "schedule enqueue failed, retrying",
                    schedule=schedule.name,
                    tick=tick.isoformat(),
                    error=repr(exc),
                )
                self._retry_at = now + self._retry
                continue
            else:
                log_event(
                    logger,
                    logging.INFO,
                    "schedule tick enqueued",
                    schedule=schedule.name,
                    tick=tick.isoformat(),
                    job_id=result.job.id,
                    duplicate=result.duplicate,
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
        log_event(
            logger,
            logging.INFO,
            "scheduler started",
            schedules=",".join(f"{s.name}@{self._due[s.name].isoformat()}" for s in self.schedules),
        )
        while True:
            await retrying(
                "scheduler pass", self.run_due, interval=self._retry.total_seconds(), logger=logger
            )
            wake = self.next_tick()
            assert wake is not None
            delay = (wake - self._clock()).total_seconds()
            # asyncio sleeps on the monotonic clock; the cap bounds the error if the wall
            # clock is stepped meanwhile, and run_due re-reads it on every wake.
            await asyncio.sleep(min(max(delay, 0.0), self._max_sleep))


__all__ = ["Scheduler", "catch_up_window"]
