"""Retry backoff: a pure function of the attempt number, so every component agrees on it.

The schedule is deliberately coarse (10 s, 1 min, 10 min, 1 h, then one more hour per
further attempt): a failure that survives a minute is usually waiting on a human or on
another system, and hammering it helps nobody.
"""

from __future__ import annotations

import math
import random
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from broker.exceptions import ConfigurationError
from broker.jobs import DEFAULT_MAX_RECOVERIES, Job, Outcome, Settlement
from broker.model.values import check_delay

_FIRST_DELAYS = (
    timedelta(seconds=10),
    timedelta(minutes=1),
    timedelta(minutes=10),
    timedelta(hours=1),
)

RetryDelay = Callable[[int], timedelta]
"""Maps the number of failures so far (1 for the first) to the wait before the next run."""

TaskBackoff = Callable[[int], "timedelta | float"]
"""A task's own backoff (``@task(backoff=...)``): the number of failures so far (1 for the
first) to the wait before the next run, as a ``timedelta`` or seconds.
:class:`ExponentialBackoff` and :class:`FixedBackoff` are two; any function is another.
It runs in the worker, which sends the wait with the failure (``failed.retry_delay``)."""


def backoff_seconds(backoff: TaskBackoff, failures: int) -> float:
    """The wait ``backoff`` asks for after ``failures`` failures, in seconds, checked as
    any delay is (finite, from 0 to ten years).

    :raises ValueError: the backoff raised, or returned something that is not such a
        wait; the message says which, for the job's error.
    """
    try:
        value = backoff(failures)
    except Exception as exc:
        raise ValueError(f"the task's backoff raised {type(exc).__name__}: {exc}") from None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise ValueError(
            f"the task's backoff must return a timedelta or seconds, got {value!r}"[:200]
        )
    check_delay(f"the task's backoff after {failures} failures", seconds)
    return seconds


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


def lost_attempt(
    job: Job,
    handoff_id: uuid.UUID,
    reason: str,
    now: datetime,
    default_max_recoveries: int = DEFAULT_MAX_RECOVERIES,
) -> Settlement:
    """The settlement of an attempt that was lost rather than failed: its worker, child or
    connection died, or the main took its lease back. It counts a recovery, not a
    failure, so the task's retries are untouched, and the job runs again at once (no
    backoff: nothing says the job itself is at fault) until its recoveries are spent; then
    it is dead, with a reason that says so.

    ``job`` is the job as it was handed off under ``handoff_id``: the settlement is fenced
    on that lease, and nothing but a move out of it changes ``recoveries``, so the count
    read here is the one the store holds when the settlement applies. A ``local_state``
    job names the worker that ran the lost attempt as the holder of its state.
    """
    cap = default_max_recoveries if job.max_recoveries is None else job.max_recoveries
    lost = job.recoveries + 1
    if lost > cap:
        error = (
            f"recovery limit reached: {lost} attempts ended by a lost worker, child or "
            f"connection (max_recoveries={cap}); the last: {reason}"
        )
        return Settlement(job.id, handoff_id, Outcome.LOST, error=error, run_at=None)
    holder = job.worker_id if job.local_state else None
    error = f"attempt lost ({lost} of {cap} recoveries used): {reason}"
    return Settlement(
        job.id, handoff_id, Outcome.LOST, error=error, run_at=now, state_holder=holder
    )


@dataclass(frozen=True, slots=True)
class ExponentialBackoff:
    """``base * factor ** (failures - 1)`` seconds, at most ``cap``; with ``jitter`` a
    uniform draw from the upper half of that (``[d / 2, d]``), so jobs that failed
    together (an outage) do not all come back in the same second, and none comes back
    sooner than half the planned wait."""

    base: float = 10.0
    factor: float = 2.0
    cap: float = 3600.0
    jitter: bool = True

    def __post_init__(self) -> None:
        if not (math.isfinite(self.base) and self.base >= 0):
            raise ConfigurationError(f"backoff base must be >= 0 seconds (got {self.base!r})")
        if not (math.isfinite(self.factor) and self.factor >= 1):
            raise ConfigurationError(f"backoff factor must be >= 1 (got {self.factor!r})")
        if not (math.isfinite(self.cap) and self.cap >= self.base):
            raise ConfigurationError(f"backoff cap must be >= base (got {self.cap!r})")

    def _planned(self, exponent: int) -> float:
        """``min(cap, base * factor ** exponent)``, without computing a power past the cap
        (``10.0 ** 400`` overflows a float)."""
        if self.base == 0:
            return 0.0
        # Compared as logarithms: cap / base itself overflows for a tiny base.
        headroom = math.log(self.cap) - math.log(self.base)
        if self.factor > 1 and exponent * math.log(self.factor) > headroom:
            return self.cap
        try:
            return min(self.cap, self.base * self.factor**exponent)
        except OverflowError:  # at the edge of the check's rounding
            return self.cap

    def __call__(self, failures: int, rng: random.Random | None = None) -> timedelta:
        _check_failures(failures)
        planned = self._planned(failures - 1)
        if self.jitter:
            planned = (rng or _random).uniform(planned / 2, planned)
        return timedelta(seconds=planned)


@dataclass(frozen=True, slots=True)
class FixedBackoff:
    """The same wait after every failure."""

    seconds: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.seconds) and self.seconds >= 0):
            raise ConfigurationError(f"backoff must be >= 0 seconds (got {self.seconds!r})")

    def __call__(self, failures: int, rng: random.Random | None = None) -> timedelta:
        _check_failures(failures)
        return timedelta(seconds=self.seconds)


_random = random.Random()


def _check_failures(failures: int) -> None:
    if failures < 1:
        raise ValueError(f"failures counts from 1 (got {failures})")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Which failures of a task are worth another run: ``@task(retry=RetryPolicy(...))``.

    A failure is retried when its exception is an instance of ``retry_on`` and of none of
    ``dont_retry_on`` (and attempts remain: ``@task(retries=N)``). Arguments that do not
    fit the function and unknown tasks are never retried, whatever the policy says: the
    same job would fail the same way on every run.
    """

    retry_on: tuple[type[BaseException], ...] = (Exception,)
    dont_retry_on: tuple[type[BaseException], ...] = ()

    def __post_init__(self) -> None:
        for name in ("retry_on", "dont_retry_on"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(
                isinstance(t, type) and issubclass(t, BaseException) for t in value
            ):
                raise ConfigurationError(
                    f"{name} must be a tuple of exception classes (got {value!r})"
                )

    def retries(self, error: type[BaseException]) -> bool:
        """Whether a run that raised an ``error`` may run again."""
        return issubclass(error, self.retry_on) and not issubclass(error, self.dont_retry_on)


def reported_exception(error: str) -> type[BaseException] | None:
    """The exception class a runner's error text names, found among the modules this
    process has already imported (never importing one: the text comes from a job's
    run); ``None`` when it names none.

    Runners report ``module.Qualname: message`` (``Qualname`` alone for builtins), the
    first line of :func:`traceback.format_exception_only`; the worker imported the same
    task modules as its runners, so the class is found there.
    """
    head = error.split("\n", 1)[0].split(":", 1)[0].strip()
    if not head or " " in head:
        return None
    module_name, _, qualname = head.rpartition(".")
    candidates = [(module_name or "builtins", qualname)]
    # A nested class: module "pkg.mod", qualname "Outer.Inner".
    parts = head.split(".")
    candidates += [(".".join(parts[:i]), ".".join(parts[i:])) for i in range(1, len(parts) - 1)]
    for module, name in candidates:
        found: object = sys.modules.get(module)
        for attribute in name.split("."):
            found = getattr(found, attribute, None)
        if isinstance(found, type) and issubclass(found, BaseException):
            return found
    return None


def parse_backoff(text: str) -> RetryDelay:
    """The main's backoff from its ``--retry-backoff`` text: ``schedule`` (the default:
    10 s, 1 min, 10 min, 1 h, then hourly), ``exponential`` or
    ``exponential:BASE:CAP`` (seconds; factor 2, jittered), or ``fixed:SECONDS``."""
    kind, _, rest = text.strip().partition(":")
    try:
        numbers = [float(part) for part in rest.split(":")] if rest else []
    except ValueError:
        numbers = None
    match kind, numbers:
        case "schedule", []:
            return retry_delay
        case "exponential", []:
            return ExponentialBackoff()
        case "exponential", [base, cap]:
            return ExponentialBackoff(base=base, cap=cap)
        case "fixed", [seconds]:
            return FixedBackoff(seconds)
    raise ConfigurationError(
        f"retry backoff must be schedule, exponential, exponential:BASE:CAP or "
        f"fixed:SECONDS (got {text!r})"
    )
