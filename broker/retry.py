"""Retry backoff: a pure function of the attempt number, so every component agrees on it.

The schedule is deliberately coarse (10 s, 1 min, 10 min, 1 h, then one more hour per
further attempt): a failure that survives a minute is usually waiting on a human or on
another system, and hammering it helps nobody.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

from broker.jobs import Job

_FIRST_DELAYS = (
    timedelta(seconds=10),
    timedelta(minutes=1),
    timedelta(minutes=10),
    timedelta(hours=1),
)

RetryDelay = Callable[[int], timedelta]
"""Maps the number of failures so far (1 for the first) to the wait before the next run."""


def retry_delay(failures: int) -> timedelta:
    """The wait after the ``failures``-th failed run (1-based)."""
    if failures < 1:
        raise ValueError(f"failures counts from 1 (got {failures})")
    if failures <= len(_FIRST_DELAYS):
        return _FIRST_DELAYS[failures - 1]
    return timedelta(hours=failures - len(_FIRST_DELAYS) + 1)


def next_run_after_failure(
    job: Job, now: datetime, delay: RetryDelay = retry_delay
) -> datetime | None:
    """When a job that just failed should run again, or ``None`` when it is dead.

    ``job.attempts`` counts the failures recorded before this one.
    """
    failures = job.attempts + 1
    if failures >= job.max_attempts:
        return None
    return now + delay(failures)
