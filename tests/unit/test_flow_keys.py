"""Per-key rate limits in the core (:class:`broker.core.flow.KeyBuckets`): no key's window
exceeds ``rate * W + burst``; one key's backlog never delays another key's tokens; the
live buckets are bounded, full ones are dropped first, and at the bound a new key waits
(never exceeding a limit)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.core.flow import FlowControl, KeyBuckets
from broker.model.rates import NANOS, Rate, parse_rate

rates = st.builds(
    Rate, count=st.integers(1, 200), per=st.sampled_from(["s", "m"]), burst=st.integers(1, 20)
)
# (gap in ns, key): tenant "a" asks far more often than the others.
asks = st.lists(
    st.tuples(st.integers(0, 2 * NANOS), st.sampled_from(["a", "a", "a", "a", "b", "c"])),
    min_size=1,
    max_size=300,
)


def _keyed(rate: Rate, bound: int = 10_000) -> FlowControl:
    flow = FlowControl(keys=KeyBuckets(bound=bound))
    flow.limit_tasks({"mail": rate}, keyed=["mail"])
    return flow


def _never_over(rate: Rate, times: list[int]) -> None:
    period_ns = {"s": 1, "m": 60}[rate.per] * NANOS
    for i, start in enumerate(times):
        for j in range(i, len(times)):
            assert (j - i + 1) * period_ns <= rate.count * (times[j] - start) + (
                rate.burst * period_ns
            ), "a window over rate * W + burst"


@given(rates, asks, st.integers(1, 3))
def test_no_keys_window_exceeds_its_rate_and_no_key_delays_another(
    rate: Rate, offsets: list[tuple[int, str]], bound: int
) -> None:
    """Per key, no window admits more than ``rate * W + burst``, whatever the bound on
    live buckets; with room for every key, a key is refused only when its own bucket
    is out of tokens, however hard another key floods (a solo run of that key alone,
    asking at the same times, is refused at exactly the same asks)."""
    flow = _keyed(rate, bound)
    now, by_key = 0, {}  # type: ignore[var-annotated]
    refused: dict[str, list[int]] = {}
    for gap, key in offsets:
        now += gap
        seconds = now / NANOS
        if flow.admits("q", seconds, "mail", key):
            flow.admitted("q", seconds, "mail", key)
            by_key.setdefault(key, []).append(now)
        else:
            refused.setdefault(key, []).append(now)
        assert len(flow.keys.buckets) <= bound
    for times in by_key.values():
        _never_over(rate, times)
    if bound >= 3:  # room for every key: each behaves as if it were alone
        for key in {k for _, k in offsets}:
            alone = _keyed(rate)
            at, alone_refused = 0, []
            for gap, k in offsets:
                at += gap
                if k != key:
                    continue
                if alone.admits("q", at / NANOS, "mail", k):
                    alone.admitted("q", at / NANOS, "mail", k)
                else:
                    alone_refused.append(at)
            assert refused.get(key, []) == alone_refused, f"key {key} was delayed by another"


def test_a_key_without_a_token_is_left_out_and_wakes_the_dispatcher() -> None:
    flow = _keyed(parse_rate("10/s"))
    assert flow.limiting and flow.limits("mail") and flow.leave_out_keys(0.0) == frozenset()
    assert flow.admits("q", 0.0, "mail", "acme")
    flow.admitted("q", 0.0, "mail", "acme")
    assert not flow.admits("q", 0.05, "mail", "acme")
    assert flow.admits("q", 0.05, "mail", "globex"), "another tenant has its own bucket"
    assert flow.leave_out_tasks(0.05) == frozenset(), "the task itself is not held back"
    assert flow.leave_out_keys(0.05) == {("mail", "acme")}
    assert flow.wake_at(0.05) == pytest.approx(0.1)
    assert flow.task_wait("mail", "acme", 0.05) == pytest.approx(0.05)
    assert flow.task_wait("mail", "globex", 0.05) == 0.0
    assert flow.leave_out_keys(0.1) == frozenset()


def test_a_job_without_a_key_spends_the_tasks_empty_key() -> None:
    flow = _keyed(parse_rate("1/s"))
    flow.admitted("q", 0.0, "mail", None)
    assert not flow.admits("q", 0.5, "mail", "")
    assert flow.leave_out_keys(0.5) == {("mail", "")}


def test_at_the_bound_full_buckets_go_first_and_a_new_key_waits_for_one() -> None:
    """Two live buckets at most: a third key waits until one has filled up again (its
    bucket is then exactly a fresh one, dropped losslessly), and the wake comes then."""
    flow = _keyed(parse_rate("1/s"), bound=2)
    for key in ("a", "b"):
        assert flow.admits("q", 0.0, "mail", key)
        flow.admitted("q", 0.0, "mail", key)
    flow.leave_out_keys(0.5)
    assert not flow.admits("q", 0.5, "mail", "c"), "no room, and no bucket is full"
    assert flow.wake_at(0.5) == pytest.approx(1.0), "room comes when the first bucket fills"
    assert flow.task_wait("mail", "c", 0.5) == pytest.approx(0.5)
    assert flow.admits("q", 1.0, "mail", "c"), "a full bucket was dropped for it"
    flow.admitted("q", 1.0, "mail", "c")
    assert len(flow.keys.buckets) <= 2 and ("mail", "c") in flow.keys.buckets


def test_a_changed_or_removed_limit_drops_the_tasks_keys() -> None:
    flow = _keyed(parse_rate("1/s"))
    flow.admitted("q", 0.0, "mail", "a")
    flow.limit_tasks({"mail": parse_rate("1/s")}, keyed=["mail"])  # the same: kept
    assert not flow.admits("q", 0.5, "mail", "a")
    flow.limit_tasks({"mail": parse_rate("1/s")})  # no longer per key: the task's bucket
    assert flow.keys.buckets == {} and "mail" in flow.task_buckets
    flow.limit_tasks({})
    assert not flow.limiting and flow.wake_at(0.5) is None
