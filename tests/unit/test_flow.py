"""The flow-control rule (:mod:`broker.core.flow`): a rate limit is never exceeded over any
window, and admits every job it may (no starvation); pause holds a queue back; the count of
queues with settings is bounded."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.core.flow import FlowControl
from broker.model.bounds import MAX_QUEUE_SETTINGS
from broker.model.rates import NANOS, Rate, parse_rate
from broker.storage import QueueSettings

rates = st.builds(
    Rate,
    count=st.integers(1, 200),
    per=st.sampled_from(["s", "m"]),
    burst=st.integers(1, 20),
)
# Arrivals: offsets in ns between asks, from far closer than the interval to seconds apart.
gaps = st.lists(st.integers(0, 3 * NANOS), min_size=1, max_size=300)


def _run(rate: Rate, offsets: list[int]) -> tuple[list[int], list[int]]:
    """Ask at each time (ns); returns the admitted times and the refused times."""
    flow = FlowControl()
    flow.apply(QueueSettings("q", rate=rate))
    now, admitted, refused = 0, [], []
    for gap in offsets:
        now += gap
        seconds = now / NANOS
        if flow.admits("q", seconds):
            flow.admitted("q", seconds)
            admitted.append(now)
        else:
            refused.append(now)
    return admitted, refused


@given(rates, gaps)
def test_no_window_admits_more_than_rate_times_length_plus_burst(
    rate: Rate, offsets: list[int]
) -> None:
    admitted, _ = _run(rate, offsets)
    period_ns = {"s": 1, "m": 60}[rate.per] * NANOS
    # The densest windows start at an admission; the exact rule: count <= rate*W + burst.
    for i, start in enumerate(admitted):
        for j in range(i, len(admitted)):
            length = admitted[j] - start  # a closed window [start, admitted[j]]
            count = j - i + 1
            assert count * period_ns <= rate.count * length + rate.burst * period_ns


@given(rates, gaps)
def test_a_job_is_refused_only_when_admitting_it_would_break_the_limit(
    rate: Rate, offsets: list[int]
) -> None:
    """No starvation: for each refused ask there is a window ending at it that one more
    admission would take over ``rate * W + burst`` (up to the limiter's rounding of the
    interval up to a whole nanosecond, at most 1 ns per job)."""
    admitted, refused = _run(rate, offsets)
    period_ns = {"s": 1, "m": 60}[rate.per] * NANOS
    for at in refused:
        before = [t for t in admitted if t <= at]
        assert before, "the first ask is always admitted"
        assert any(
            (k + 1) * period_ns > rate.count * (at - s - (k + 1)) + rate.burst * period_ns
            for k, s in ((len(before) - i, s) for i, s in enumerate(before))
        )


def test_a_quiet_spell_refills_the_burst_and_no_more() -> None:
    flow = FlowControl()
    flow.apply(QueueSettings("q", rate=parse_rate("10/s", burst=3)))
    taken = 0
    while flow.admits("q", 0.0):
        flow.admitted("q", 0.0)
        taken += 1
    assert taken == 3
    assert flow.wake_at(0.0) == 0.1, "the plan held a job back: wake at its token"
    assert flow.leave_out(0.0) == {"q"}
    assert flow.wake_at(0.0) == pytest.approx(0.1)
    assert flow.wake_at(0.5) == 0.5, "due between the read and the sleep: wake at once"
    assert flow.leave_out(0.5) == frozenset() and flow.wake_at(0.5) is None
    assert flow.token_wait("q", 0.05) == pytest.approx(0.05)
    assert flow.blocked(0.1) == frozenset()
    taken = 0
    while flow.admits("q", 100.0):
        flow.admitted("q", 100.0)
        taken += 1
    assert taken == 3


def test_pause_holds_a_queue_back_and_keeps_its_bucket() -> None:
    flow = FlowControl()
    rate = parse_rate("1/s")
    flow.apply(QueueSettings("q", rate=rate))
    flow.admitted("q", 0.0)
    flow.apply(QueueSettings("q", paused=True, rate=rate))
    assert flow.leave_out(5.0) == {"q"}
    assert not flow.admits("q", 5.0)
    assert flow.wake_at(0.5) is None  # a paused queue waits for its resume
    flow.apply(QueueSettings("q", rate=rate))
    assert not flow.admits("q", 0.5)  # resuming granted no token
    assert flow.admits("q", 1.0)
    assert flow.admits("other", 0.0) and not flow.governed("other")


def test_clearing_every_setting_forgets_the_queue() -> None:
    flow = FlowControl()
    flow.apply(QueueSettings("q", paused=True, rate=parse_rate("5/m")))
    flow.apply(QueueSettings("q"))
    assert not flow.governed("q") and flow.buckets == {}


def test_the_queues_with_settings_are_bounded() -> None:
    flow = FlowControl()
    flow.load([QueueSettings(f"q{i}", paused=True) for i in range(MAX_QUEUE_SETTINGS)])
    with pytest.raises(ValueError, match="at most"):
        flow.check(QueueSettings("one-more", paused=True))
    flow.check(QueueSettings("q0", rate=parse_rate("1/s")))  # a queue that has some: fine
    flow.check(QueueSettings("one-more"))  # clearing: fine


@pytest.mark.parametrize("text", ["50", "50/d", "0/s", "-1/s", "1000000/s", "x/s", "50/s/m", ""])
def test_a_bad_rate_is_refused_with_the_form_expected(text: str) -> None:
    with pytest.raises(ValueError, match="rate"):
        parse_rate(text)


def test_a_bad_burst_is_refused() -> None:
    with pytest.raises(ValueError, match="burst"):
        parse_rate("5/s", burst=0)


def test_rates_read_back_as_written() -> None:
    assert str(parse_rate(" 600 / m ")) == "600/m"
    assert parse_rate("3600/h").per_second == 1.0


def test_a_queue_that_spent_its_last_token_wakes_the_dispatcher_at_the_next() -> None:
    """A plan that took every job it read (none refused) still leaves the queue to look
    at again when its next token is due: it may have more jobs queued."""
    flow = FlowControl()
    flow.apply(QueueSettings("q", rate=parse_rate("10/s")))
    assert flow.leave_out(0.0) == frozenset()
    assert flow.admits("q", 0.0)
    flow.admitted("q", 0.0)
    assert flow.wake_at(0.0) == pytest.approx(0.1)


# ---------------------------------------------------------------- per-task limits

asks = st.lists(
    st.tuples(st.integers(0, NANOS // 2), st.sampled_from(["limited", "free"])),
    min_size=1,
    max_size=300,
)


@given(rates, rates, asks)
def test_a_tasks_limit_and_its_queues_both_hold_and_the_task_holds_no_other_back(
    task_rate: Rate, queue_rate: Rate, offsets: list[tuple[int, str]]
) -> None:
    """Jobs of two tasks in one limited queue, one task with a limit of its own: over any
    window neither limit is exceeded, and a job of the other task is refused only when
    its queue has no token (never for the limited task's sake)."""
    flow = FlowControl()
    flow.apply(QueueSettings("q", rate=queue_rate))
    flow.limit_tasks({"limited": task_rate})
    now, admitted, by_task = 0, [], []
    for gap, task in offsets:
        now += gap
        seconds = now / NANOS
        queue_had_token = flow.buckets["q"].admits(now)
        if flow.admits("q", seconds, task):
            flow.admitted("q", seconds, task)
            admitted.append(now)
            if task == "limited":
                by_task.append(now)
        elif task == "free":
            assert not queue_had_token, "the free task was held back by the other's limit"
    for rate, times in ((queue_rate, admitted), (task_rate, by_task)):
        period_ns = {"s": 1, "m": 60}[rate.per] * NANOS
        for i, start in enumerate(times):
            for j in range(i, len(times)):
                assert (j - i + 1) * period_ns <= rate.count * (times[j] - start) + (
                    rate.burst * period_ns
                )


def test_a_limited_task_without_a_token_is_left_out_and_wakes_the_dispatcher() -> None:
    flow = FlowControl()
    flow.limit_tasks({"t": parse_rate("10/s")})
    assert flow.limiting and flow.leave_out_tasks(0.0) == frozenset()
    assert flow.admits("q", 0.0, "t")
    flow.admitted("q", 0.0, "t")
    assert not flow.admits("q", 0.05, "t") and flow.admits("q", 0.05, "other")
    assert flow.leave_out_tasks(0.05) == {"t"}
    assert flow.wake_at(0.05) == pytest.approx(0.1)
    assert flow.leave_out(0.05) == frozenset(), "the queue itself has no settings"


def test_a_tasks_bucket_survives_the_same_limit_declared_again_and_goes_with_it() -> None:
    flow = FlowControl()
    rate = parse_rate("1/s")
    flow.limit_tasks({"t": rate})
    flow.admitted("q", 0.0, "t")
    flow.limit_tasks({"t": parse_rate("1/s")})  # a worker declares it again: no new token
    assert not flow.admits("q", 0.5, "t")
    flow.limit_tasks({"t": parse_rate("2/s")})  # a new rate: a fresh bucket
    assert flow.admits("q", 0.5, "t")
    flow.limit_tasks({})
    assert flow.task_buckets == {} and not flow.limiting and flow.wake_at(0.5) is None
