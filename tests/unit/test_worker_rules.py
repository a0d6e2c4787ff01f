"""The worker's per-job rules on their own (broker/core/worker_rules.py, broker/core/window.py):
each is a value or a function of its inputs, so these call them directly, without a
``WorkerState`` (whose state machines in test_worker_state.py drive them in context)."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

import pytest

from broker.core.window import PREFETCH_MEASURE, AdaptiveWindow
from broker.core.worker_rules import (
    ProgressThrottle,
    RetryRules,
    checkpoint_refusal,
    fit_report,
    report_for,
    start_failed,
)
from broker.model.bounds import RUNNER_START_FAILURES_FORGIVEN, RUNNER_START_FAILURES_TRACKED
from broker.retry import RetryPolicy
from broker.tasks.runner import Completed, Failed, Released, Rescheduled
from broker.wire import codec
from broker.wire import messages as protocol
from broker.wire.messages import ErrorCode

KEY = (uuid.UUID(int=1), uuid.UUID(int=2))


@dataclass
class Limits:
    max_line_bytes: int = 1 << 20
    max_payload_bytes: int | None = None
    max_payload_depth: int = 100
    max_checkpoint_bytes: int | None = None
    max_payload_containers: int | None = None


# --------------------------------------------------------------------------- fit_report


def test_a_report_that_fits_goes_as_it_is_with_its_encoding() -> None:
    report = protocol.CompletedReport(*KEY, result={"rows": 3})
    fitted, encoded, problem = fit_report(KEY, report, Limits())
    assert (fitted, problem) == (report, None)
    assert encoded == codec.encode_item(report)


def test_a_result_over_the_line_becomes_a_failure_that_is_not_retried() -> None:
    report = protocol.CompletedReport(*KEY, result="x" * 500)
    fitted, encoded, problem = fit_report(KEY, report, Limits(max_line_bytes=200))
    assert isinstance(fitted, protocol.FailedReport) and not fitted.retry
    assert problem is not None and "over the main's limit of 200" in problem
    assert encoded == codec.encode_item(fitted)


def test_a_failure_too_long_is_cut_and_keeps_its_retry_decision() -> None:
    report = protocol.FailedReport(*KEY, error="e" * 5000, retry=True, retry_delay=3.0)
    fitted, _, problem = fit_report(KEY, report, Limits(max_line_bytes=800))
    assert isinstance(fitted, protocol.FailedReport)
    assert (fitted.retry, fitted.retry_delay, len(fitted.error)) == (True, 3.0, 100)
    assert problem is not None


def test_a_result_that_is_not_json_fails_without_being_sent() -> None:
    report = protocol.CompletedReport(*KEY, result={1.5: "a float key"})  # type: ignore[dict-item]
    fitted, _, problem = fit_report(KEY, report, Limits())
    assert isinstance(fitted, protocol.FailedReport)
    assert problem is not None and "cannot be sent as JSON" in problem


def test_a_result_over_the_container_bound_fails() -> None:
    report = protocol.CompletedReport(*KEY, result=[[1], [2], [3]])
    fitted, _, problem = fit_report(KEY, report, Limits(max_payload_containers=2))
    assert isinstance(fitted, protocol.FailedReport) and problem is not None


# --------------------------------------------------------------------------- checkpoint_refusal


def test_a_checkpoint_within_the_limits_may_go() -> None:
    assert checkpoint_refusal({"done": 10}, Limits(max_checkpoint_bytes=100)) is None
    assert checkpoint_refusal("x" * 10_000, None) is None  # no main to say its limits


def test_a_checkpoint_over_the_mains_size_limit_is_refused_at_once() -> None:
    refusal = checkpoint_refusal("x" * 200, Limits(max_checkpoint_bytes=100))
    assert refusal is not None
    code, message = refusal
    assert code == ErrorCode.PAYLOAD_TOO_LARGE and "over the main's checkpoint limit" in message


def test_a_checkpoint_nested_too_deeply_is_refused_at_once() -> None:
    refusal = checkpoint_refusal([[[[1]]]], Limits(max_payload_depth=2))
    assert refusal is not None and refusal[1].endswith("; flatten it")


# --------------------------------------------------------------------------- report_for


@pytest.mark.parametrize(
    ("outcome", "cancelled", "given_up", "kind", "event"),
    [
        (Completed(7), False, False, protocol.CompletedReport, "job completed"),
        (Completed(7), True, True, protocol.CompletedReport, "job completed"),
        (Failed("boom"), True, False, protocol.FailedReport, "job stopped by its cancel"),
        (Released("no slot"), True, False, protocol.ReleaseReport, "job stopped by its cancel"),
        (Failed("boom"), False, True, protocol.ReleaseReport, "job given back"),
        (Failed("died", lost=True), False, False, protocol.FailedReport, "job attempt lost"),
        (Failed("boom"), False, False, protocol.FailedReport, "job failed"),
        (Released("no slot"), False, False, protocol.ReleaseReport, "job released by its runner"),
        (Rescheduled(5.0), False, False, protocol.RescheduleReport, "job rescheduled"),
        (Rescheduled(-1.0), False, False, protocol.FailedReport, "job rescheduled"),
    ],
)
def test_each_outcome_becomes_its_report_and_log_line(
    outcome: Completed | Failed | Released | Rescheduled,
    cancelled: bool,
    given_up: bool,
    kind: type[protocol.Report],
    event: str,
) -> None:
    report, level, logged, _ = report_for(KEY, outcome, cancelled, given_up)
    assert type(report) is kind and (report.job_id, report.handoff_id) == KEY
    assert logged == event
    assert level in (logging.DEBUG, logging.INFO, logging.WARNING)


# --------------------------------------------------------------------------- start_failed


def test_start_failures_are_forgiven_then_count_as_attempts() -> None:
    failures: dict[uuid.UUID, int] = {}
    released = Released("the child did not start")
    for _ in range(RUNNER_START_FAILURES_FORGIVEN):
        assert start_failed(failures, KEY[0], released) is released
    judged = start_failed(failures, KEY[0], released)
    assert isinstance(judged, Failed) and "the child did not start" in judged.error


def test_start_failures_are_tracked_for_a_bounded_number_of_jobs() -> None:
    failures: dict[uuid.UUID, int] = {}
    for n in range(RUNNER_START_FAILURES_TRACKED + 5):
        start_failed(failures, uuid.UUID(int=n), Released("no"))
    assert len(failures) == RUNNER_START_FAILURES_TRACKED
    assert uuid.UUID(int=0) not in failures  # the least recently failed went first


# --------------------------------------------------------------------------- RetryRules


def test_a_policy_that_excludes_the_exception_ends_the_job() -> None:
    rules = RetryRules(RetryPolicy(dont_retry_on=(KeyError,)), None, attempt=1)
    judged = rules.judge(Failed("KeyError: 'x'"))
    assert not judged.retry and "excludes KeyError" in judged.error


def test_the_tasks_backoff_sets_the_wait() -> None:
    rules = RetryRules(None, lambda failures: 2.0 * failures, attempt=3)
    assert rules.judge(Failed("ValueError: no")) == Failed("ValueError: no", retry_delay=6.0)


def test_a_backoff_that_cannot_say_leaves_the_mains() -> None:
    rules = RetryRules(None, lambda failures: -1.0, attempt=1)
    judged = rules.judge(Failed("ValueError: no"))
    assert judged.retry and judged.retry_delay is None and "backoff applies" in judged.error


# --------------------------------------------------------------------------- ProgressThrottle


def test_progress_goes_at_most_once_per_interval_per_job() -> None:
    throttle = ProgressThrottle(1.0)
    throttle.latest[KEY] = (0.1, "first")
    assert throttle.plan(0.0) == (True, None)
    assert [m.message for m in throttle.take_due(0.0)] == ["first"]
    throttle.latest[KEY] = (0.2, "second")
    throttle.latest[KEY] = (0.3, "third")  # the latest replaces what was not sent
    assert throttle.plan(0.25) == (False, 0.75)
    assert throttle.plan(0.5) == (False, None)  # a timer is already set
    assert throttle.take_due(0.5) == []
    throttle.timer = False
    assert [m.message for m in throttle.take_due(1.0)] == ["third"]


def test_a_finished_jobs_progress_is_forgotten() -> None:
    throttle = ProgressThrottle(1.0)
    throttle.latest[KEY] = (0.5, "half")
    throttle.forget(KEY)
    assert throttle.latest == {} and throttle.take_due(10.0) == []


# --------------------------------------------------------------------------- AdaptiveWindow


def test_the_window_grows_with_the_pace_up_to_its_cap_and_never_shrinks() -> None:
    window = AdaptiveWindow(size=2, cap=8)
    assert not window.finished(0.0)  # the first end starts the clock
    for i in range(1, 1001):
        window.finished(i * PREFETCH_MEASURE / 1000)
    assert window.size == 8
    for i in range(1, 20):  # slow jobs afterwards
        assert not window.finished(PREFETCH_MEASURE + i * 10.0)
    assert window.size == 8


def test_slow_jobs_keep_the_window_where_it_started() -> None:
    window = AdaptiveWindow(size=2, cap=8)
    for i in range(50):
        assert not window.finished(i * 1.0)
    assert window.size == 2
