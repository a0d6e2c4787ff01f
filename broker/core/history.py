"""The main's recent history, minute by minute, for the dashboard's charts.

Pure and bounded: a ring of :data:`~broker.model.bounds.HISTORY_MINUTES` one-minute
buckets per series, for all jobs, per queue and per task, with at most
:data:`~broker.model.bounds.HISTORY_SERIES` queues and as many tasks kept by name (the
rest share :data:`OTHER`). Each bucket holds the runs that completed, failed for good
and failed to be retried, a histogram of the waits from due to start (for p50 and p95),
and the sampled queue depth and oldest eligible age. Recording an event is a dict lookup
and an addition or two (the main calls it where it already counts its metrics); nothing
walks the history but a chart's read of one series. Times are seconds since the epoch,
given by the caller: the history reads no clock.

The memory is bounded by construction: ``(2 * HISTORY_SERIES + 3) * HISTORY_MINUTES``
buckets at most, each a few small ints and one list of :data:`WAIT_BOUNDS` counts.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass

from broker.model.bounds import HISTORY_MINUTES, HISTORY_SERIES

OTHER = "_other"
"""The series of the queues (or tasks) past the first :data:`HISTORY_SERIES` seen, as
the metrics name theirs."""

WAIT_BOUNDS: tuple[float, ...] = tuple(0.001 * 1.5**k for k in range(38))
"""Upper bounds of the wait histogram's buckets, in seconds: each 1.5 times the one
before, from 1 ms to about 55 minutes (a wait past the last is counted in one more, and
read as the last bound). A percentile read from them lies in the bucket of the true
one, interpolated inside it."""


class Minute:
    """One minute of one series."""

    __slots__ = ("completed", "depth", "failed", "minute", "oldest", "retried", "waits")

    def __init__(self, minute: int) -> None:
        self.minute = minute
        self.completed = 0
        self.failed = 0
        """Runs that failed with no retry left (the job is dead)."""
        self.retried = 0
        """Runs that failed (or were lost) and go back to the queue to run again."""
        self.waits: list[int] | None = None
        """Starts by wait (index: the first bound of :data:`WAIT_BOUNDS` not below it)."""
        self.depth: int | None = None
        """The most jobs queued in a sample of this minute (``None``: not sampled)."""
        self.oldest: float | None = None
        """The longest a due job had waited in a sample of this minute, in seconds."""


class Series:
    """A ring of one-minute buckets: the bucket of a minute is reused once it is
    :data:`HISTORY_MINUTES` old."""

    __slots__ = ("_ring",)

    def __init__(self, minutes: int) -> None:
        self._ring: list[Minute | None] = [None] * minutes

    def at(self, minute: int) -> Minute:
        """The bucket of ``minute``, fresh if its slot held an older minute."""
        ring = self._ring
        slot = minute % len(ring)
        bucket = ring[slot]
        if bucket is None or bucket.minute != minute:
            if bucket is not None and bucket.minute > minute:
                return Minute(minute)  # older than the ring: counted nowhere
            bucket = ring[slot] = Minute(minute)
        return bucket

    def get(self, minute: int) -> Minute | None:
        bucket = self._ring[minute % len(self._ring)]
        return bucket if bucket is not None and bucket.minute == minute else None


@dataclass(frozen=True, slots=True)
class Point:
    """One minute of a series as a chart shows it (``None``: nothing to show)."""

    minute: int
    """Minutes since the epoch."""
    completed: int
    failed: int
    retried: int
    started: int
    wait_p50: float | None
    wait_p95: float | None
    depth: int | None
    oldest: float | None


def percentile(waits: list[int], q: float) -> float | None:
    """The ``q`` quantile (0 to 1) of the waits counted in ``waits``, interpolated
    geometrically inside its bucket; ``None`` when none is counted."""
    total = sum(waits)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for index, count in enumerate(waits):
        if count and seen + count >= rank:
            if index == len(WAIT_BOUNDS):
                return WAIT_BOUNDS[-1]  # past the last bound: at least that
            high = WAIT_BOUNDS[index]
            low = WAIT_BOUNDS[index - 1] if index > 0 else 0.0
            frac = (rank - seen) / count
            if low <= 0.0:
                return high * frac
            return low * math.pow(high / low, frac)
        seen += count
    return WAIT_BOUNDS[-1]  # pragma: no cover - the loop always reaches the rank


class History:
    """Every series of one main: all jobs, by queue and by task."""

    def __init__(self, minutes: int = HISTORY_MINUTES, max_series: int = HISTORY_SERIES) -> None:
        self.minutes = minutes
        self._max = max_series
        self.total = Series(minutes)
        self.queues: dict[str, Series] = {}
        self.tasks: dict[str, Series] = {}
        self._last: tuple[int, str, str] | None = None
        self._last_buckets: tuple[Minute, Minute, Minute] = (Minute(0), Minute(0), Minute(0))

    def _series(self, kind: dict[str, Series], name: str) -> Series:
        series = kind.get(name)
        if series is None:
            if len(kind) >= self._max:  # the others share one series (counted past the bound)
                name = OTHER
                series = kind.get(name)
            if series is None:
                series = kind[name] = Series(self.minutes)
        return series

    def _buckets(self, now: float, queue: str, task: str) -> tuple[Minute, Minute, Minute]:
        """The buckets of ``now``'s minute in the total's, ``queue``'s and ``task``'s
        series; those of the last call again when it was for the same minute, queue and
        task (a drain's every start and completion, two per job: the three lookups were
        a fortieth of the main's CPU). A bucket found so stays the right one: a series
        gives a minute's bucket up only to a minute an hour later, and then the one
        given up counts nowhere, as :meth:`Series.at` counts a minute older than the
        ring."""
        minute = int(now // 60)
        key = (minute, queue, task)
        if key == self._last:
            return self._last_buckets
        buckets = (
            self.total.at(minute),
            self._series(self.queues, queue).at(minute),
            self._series(self.tasks, task).at(minute),
        )
        self._last, self._last_buckets = key, buckets
        return buckets

    def started(self, now: float, queue: str, task: str, wait: float) -> None:
        """A job of ``queue`` and ``task`` was handed to a worker ``wait`` seconds after
        it was due."""
        index = bisect.bisect_left(WAIT_BOUNDS, wait)
        for bucket in self._buckets(now, queue, task):
            waits = bucket.waits
            if waits is None:
                waits = bucket.waits = [0] * (len(WAIT_BOUNDS) + 1)
            waits[index] += 1

    def completed(self, now: float, queue: str, task: str) -> None:
        for bucket in self._buckets(now, queue, task):
            bucket.completed += 1

    def failed(self, now: float, queue: str, task: str, *, retried: bool) -> None:
        """A run failed (or its attempt was lost): to run again (``retried``), or dead."""
        for bucket in self._buckets(now, queue, task):
            if retried:
                bucket.retried += 1
            else:
                bucket.failed += 1

    def sampled(self, now: float, queues: Mapping[str, tuple[int, float | None]]) -> None:
        """The store's levels at ``now``: by queue, the jobs queued and how long the
        oldest due one has waited (``None``: none is due). A minute keeps the largest of
        its samples; queues past the bound are summed into :data:`OTHER`."""
        minute = int(now // 60)
        levels: dict[Minute, tuple[int, float | None]] = {}
        total_depth = 0
        total_oldest: float | None = None
        for queue, (depth, oldest) in queues.items():
            bucket = self._series(self.queues, queue).at(minute)
            was_depth, was_oldest = levels.get(bucket, (0, None))
            levels[bucket] = (was_depth + depth, _longest(was_oldest, oldest))
            total_depth += depth
            total_oldest = _longest(total_oldest, oldest)
        levels[self.total.at(minute)] = (total_depth, total_oldest)
        for bucket, (depth, oldest) in levels.items():
            bucket.depth = depth if bucket.depth is None else max(bucket.depth, depth)
            bucket.oldest = _longest(bucket.oldest, oldest)

    def series(self, *, queue: str | None = None, task: str | None = None) -> Series | None:
        """The series of ``queue``, or of ``task``, or of all jobs (neither)."""
        if queue is not None:
            return self.queues.get(queue)
        if task is not None:
            return self.tasks.get(task)
        return self.total

    def points(self, series: Series | None, now: float, minutes: int) -> list[Point]:
        """The last ``minutes`` minutes up to ``now``'s (at most the ring's), oldest
        first, each as a chart shows it."""
        last = int(now // 60)
        span = max(1, min(minutes, self.minutes))
        out = []
        for minute in range(last - span + 1, last + 1):
            bucket = series.get(minute) if series is not None else None
            if bucket is None:
                out.append(Point(minute, 0, 0, 0, 0, None, None, None, None))
                continue
            waits = bucket.waits or []
            out.append(
                Point(
                    minute,
                    bucket.completed,
                    bucket.failed,
                    bucket.retried,
                    sum(waits),
                    percentile(waits, 0.5),
                    percentile(waits, 0.95),
                    bucket.depth,
                    bucket.oldest,
                )
            )
        return out

    def completed_per_minute(self, now: float) -> dict[str, float]:
        """Completed runs in the last 60 seconds by queue: the current minute's and the
        share of the minute before that the window still covers."""
        minute = int(now // 60)
        share = 1.0 - (now / 60.0 - minute)
        rates: dict[str, float] = {}
        for name, series in self.queues.items():
            current = series.get(minute)
            before = series.get(minute - 1)
            rate = (current.completed if current else 0) + share * (
                before.completed if before else 0
            )
            rates[name] = rate
        return rates


def _longest(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


__all__ = ["OTHER", "WAIT_BOUNDS", "History", "Minute", "Point", "Series", "percentile"]
