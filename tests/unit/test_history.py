"""The main's minute-by-minute history (:mod:`broker.core.history`): what each event adds,
the ring's reuse of old minutes, the bound on series, and the percentiles."""

from __future__ import annotations

import bisect
import math

from hypothesis import given
from hypothesis import strategies as st

from broker.core.history import OTHER, WAIT_BOUNDS, History, percentile

T0 = 1_800_000_000.0  # a whole minute: 30_000_000 * 60


def test_events_land_in_their_minute_per_queue_and_task() -> None:
    history = History(minutes=10, max_series=5)
    history.completed(T0 + 1, "mail", "send")
    history.completed(T0 + 59, "mail", "send")
    history.failed(T0 + 61, "mail", "send", retried=True)
    history.failed(T0 + 62, "reports", "build", retried=False)
    points = history.points(history.total, T0 + 62, 2)
    assert [(p.completed, p.failed, p.retried) for p in points] == [(2, 0, 0), (0, 1, 1)]
    mail = history.points(history.series(queue="mail"), T0 + 62, 2)
    assert [(p.completed, p.retried, p.failed) for p in mail] == [(2, 0, 0), (0, 1, 0)]
    build = history.points(history.series(task="build"), T0 + 62, 1)
    assert build[0].failed == 1 and build[0].completed == 0
    assert history.series(queue="nowhere") is None
    assert history.points(None, T0, 3)[0].completed == 0


def test_the_ring_forgets_minutes_older_than_it_holds() -> None:
    history = History(minutes=3, max_series=5)
    history.completed(T0, "q", "t")
    history.completed(T0 + 3 * 60, "q", "t")  # the same slot, three minutes on
    points = history.points(history.total, T0 + 3 * 60, 10)
    assert len(points) == 3  # never more than the ring holds
    assert [p.completed for p in points] == [0, 0, 1]
    history.completed(T0, "q", "t")  # late: older than the ring, counted nowhere
    assert [p.completed for p in history.points(history.total, T0 + 180, 3)] == [0, 0, 1]


def test_series_past_the_bound_share_other() -> None:
    history = History(minutes=5, max_series=2)
    for n in range(6):
        history.completed(T0, f"q{n}", f"t{n}")
    assert set(history.queues) == {"q0", "q1", OTHER}
    assert set(history.tasks) == {"t0", "t1", OTHER}
    other = history.points(history.series(queue=OTHER), T0, 1)[0]
    assert other.completed == 4


def test_samples_keep_the_minutes_largest_and_sum_the_overflow() -> None:
    history = History(minutes=5, max_series=1)
    history.sampled(T0, {"a": (5, 2.0), "b": (3, None), "c": (4, 9.0)})
    history.sampled(T0 + 10, {"a": (2, 1.0), "b": (0, None), "c": (0, None)})
    total = history.points(history.total, T0 + 10, 1)[0]
    assert (total.depth, total.oldest) == (12, 9.0)
    a = history.points(history.series(queue="a"), T0, 1)[0]
    assert (a.depth, a.oldest) == (5, 2.0)
    other = history.points(history.series(queue=OTHER), T0, 1)[0]
    assert (other.depth, other.oldest) == (7, 9.0)
    assert history.points(history.total, T0 + 60, 1)[0].depth is None  # not sampled


def test_waits_give_percentiles_within_a_bucket() -> None:
    history = History(minutes=5, max_series=5)
    for wait in [0.01] * 90 + [10.0] * 10:
        history.started(T0, "q", "t", wait)
    point = history.points(history.total, T0, 1)[0]
    assert point.started == 100
    assert point.wait_p50 is not None and 0.01 / 1.5 <= point.wait_p50 <= 0.01 * 1.5
    assert point.wait_p95 is not None and 10.0 / 1.5 <= point.wait_p95 <= 10.0 * 1.5
    assert percentile([0] * (len(WAIT_BOUNDS) + 1), 0.5) is None


@given(
    st.lists(st.floats(min_value=0.0, max_value=WAIT_BOUNDS[-1]), min_size=1, max_size=50),
    st.sampled_from([0.5, 0.95]),
)
def test_a_percentile_lies_in_the_bucket_of_the_true_one(waits: list[float], q: float) -> None:
    history = History(minutes=2, max_series=2)
    for wait in waits:
        history.started(T0, "q", "t", wait)
    point = history.points(history.total, T0, 1)[0]
    estimate = point.wait_p50 if q == 0.5 else point.wait_p95
    assert estimate is not None
    true = sorted(waits)[math.ceil(q * len(waits)) - 1]
    index = bisect.bisect_left(WAIT_BOUNDS, true)
    low = WAIT_BOUNDS[index - 1] if index else 0.0
    assert low - 1e-12 <= estimate <= WAIT_BOUNDS[index] + 1e-12


def test_completed_per_minute_slides_over_the_last_sixty_seconds() -> None:
    history = History(minutes=5, max_series=5)
    for _ in range(60):
        history.completed(T0 + 30, "q", "t")
    for _ in range(10):
        history.completed(T0 + 70, "q", "t")
    rates = history.completed_per_minute(T0 + 90)  # half of the minute before is in view
    assert rates["q"] == 10 + 30


@given(
    st.lists(
        st.tuples(st.integers(0, 10_000), st.text(max_size=3), st.text(max_size=3)),
        max_size=200,
    )
)
def test_the_buckets_never_exceed_the_declared_bound(events: list[tuple[int, str, str]]) -> None:
    history = History(minutes=4, max_series=3)
    for second, queue, task in events:
        history.completed(T0 + second, queue, task)
        history.sampled(T0 + second, {queue: (1, None)})
    series = [history.total, *history.queues.values(), *history.tasks.values()]
    assert len(series) <= 2 * 3 + 3
    assert all(len(s._ring) == 4 for s in series)  # a ring never grows


_EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["started", "completed", "retried", "failed", "sampled"]),
        st.integers(0, 9),  # the minute, within a ring of four: old ones come back late
        st.sampled_from(["a", "b", "c"]),
        st.sampled_from(["x", "y"]),
    ),
    max_size=60,
)


@given(_EVENTS)
def test_the_last_buckets_kept_count_as_a_lookup_each_time_would(
    events: list[tuple[str, int, str, str]],
) -> None:
    """Two events in a row of the same minute, queue and task reuse the buckets the first
    found: whatever the order, the ring's reuse and the bound on series, every series
    counts what it counts when each event looks its buckets up again."""
    kept, fresh = History(minutes=4, max_series=2), History(minutes=4, max_series=2)
    for history, forget in ((kept, False), (fresh, True)):
        for kind, minute, queue, task in events:
            if forget:
                history._last = None
            now = T0 + 60 * minute + 1
            if kind == "started":
                history.started(now, queue, task, 0.5)
            elif kind == "completed":
                history.completed(now, queue, task)
            elif kind == "sampled":
                history.sampled(now, {queue: (minute, 1.0)})
            else:
                history.failed(now, queue, task, retried=kind == "retried")
    now = T0 + 60 * 9 + 1
    for name in [None, "a", "b", "c", OTHER]:
        assert kept.points(kept.series(queue=name), now, 4) == fresh.points(
            fresh.series(queue=name), now, 4
        )
    for name in ["x", "y", OTHER]:
        assert kept.points(kept.series(task=name), now, 4) == fresh.points(
            fresh.series(task=name), now, 4
        )
