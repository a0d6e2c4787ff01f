"""The two questions the scheduler asks a cron trigger agree with each other, even across
daylight-saving changes: from any instant, the last tick at or before it and the first
tick after it are neighbours. The scheduler relies on it: a disagreement would make it
enqueue a past tick again, or wake in a loop on a tick it can never reach."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.tasks.triggers import CronExpression

EXPRESSIONS = [
    "30 2 * * *",  # a named time: wall-clock rules
    "0 2,3 * * *",
    "15 1-3 * * *",
    "0 * * * *",  # starts with *: elapsed-time rules
    "*/20 * * * *",
    "*/30 1 * * *",
    "0 */6 * * *",
    "* 2 * * *",
]
# The instants at which each zone's clocks change in 2024 (spring forward, fall back).
CHANGES = [
    ("Europe/Paris", datetime(2024, 3, 31, 1, tzinfo=UTC)),
    ("Europe/Paris", datetime(2024, 10, 27, 1, tzinfo=UTC)),
    ("America/New_York", datetime(2024, 3, 10, 7, tzinfo=UTC)),
    ("America/New_York", datetime(2024, 11, 3, 6, tzinfo=UTC)),
    ("Australia/Sydney", datetime(2024, 4, 6, 16, tzinfo=UTC)),
    ("Australia/Sydney", datetime(2024, 10, 5, 16, tzinfo=UTC)),
]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    expression=st.sampled_from(EXPRESSIONS),
    change=st.sampled_from(CHANGES),
    offset=st.integers(min_value=-4 * 3600, max_value=4 * 3600),
)
def test_latest_and_next_are_neighbours_around_a_clock_change(
    expression: str, change: tuple[str, datetime], offset: int
) -> None:
    zone, instant = change
    cron = CronExpression(expression, zone)
    when = instant + timedelta(seconds=offset)
    latest = cron.latest_at_or_before(when)
    following = cron.next_after(when)
    assert latest <= when < following
    assert cron.next_after(latest) == following
    assert cron.latest_at_or_before(following) == following
    assert cron.latest_at_or_before(following - timedelta(microseconds=1)) == latest
