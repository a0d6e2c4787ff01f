"""Retry policies as pure rules: backoffs stay within their bounds (jitter included),
the main's backoff setting parses or says what it accepts, and a runner's error text
names the exception class a policy judges."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.exceptions import ConfigurationError, JobTimeoutError
from broker.retry import (
    ExponentialBackoff,
    FixedBackoff,
    RetryPolicy,
    parse_backoff,
    reported_exception,
    retry_delay,
)
from broker.tasks.registry import TaskRegistry, task


@given(
    base=st.floats(min_value=0, max_value=1e4),
    factor=st.floats(min_value=1, max_value=10),
    extra=st.floats(min_value=0, max_value=1e6),
    failures=st.integers(min_value=1, max_value=10_000),
    seed=st.integers(),
)
def test_jittered_exponential_backoff_stays_within_half_and_whole_of_its_plan(
    base: float, factor: float, extra: float, failures: int, seed: int
) -> None:
    backoff = ExponentialBackoff(base=base, factor=factor, cap=base + extra)
    try:
        planned = min(backoff.cap, base * factor ** (failures - 1))
    except OverflowError:
        planned = backoff.cap if base > 0 else 0.0
    wait = backoff(failures, random.Random(seed)).total_seconds()
    assert planned / 2 - 1e-6 <= wait <= planned + 1e-6
    assert wait <= backoff.cap + 1e-6
    exact = ExponentialBackoff(base=base, factor=factor, cap=base + extra, jitter=False)
    # timedelta keeps microseconds: the wait is exact to one.
    assert exact(failures).total_seconds() == pytest.approx(planned, rel=1e-9, abs=1e-6)


def test_exponential_backoff_doubles_from_its_base_up_to_its_cap() -> None:
    backoff = ExponentialBackoff(base=10, cap=60, jitter=False)
    assert [backoff(n).total_seconds() for n in range(1, 6)] == [10, 20, 40, 60, 60]
    assert FixedBackoff(7)(99) == timedelta(seconds=7)
    with pytest.raises(ValueError, match="counts from 1"):
        backoff(0)


@pytest.mark.parametrize(
    "bad", [{"base": -1}, {"factor": 0.5}, {"base": 10, "cap": 5}, {"cap": float("inf")}]
)
def test_a_backoff_that_cannot_be_right_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigurationError, match="backoff"):
        ExponentialBackoff(**bad)


def test_the_mains_backoff_setting() -> None:
    assert parse_backoff("schedule") is retry_delay
    assert parse_backoff("exponential") == ExponentialBackoff()
    assert parse_backoff("exponential:2:300") == ExponentialBackoff(base=2, cap=300)
    assert parse_backoff("fixed:30") == FixedBackoff(30)
    for bad in ("", "linear", "fixed", "fixed:x", "exponential:1", "schedule:3"):
        with pytest.raises(ConfigurationError, match="schedule, exponential"):
            parse_backoff(bad)


class Outer:
    class Declined(ValueError):
        pass


def test_the_class_a_runner_reports_is_found_among_imported_modules() -> None:
    assert reported_exception("ValueError: bad\nTraceback (innermost last):\n ...") is ValueError
    assert reported_exception("KeyError") is KeyError
    assert reported_exception("broker.exceptions.JobTimeoutError: slow") is JobTimeoutError
    nested = f"{__name__}.Outer.Declined: no"
    assert reported_exception(nested) is Outer.Declined
    for unknown in ("timed out after 3 s", "cancelled", "nowhere.Missing: x", "print: x", ""):
        assert reported_exception(unknown) is None


def test_a_policy_retries_what_retry_on_names_unless_dont_retry_on_names_it() -> None:
    policy = RetryPolicy(retry_on=(OSError, ValueError), dont_retry_on=(Outer.Declined,))
    assert policy.retries(ConnectionError) and policy.retries(ValueError)
    assert not policy.retries(Outer.Declined), "a subclass of an excluded class is excluded"
    assert not policy.retries(KeyError), "outside retry_on"
    assert RetryPolicy().retries(RuntimeError) and not RetryPolicy().retries(KeyboardInterrupt)
    with pytest.raises(ConfigurationError, match="tuple of exception classes"):
        RetryPolicy(dont_retry_on=ValueError)  # type: ignore[arg-type]


def test_task_declares_its_policy() -> None:
    registry = TaskRegistry()

    @task(name="t", registry=registry, dont_retry_on=(Outer.Declined,))
    def t() -> None:
        pass

    @task(name="plain", registry=registry)
    def plain() -> None:
        pass

    assert t.retry == RetryPolicy(dont_retry_on=(Outer.Declined,))
    assert plain.retry is None
