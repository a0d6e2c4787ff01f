"""The worker's reconnect policy and liveness rule (:mod:`broker.core.reconnect`), with the
clock and the jitter injected: no socket, no sleep."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.core.reconnect import (
    FIRST_RECONNECT_DELAY,
    FOLLOW_DELAY,
    STABLE_CONNECTION,
    Reconnect,
    alive_for,
)
from broker.wire.addresses import MainAddresses


def ceiling(low: float, high: float) -> float:
    """The jitter's top, so a test sees each delay's ceiling."""
    assert low == high / 2, "a delay is drawn between half its ceiling and the ceiling"
    return high


def policy(max_delay: float = 10.0, mains: str = "a:1,b:2,c:3") -> Reconnect:
    return Reconnect(MainAddresses(mains, 7390), max_delay, uniform=ceiling)


def test_failed_attempts_double_the_delay_up_to_the_cap() -> None:
    reconnect = policy(max_delay=1.0)
    delays = [reconnect.unreachable() for _ in range(6)]
    assert delays == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert reconnect.failures == 6


def test_the_jitter_is_drawn_below_the_ceiling() -> None:
    drawn: list[tuple[float, float]] = []

    def low(a: float, b: float) -> float:
        drawn.append((a, b))
        return a

    reconnect = Reconnect(MainAddresses("a", 1), 10.0, uniform=low)
    assert reconnect.unreachable() == FIRST_RECONNECT_DELAY / 2
    assert drawn == [(FIRST_RECONNECT_DELAY / 2, FIRST_RECONNECT_DELAY)]


def test_a_huge_number_of_failures_does_not_overflow() -> None:
    reconnect = policy(max_delay=10.0)
    reconnect.failures = 10_000
    assert reconnect.unreachable() == 10.0


def test_an_unreachable_main_moves_on_to_the_next() -> None:
    reconnect = policy()
    assert reconnect.mains.current == ("a", 1)
    reconnect.unreachable()
    assert reconnect.mains.current == ("b", 2)
    reconnect.unreachable()
    reconnect.unreachable()
    assert reconnect.mains.current == ("a", 1), "round the list"


def test_a_standby_sends_the_worker_to_the_leader_it_names() -> None:
    reconnect = policy()
    assert reconnect.not_leader("c:3") == 0.0, "a redirect: followed at once"
    assert reconnect.mains.current == ("c", 3)
    assert reconnect.not_leader(None) == 0.2, "no leader yet: back off, try the next"
    assert reconnect.mains.current == ("a", 1)


def test_a_main_loading_after_its_election_that_names_itself_is_asked_again_later() -> None:
    reconnect = policy()
    assert reconnect.not_leader("a:1") == FIRST_RECONNECT_DELAY
    assert reconnect.mains.current == ("a", 1)


def test_two_redirects_in_a_row_wait() -> None:
    """Standbys that name each other (a stale view, for an instant) are not asked in a
    busy loop."""
    reconnect = policy()
    assert reconnect.not_leader("b:2") == 0.0
    assert reconnect.not_leader("a:1") > 0.0
    assert reconnect.mains.current == ("a", 1)


def test_during_a_failover_the_backoff_stays_under_the_follow_delay() -> None:
    """Kill the leader ``c``: the standby ``a`` names it while its lease runs, ``c``
    refuses, and so on. Those answers no longer double the delay up to seconds (a worker
    took 5.4 s to follow a leader elected in 2.9 s); they stay at FOLLOW_DELAY at most."""
    reconnect = policy(max_delay=30.0, mains="c:3,a:1")
    reconnect.connected(0.0, "main-1")
    delays = [reconnect.lost(60.0)]
    assert reconnect.mains.current == ("a", 1)
    for _ in range(20):
        delays.append(reconnect.not_leader("c:3"))  # the standby names the dead leader
        assert reconnect.mains.current == ("c", 3)
        delays.append(reconnect.unreachable())  # which refuses
        assert reconnect.mains.current == ("a", 1)
    assert delays[1::2] == [0.0] * 20, "the leader named is tried at once"
    assert max(delays) == FOLLOW_DELAY, "one wait per round, at most the follow delay"


def test_with_every_main_unreachable_the_backoff_still_grows() -> None:
    reconnect = policy(max_delay=30.0)
    assert [reconnect.unreachable() for _ in range(8)][-1] == 12.8


def test_a_connection_ends_the_failover_cap() -> None:
    reconnect = policy(max_delay=30.0)
    reconnect.not_leader(None)
    reconnect.connected(0.0, "main-1")
    for _ in range(6):
        reconnect.connected(1.0, "main-1")
        delay = reconnect.lost(1.0)
    assert delay == 3.2, "a main that drops at once is backed off from as before"


def test_a_failover_soon_after_another_does_not_inherit_its_attempts() -> None:
    """Ten takeovers in a row: the attempts of one failover used to stay counted through
    the short connection to its leader, so the next failover began with the backoff's
    longest wait (workers followed leaders 5 to 7 s after their election)."""
    reconnect = policy(max_delay=30.0, mains="c:3,a:1")
    reconnect.connected(0.0, "main-1")
    reconnect.lost(60.0)
    for _ in range(20):
        reconnect.not_leader("c:3")
        reconnect.unreachable()
    reconnect.not_leader(None)
    reconnect.connected(63.0, "main-2")
    assert reconnect.failures == 0, "the failover's attempts are forgiven"
    assert reconnect.lost(64.0) == FIRST_RECONNECT_DELAY, "a short connection: one failure"


def test_takeovers_back_to_back_start_each_failover_at_the_first_delay() -> None:
    """Ten takeovers, each leader killed half a second after the workers arrived: each
    short connection counted as a failure, restored at the next welcome, so the wait
    before the first attempt of each next failover doubled (a worker followed the new
    leaders 1.9, 2.7, 5.0, 8.1 s after their elections). A new leader's welcome forgives
    the connections its predecessor ended early."""
    reconnect = policy(max_delay=10.0, mains="c:3,a:1")
    now = 0.0
    firsts = []
    for round_ in range(10):
        reconnect.connected(now, f"main-{round_}")
        now += STABLE_CONNECTION / 2
        firsts.append(reconnect.lost(now))  # killed: nobody has answered yet
        reconnect.not_leader("c:3")  # the standby names the dead leader, which refuses
        reconnect.unreachable()
        reconnect.not_leader("a:1")  # then itself, while it loads
    assert firsts == [FIRST_RECONNECT_DELAY] * 10


def test_the_same_main_dropping_at_once_through_a_standby_is_still_backed_off_from() -> None:
    """A leader that welcomes and drops at once, reached each time through a standby that
    names it: its welcome forgives the redirects but not its own dropped connections."""
    reconnect = policy(max_delay=10.0, mains="a:1,c:3")
    delays = []
    for _ in range(6):
        reconnect.not_leader("c:3")  # the standby names the leader
        reconnect.connected(0.0, "main-c")
        delays.append(reconnect.lost(0.1))
    assert delays == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2]


@given(
    st.lists(
        st.tuples(
            st.floats(min_value=0.0, max_value=3 * STABLE_CONNECTION),
            st.lists(
                st.one_of(st.none(), st.sampled_from(["a:1", "b:2", "c:3"]), st.just("down")),
                max_size=8,
            ),
        ),
        max_size=12,
    )
)
def test_each_takeover_is_followed_within_the_follow_bound(
    takeovers: list[tuple[float, list[str | None]]],
) -> None:
    """Whatever each leader's connection lasted and whatever the mains answered in each
    failover, a new leader's welcome leaves the wait before the next failover's first
    attempt at the first delay, and every wait after a standby answered at most the
    follow delay: a worker follows each new leader within about FOLLOW_DELAY of its
    election, however many takeovers came before."""
    reconnect = policy(max_delay=10.0)
    now = 0.0
    for leader, (lasted, answers) in enumerate(takeovers):
        reconnect.connected(now, f"main-{leader}")
        now += lasted
        assert reconnect.lost(now) <= FIRST_RECONNECT_DELAY
        standby_seen = False
        for attempt, answer in enumerate(answers, start=1):
            if answer == "down":
                delay = reconnect.unreachable()
            else:
                delay = reconnect.not_leader(answer)
                standby_seen = True
            # Before any standby answered, the backoff grows from this failover's start.
            bound = FOLLOW_DELAY if standby_seen else FIRST_RECONNECT_DELAY * 2**attempt
            assert delay <= bound
            now += delay


@given(
    st.lists(
        st.one_of(st.none(), st.sampled_from(["a:1", "b:2", "c:3", "d:4"]), st.just("down")),
        max_size=60,
    )
)
def test_after_a_standby_answers_no_delay_exceeds_the_follow_cap_and_none_loops(
    answers: list[str | None],
) -> None:
    """Whatever the mains answer (a leader named, none, or no answer at all), once a
    standby has answered every delay is at most FOLLOW_DELAY, and no two attempts in a
    row go out without a wait."""
    reconnect = policy(max_delay=30.0)
    standby_seen = False
    previous = 1.0
    for answer in answers:
        if answer == "down":
            delay = reconnect.unreachable()
        else:
            delay = reconnect.not_leader(answer)
            standby_seen = True
        if standby_seen:
            assert delay <= FOLLOW_DELAY
        assert delay > 0 or previous > 0, "never two attempts in a row without a wait"
        previous = delay


def test_a_stable_connection_resets_the_backoff() -> None:
    reconnect = policy()
    for _ in range(4):
        reconnect.unreachable()
    reconnect.connected(100.0, "main-1")
    assert reconnect.lost(now=100.0 + STABLE_CONNECTION) == FIRST_RECONNECT_DELAY
    assert reconnect.failures == 0
    assert reconnect.unreachable() == FIRST_RECONNECT_DELAY, "counting starts over"


def test_a_connection_dropped_at_once_keeps_growing_the_backoff() -> None:
    """A main that accepts and drops at once is not hammered ten times a second."""
    reconnect = policy()
    delays = []
    now = 0.0
    for _ in range(4):
        reconnect.connected(now, "main-1")
        now += STABLE_CONNECTION - 0.01
        delays.append(reconnect.lost(now))
    assert delays == [0.1, 0.2, 0.4, 0.8]


def test_a_lost_connection_tries_the_next_main() -> None:
    """The leader may be gone: the next main names the new one."""
    reconnect = policy()
    reconnect.not_leader("c:3")
    reconnect.connected(0.0, "main-1")
    reconnect.lost(60.0)
    assert reconnect.mains.current == ("a", 1), "the leader named is forgotten"
    reconnect.connected(60.0, "main-1")
    reconnect.lost(120.0)
    assert reconnect.mains.current == ("b", 2)


# ------------------------------------------------------------------ liveness


def test_a_connection_lives_until_the_main_has_been_silent_for_the_timeout() -> None:
    assert alive_for(10.0, heard=10.0, sending=None, limit=15.0) == 15.0
    assert alive_for(20.0, heard=10.0, sending=None, limit=15.0) == 5.0
    with pytest.raises(TimeoutError, match=r"nothing from the main for 15\.0 s"):
        alive_for(25.0, heard=10.0, sending=None, limit=15.0)


def test_a_send_stuck_on_the_socket_for_the_timeout_ends_the_connection() -> None:
    # The main keeps talking, but this worker's send has waited since 12.
    assert alive_for(20.0, heard=19.0, sending=12.0, limit=15.0) == 7.0
    with pytest.raises(TimeoutError, match=r"a send to the main waited 15\.0 s on the socket"):
        alive_for(27.0, heard=26.0, sending=12.0, limit=15.0)


def test_the_next_look_is_at_the_nearer_deadline() -> None:
    assert alive_for(20.0, heard=10.0, sending=19.0, limit=15.0) == 5.0
    assert alive_for(20.0, heard=19.0, sending=10.0, limit=15.0) == 5.0
