"""The worker's prefetch window (broker/core/worker_state.py), driven by calling ``WorkerState``
directly against the main's real credit accounting (broker/core/peers.py): no socket, no
loop. A worker with a window never idles a slot while a job waits for one, never holds
more than the window, starts the jobs of a mode highest priority first and in arrival
order within a priority, and never loses a job."""

from __future__ import annotations

import logging
import uuid
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from broker.core.peers import Credits
from broker.core.window import (
    LINE_WINDOW,
    REPORT_HOLD,
    SHORT_RUN,
    WIDE_LINE_WINDOW,
    AdaptiveWindow,
    line_cap,
    line_window,
    ready_worth,
    report_waits,
)
from broker.core.worker_effects import ReportsLater, StartRun, WakeSender, WorkerEffect
from broker.core.worker_state import WorkerState
from broker.exceptions import ConfigurationError, ProtocolError
from broker.jobs import ExecutionMode
from broker.ops import cli
from broker.tasks.runner import Completed, LeaseKey
from broker.wire import messages as protocol
from broker.worker.worker import Worker
from runners.inline import InlineRunner
from tests.unit.conftest import PROFILE

INLINE = ExecutionMode.INLINE
POOLED = ExecutionMode.POOLED
CAPACITY = {INLINE: 2, POOLED: 1}
PREFETCH = 2
PRIORITIES = st.sampled_from([0, 0, 0, 1, 5, -3])
"""Mostly the default priority, as a backlog is, with urgent and background jobs."""


def make_state(prefetch: int = PREFETCH) -> WorkerState:
    return WorkerState(
        modes=list(CAPACITY),
        queues=None,
        lookup_task=lambda name: name,
        logger=logging.getLogger("test"),
        prefetch=prefetch,
    )


def inline_state(window: AdaptiveWindow) -> WorkerState:
    """A worker of inline jobs only, its window ``window``."""
    return WorkerState(
        modes=[INLINE],
        queues=None,
        lookup_task=lambda name: name,
        logger=logging.getLogger("test"),
        prefetch={INLINE: window},
    )


def welcome() -> protocol.Welcome:
    return protocol.Welcome(
        main_id="main",
        protocol=protocol.PROTOCOL_VERSION,
        ping_interval=5.0,
        adopted=[],
        max_line_bytes=1 << 20,
        max_payload_bytes=None,
        max_payload_depth=32,
    )


def job(seq: int, mode: ExecutionMode = INLINE, priority: int = 0) -> protocol.JobHandoff:
    return protocol.JobHandoff(
        seq=seq,
        job_id=uuid.uuid4(),
        handoff_id=uuid.uuid4(),
        task="add",
        args=[],
        kwargs={},
        execution_mode=mode,
        attempt=1,
        max_attempts=3,
        timeout=None,
        queue="default",
        priority=priority,
    )


def started(effects: list[WorkerEffect]) -> list[LeaseKey]:
    return [
        (e.assignment.job_id, e.assignment.handoff_id) for e in effects if isinstance(e, StartRun)
    ]


def releases(messages: list[protocol.Message]) -> list[protocol.ReleaseReport]:
    return [m for m in messages if isinstance(m, protocol.ReleaseReport)]


# --------------------------------------------------------------------------- examples


def test_ready_advertises_the_free_slots_plus_the_window() -> None:
    state = make_state()
    state.connected(welcome())
    ready = state.take_ready({INLINE: 2, POOLED: 1})
    assert ready is not None and ready.slots == {INLINE: 4, POOLED: 3}


def test_a_job_beyond_the_slots_waits_and_takes_the_first_slot_that_frees() -> None:
    state = make_state()
    state.connected(welcome())
    first, second, third = job(1), job(2), job(3)
    assert started(state.job_received(first, {INLINE: 1, POOLED: 1})) == [
        (first.job_id, first.handoff_id)
    ]
    state.run_entered((first.job_id, first.handoff_id))
    assert started(state.job_received(second, {INLINE: 0, POOLED: 1})) == []
    assert started(state.job_received(third, {INLINE: 0, POOLED: 1})) == []
    assert list(state.queued) == [(j.job_id, j.handoff_id) for j in (second, third)]
    assert releases(state.outgoing()) == [], "both fit the window: nothing released"
    ready = state.take_ready({INLINE: 0, POOLED: 1})
    assert ready is not None and ready.slots[INLINE] == 0, "the window is full"
    effects = state.run_finished((first.job_id, first.handoff_id), Completed(), {INLINE: 1})
    assert started(effects) == [(second.job_id, second.handoff_id)], "oldest first, at once"
    assert not state.idle


def test_an_urgent_job_takes_the_next_slot_ahead_of_the_backlog_held() -> None:
    """Issue 35: the window holds the backlog's jobs when an urgent one arrives; the
    slot that frees next goes to it, and the backlog resumes in its own order."""
    state = make_state(prefetch=4)
    state.connected(welcome())
    running, *backlog = [job(seq) for seq in range(1, 5)]
    state.jobs_received([running, *backlog], {INLINE: 1, POOLED: 1})
    urgent = job(5, priority=10)
    assert started(state.job_received(urgent, {INLINE: 0, POOLED: 1})) == []
    keys = [(j.job_id, j.handoff_id) for j in (running, *backlog, urgent)]
    state.run_entered(keys[0])
    assert started(state.run_finished(keys[0], Completed(), {INLINE: 1})) == [keys[4]]
    state.run_entered(keys[4])
    assert started(state.run_finished(keys[4], Completed(), {INLINE: 2})) == keys[1:3]


def test_a_line_starts_its_highest_priorities_first_then_in_arrival_order() -> None:
    state = make_state(prefetch=4)
    state.connected(welcome())
    line = [job(1, priority=-1), job(2), job(3, priority=7), job(4), job(5, priority=7)]
    keys = [(j.job_id, j.handoff_id) for j in line]
    assert started(state.jobs_received(line, {INLINE: 2, POOLED: 1})) == [keys[2], keys[4]]
    state.run_entered(keys[2])
    state.run_entered(keys[4])  # the runner's free slots below count them from now
    assert started(state.capacity_changed({INLINE: 3, POOLED: 1})) == [keys[1], keys[3], keys[0]]


def test_without_a_window_a_job_beyond_the_slots_is_released_as_before() -> None:
    state = make_state(prefetch=0)
    state.connected(welcome())
    msg = job(1)
    assert started(state.job_received(msg, {INLINE: 0, POOLED: 1})) == []
    [release] = releases(state.outgoing())
    assert (release.job_id, release.reason) == (msg.job_id, "no free inline slot")


def test_a_lost_connection_drops_the_prefetched_jobs_and_hello_does_not_list_them() -> None:
    state = make_state()
    state.connected(welcome())
    waiting = job(1)
    state.job_received(waiting, {INLINE: 0, POOLED: 0})
    assert (waiting.job_id, waiting.handoff_id) in state.held_leases()
    state.disconnected()
    assert state.queued == {} and state.held_leases() == [] and state.idle
    assert state.outbox == {}, "nothing to report: the main returned the lease itself"


def test_a_drained_worker_runs_its_prefetched_jobs_and_a_fast_stop_gives_them_back() -> None:
    state = make_state()
    state.connected(welcome())
    a, b = job(1), job(2)
    state.job_received(a, {INLINE: 0, POOLED: 0})
    state.job_received(b, {INLINE: 0, POOLED: 0})
    state.drain_requested()
    assert not state.idle, "the drain waits for the prefetched jobs"
    assert started(state.capacity_changed({INLINE: 1, POOLED: 0})) == [(a.job_id, a.handoff_id)]
    state.drain_requested(fast=True)
    [release] = releases(state.outgoing())
    assert (release.job_id, release.reason) == (
        b.job_id,
        "the worker stopped before the job started",
    )
    assert list(state.queued) == []


def test_a_cancelled_prefetched_job_is_given_back_without_running() -> None:
    state = make_state()
    state.connected(welcome())
    msg = job(1)
    state.job_received(msg, {INLINE: 0, POOLED: 0})
    assert started(state.cancel_received(protocol.CancelJob(msg.job_id, msg.handoff_id))) == []
    [release] = releases(state.outgoing())
    assert release.job_id == msg.job_id and state.queued == {}


def test_a_line_of_jobs_starts_what_has_room_and_keeps_the_rest_in_order() -> None:
    state = make_state()
    state.connected(welcome())
    batch = [job(1), job(2), job(3), job(4, POOLED)]
    keys = [(j.job_id, j.handoff_id) for j in batch]
    effects = state.jobs_received(batch, {INLINE: 1, POOLED: 1})
    assert started(effects) == [keys[0], keys[3]], "one count of the slots, in arrival order"
    assert list(state.queued) == keys[1:3], "the rest wait in the window, in order"
    assert releases(state.outgoing()) == []
    ready = state.take_ready({INLINE: 0, POOLED: 0})
    assert ready is not None and ready.seen == 4, "seen covers the whole line"


def test_a_line_whose_seq_does_not_advance_takes_none_of_its_jobs() -> None:
    state = make_state()
    state.connected(welcome())
    with pytest.raises(ProtocolError):
        state.jobs_received([job(1), job(3), job(3)], {INLINE: 2, POOLED: 1})
    assert state.queued == {} and state.running == {} and state.idle
    assert started(state.jobs_received([job(1)], {INLINE: 2, POOLED: 1})) != [], "seen is kept"


# --------------------------------------------------------------------------- property


class PrefetchRules(RuleBasedStateMachine):
    """Random interleavings of handoffs (within the credit the main's real accounting
    allows), run starts and ends, readies, drains and reconnects, against a fake runner
    with ``CAPACITY`` slots per mode."""

    def __init__(self) -> None:
        super().__init__()
        self.state = self.make()
        self.credits = Credits()
        self.seq = 0
        self.connections = 0
        self.connected = False
        self.starting: dict[LeaseKey, ExecutionMode] = {}
        self.entered: dict[LeaseKey, ExecutionMode] = {}
        self.order: dict[ExecutionMode, list[LeaseKey]] = {mode: [] for mode in CAPACITY}
        """Jobs taken in, per mode, in the order the worker received them."""
        self.rank: dict[LeaseKey, tuple[int, int]] = {}
        """Each job's place in the order it should start in: ``(-priority, arrival)``."""
        self.starts: dict[ExecutionMode, list[LeaseKey]] = {mode: [] for mode in CAPACITY}
        self.dropped: set[LeaseKey] = set()
        self.finished: set[LeaseKey] = set()
        self.woken = False
        """The sender was woken (a ``WakeSender``) and has not run since."""
        self.timer = False
        """A ``ReportsLater`` timer is set and has not fired."""

    def make(self) -> WorkerState:
        return make_state()

    def window(self, mode: ExecutionMode) -> int:
        return PREFETCH

    def now(self, data: st.DataObject) -> float | None:
        return None

    def free(self) -> dict[ExecutionMode, int]:
        busy = Counter(self.entered.values())
        return {mode: CAPACITY[mode] - busy[mode] for mode in CAPACITY}

    def apply(self, effects: list[WorkerEffect]) -> None:
        batch: dict[ExecutionMode, list[LeaseKey]] = {mode: [] for mode in CAPACITY}
        for effect in effects:
            if isinstance(effect, WakeSender):
                self.woken = True
            if isinstance(effect, ReportsLater):
                assert not self.timer, "one reports timer at a time"
                assert effect.delay == REPORT_HOLD
                self.timer = True
            if isinstance(effect, StartRun):
                key = (effect.assignment.job_id, effect.assignment.handoff_id)
                mode = effect.assignment.execution_mode
                self.starting[key] = mode
                self.starts[mode].append(key)
                batch[mode].append(key)
        # The priority rule (issue 35): when slots free, the jobs that take them are the
        # best the window holds, highest priority first and in arrival order within one;
        # no job left waiting in the window stands before any of them.
        for mode, keys in batch.items():
            ranks = [self.rank[key] for key in keys]
            assert ranks == sorted(ranks), "a step's starts go in priority, then arrival order"
            waiting = [
                self.rank[k] for k, a in self.state.queued.items() if a.execution_mode is mode
            ]
            assert not ranks or not waiting or max(ranks) < min(waiting), (
                "a job started while a better one of its mode waited in the window"
            )

    def hand_over(self, mode: ExecutionMode, priority: int) -> protocol.JobHandoff:
        """A job for the worker within the main's credit: its seq, rank and order noted."""
        self.seq = self.credits.commit(mode)
        msg = job(self.seq, mode, priority)
        key = (msg.job_id, msg.handoff_id)
        self.order[mode].append(key)
        self.rank[key] = (-priority, self.seq + 1_000_000 * self.connections)
        return msg

    def send(self) -> None:
        self.woken = False
        messages = self.state.outgoing()
        assert releases(messages) == [] or self.state.draining, "credit was honoured"
        ready = self.state.take_ready(self.free())
        if ready is not None:
            self.credits.on_ready(ready.slots, ready.seen)
        if self.state.draining:
            return
        # A small window's ready waits only while the window holds a job or the main knows
        # of two credits or more (it sends the next jobs: a slot never idles for want of a
        # ready); an empty window's credit, and a wide one's, the main knows.
        free = self.free()
        for mode in CAPACITY:
            held = sum(1 for a in self.state.queued.values() if a.execution_mode is mode)
            room = free[mode] - sum(1 for m in self.starting.values() if m is mode)
            credit = max(0, room + self.window(mode) - held)
            known = self.credits.available(mode, leading=True)
            small = self.window(mode) <= WIDE_LINE_WINDOW
            assert known >= credit or (small and (held > 0 or known >= 2)), (
                mode,
                known,
                credit,
                held,
            )

    @precondition(lambda self: not self.connected)
    @rule()
    def connect(self) -> None:
        self.apply(self.state.connected(welcome()))
        self.credits = Credits()
        self.seq = 0
        self.connections += 1
        self.connected = True
        self.send()

    @precondition(lambda self: self.connected)
    @rule()
    def disconnect(self) -> None:
        self.dropped |= set(self.state.queued)
        self.apply(self.state.disconnected())
        self.connected = False

    @precondition(lambda self: self.connected)
    @rule(mode=st.sampled_from(list(CAPACITY)), priority=PRIORITIES)
    def main_hands_a_job_over(self, mode: ExecutionMode, priority: int) -> None:
        if not self.credits.reserve(mode):
            return
        msg = self.hand_over(mode, priority)
        key = (msg.job_id, msg.handoff_id)
        self.apply(self.state.job_received(msg, self.free()))
        if not self.state.draining:
            assert key in self.state.queued or key in self.state.running, "taken, not released"

    @precondition(lambda self: self.connected)
    @rule(
        jobs=st.lists(
            st.tuples(st.sampled_from(list(CAPACITY)), PRIORITIES), min_size=1, max_size=5
        )
    )
    def main_hands_a_line_of_jobs_over(self, jobs: list[tuple[ExecutionMode, int]]) -> None:
        batch = []
        for mode, priority in jobs:
            if self.credits.reserve(mode):
                batch.append(self.hand_over(mode, priority))
        if not batch:
            return
        self.apply(self.state.jobs_received(batch, self.free()))
        if not self.state.draining:
            for msg in batch:
                key = (msg.job_id, msg.handoff_id)
                assert key in self.state.queued or key in self.state.running, "taken"

    @precondition(lambda self: self.starting)
    @rule(data=st.data())
    def run_enters(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(list(self.starting)))
        self.entered[key] = self.starting.pop(key)
        self.apply(self.state.run_entered(key, self.now(data)))

    @precondition(lambda self: self.entered)
    @rule(data=st.data())
    def run_finishes(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(list(self.entered)))
        del self.entered[key]
        self.finished.add(key)
        self.apply(self.state.run_finished(key, Completed(), self.free(), self.now(data)))

    @precondition(lambda self: self.connected)
    @rule()
    def sender_runs(self) -> None:
        self.send()

    @precondition(lambda self: self.timer)
    @rule()
    def reports_timer_fires(self) -> None:
        self.timer = False
        self.apply(self.state.reports_due())

    @rule()
    def drain(self) -> None:
        self.apply(self.state.drain_requested())

    @invariant()
    def no_report_waits_without_a_send_or_a_timer_coming(self) -> None:
        """A report not yet sent goes at the sender's next run, which is asked for, or
        when the reports timer fires: none is stranded in the outbox."""
        link = self.state._link
        if self.connected and link is not None and link.unsent:
            assert self.woken or self.timer, "reports wait with nothing to send them"

    @invariant()
    def runs_never_exceed_the_slots(self) -> None:
        running = Counter(job.execution_mode for job in self.state.running.values())
        assert all(running[mode] <= CAPACITY[mode] for mode in CAPACITY)

    @invariant()
    def the_window_is_never_overfilled(self) -> None:
        held = Counter(a.execution_mode for a in self.state.queued.values())
        assert all(held[mode] <= self.window(mode) for mode in CAPACITY)

    @invariant()
    def no_slot_idles_while_a_job_of_its_mode_waits(self) -> None:
        free = self.free()
        for mode in CAPACITY:
            waiting = [a for a in self.state.queued.values() if a.execution_mode is mode]
            room = free[mode] - sum(1 for m in self.starting.values() if m is mode)
            assert not waiting or room <= 0, (mode, room, len(waiting))

    def released(self) -> set[LeaseKey]:
        """Jobs given back unstarted (draining, or a fast stop): their report waits."""
        outbox = self.state.outbox.items()
        return {k for k, r in outbox if isinstance(r, protocol.ReleaseReport)}

    @invariant()
    def jobs_of_one_priority_start_in_arrival_order(self) -> None:
        gone = self.dropped | self.released()
        for mode in CAPACITY:
            for priority in {-rank[0] for rank in self.rank.values()}:
                kept = [
                    k for k in self.order[mode] if k not in gone and -self.rank[k][0] == priority
                ]
                began = [k for k in self.starts[mode] if -self.rank[k][0] == priority]
                assert began == kept[: len(began)]

    @invariant()
    def every_job_is_in_exactly_one_place(self) -> None:
        queued, running, released = set(self.state.queued), set(self.state.running), self.released()
        assert not queued & running and not (queued | running) & (released | self.dropped)
        every = {k for keys in self.order.values() for k in keys}
        assert every == queued | running | self.finished | self.dropped | released

    def teardown(self) -> None:
        # Eventually: the runs end and every prefetched job gets a slot and runs.
        for _ in range(100):
            if not (self.starting or self.entered or self.state.queued):
                break
            for key in sorted(self.starting):
                self.entered[key] = self.starting.pop(key)
                self.apply(self.state.run_entered(key))
            for key in sorted(self.entered):
                del self.entered[key]
                self.finished.add(key)
                self.apply(self.state.run_finished(key, Completed(), self.free()))
        assert self.state.idle and not self.state.queued


PrefetchRules.TestCase.settings = settings.get_profile(PROFILE)
test_prefetch_rules = PrefetchRules.TestCase


class AdaptivePrefetchRules(PrefetchRules):
    """The same, with adaptive windows whose completions come at random paces: a window
    that grows never makes the worker refuse a job the main sent against its credit
    (``send`` checks no release goes out), nor overfills."""

    def make(self) -> WorkerState:
        self.clock = 0.0
        self.windows = {mode: AdaptiveWindow(size=1, cap=4) for mode in CAPACITY}
        return WorkerState(
            modes=list(CAPACITY),
            queues=None,
            lookup_task=lambda name: name,
            logger=logging.getLogger("test"),
            prefetch=dict(self.windows),
        )

    def window(self, mode: ExecutionMode) -> int:
        return self.windows[mode].size

    def now(self, data: st.DataObject) -> float | None:
        self.clock += data.draw(st.sampled_from([0.0, 0.001, 0.05, 0.2]))
        return self.clock


AdaptivePrefetchRules.TestCase.settings = settings.get_profile(PROFILE)
test_adaptive_prefetch_rules = AdaptivePrefetchRules.TestCase


def test_an_adaptive_window_grows_with_fast_completions_up_to_its_cap() -> None:
    """Completions every millisecond need 20 ms x 1,000/s = 20 jobs in the window; the
    cap holds it at 12. Measured over PREFETCH_MEASURE at least, from the first one."""
    window = AdaptiveWindow(size=2, cap=12)
    assert not window.finished(0.0)
    grown = [window.finished(i * 0.001) for i in range(1, 100)]
    assert not any(grown) and window.size == 2  # under PREFETCH_MEASURE: not measured yet
    assert window.finished(0.1) and window.size == 12


def test_an_adaptive_window_never_grows_for_slow_jobs_nor_shrinks() -> None:
    """Jobs of 50 ms on one slot: 20 per second need 20 ms x 20/s = 0.4 of a job, less
    than the window has; and a window grown by a burst of short jobs stays grown."""
    window = AdaptiveWindow(size=2, cap=10)
    for i in range(20):
        assert not window.finished(i * 0.05)
    assert window.size == 2
    for i in range(300):
        window.finished(1.0 + i * 0.0005)
    assert window.size == 10
    for i in range(20):
        assert not window.finished(2.0 + i * 0.5)
    assert window.size == 10


def test_a_short_run_grows_a_window_to_a_line_of_jobs_and_a_long_one_does_not() -> None:
    """A run under SHORT_RUN takes a one-slot window from 2 to LINE_WINDOW (16) jobs at
    once, one under half of it to WIDE_LINE_WINDOW (32), within its cap (a default
    window's is at least that); a 50 ms run leaves it to the pace rule; a wide window
    is larger already, and a window never shrinks."""
    window = AdaptiveWindow(size=2, cap=line_cap(8))
    assert not window.finished(0.0, ran=0.05) and window.size == 2
    assert not window.finished(0.1, ran=SHORT_RUN) and window.size == 2
    assert window.finished(0.15, ran=0.003) and window.size == LINE_WINDOW
    assert window.finished(0.16, ran=0.001) and window.size == WIDE_LINE_WINDOW
    assert not window.finished(0.17, ran=0.003) and window.size == WIDE_LINE_WINDOW
    assert [line_window(ran) for ran in (0.0, 0.0024, 0.0025, 0.0049, SHORT_RUN)] == [
        WIDE_LINE_WINDOW,
        WIDE_LINE_WINDOW,
        LINE_WINDOW,
        LINE_WINDOW,
        0,
    ]
    capped = AdaptiveWindow(size=2, cap=4)  # a cap set otherwise holds
    assert capped.finished(0.0, ran=0.0) and capped.size == 4
    wide = AdaptiveWindow(size=128, cap=512)
    assert not wide.finished(0.0, ran=0.0) and wide.size == 128
    assert line_cap(8) == WIDE_LINE_WINDOW and line_cap(512) == 512


def test_a_ready_waits_until_half_a_small_window_has_run_or_it_is_empty() -> None:
    assert ready_worth(window=0, held=0, freed=1, unspent=0)  # no window: every run's end
    assert ready_worth(window=2, held=1, freed=1, unspent=2)  # one slot, two: every end
    assert not ready_worth(window=LINE_WINDOW, held=5, freed=LINE_WINDOW // 2 - 1, unspent=0)
    assert ready_worth(window=LINE_WINDOW, held=3, freed=LINE_WINDOW // 2, unspent=4)
    assert not ready_worth(window=LINE_WINDOW, held=2, freed=1, unspent=0)  # a refill comes
    assert ready_worth(window=LINE_WINDOW, held=0, freed=1, unspent=1)  # the slot would idle
    assert not ready_worth(window=LINE_WINDOW, held=0, freed=1, unspent=2)  # the main sends
    assert not ready_worth(window=WIDE_LINE_WINDOW, held=20, freed=15, unspent=0)
    assert ready_worth(window=WIDE_LINE_WINDOW, held=16, freed=16, unspent=0)
    assert ready_worth(window=40, held=39, freed=1, unspent=40)  # a wide worker's: every end


def test_a_one_slot_worker_of_short_jobs_takes_half_its_window_per_line() -> None:
    """After its first short run (1 ms) the window holds WIDE_LINE_WINDOW jobs; the main
    keeps one credit spare, so WIDE_LINE_WINDOW - 1 wait behind the one running. Their ends send no
    ``ready`` until half the window has run, then one for half plus one (half for the
    backlog, one spare): a ``ready`` and a ``jobs`` line per half window. While a
    refill is on its way the next ends send none; nor does the window's emptying while
    the main knows of credit enough to send the next jobs."""
    line, half = WIDE_LINE_WINDOW, WIDE_LINE_WINDOW // 2
    window = AdaptiveWindow(size=2, cap=line_cap(8))
    state = WorkerState(
        modes=[INLINE],
        queues=None,
        lookup_task=lambda name: name,
        logger=logging.getLogger("test"),
        prefetch={INLINE: window},
    )
    state.connected(welcome())
    credits = Credits()
    credits.keep_spare([INLINE])

    def advertised(free: int) -> int | None:
        state.outgoing()
        ready = state.take_ready({INLINE: free})
        if ready is None:
            return None
        credits.on_ready(ready.slots, ready.seen)
        return ready.slots[INLINE]

    def hand_over(n: int) -> list[protocol.JobHandoff]:
        batch = []
        for _ in range(n):
            assert credits.reserve(INLINE)
            batch.append(job(credits.commit(INLINE)))
        assert not credits.reserve(INLINE)  # the spare stays
        return batch

    now = 0.0

    def run_one() -> None:
        """The running job ends after 1 ms; the next one, if any, takes its slot."""
        nonlocal now
        (key,) = state.running
        now += 0.001
        for started_key in started(state.run_finished(key, Completed(), {INLINE: 1}, now)):
            state.run_entered(started_key, now)

    assert advertised(free=1) == 3
    for key in started(state.jobs_received(hand_over(2), {INLINE: 1})):
        state.run_entered(key, now)
    run_one()
    assert window.size == line
    assert advertised(free=0) == line  # the whole window, none held (one running)
    for key in started(state.jobs_received(hand_over(line - 1), {INLINE: 0})):
        state.run_entered(key, now)
    assert len(state.queued) == line - 1
    readies = []
    for _ in range(line):
        run_one()
        readies.append(advertised(free=0))
        if readies[-1] is not None:
            state.jobs_received(hand_over(half), {INLINE: 0})
    each_half = [None] * (half - 1) + [half + 1]
    assert readies == each_half * 2
    assert state.running and len(state.queued) == line - 1  # full again, less the spare
    readies = []
    for _ in range(line):  # no refill comes
        run_one()
        readies.append(advertised(free=0))
    # The window empty makes no ready: the main knows of half plus one credits, half for
    # the backlog, and sends the next jobs against them. The last run's end does: half
    # the window has run since the last.
    assert readies == each_half + [None] * (half - 1) + [line]


def test_short_runs_reports_wait_for_the_ready_and_go_with_it_at_most_report_hold() -> None:
    """A one-slot worker of short jobs: the reports of the runs that make no ``ready``
    due wait (no sender wake, a timer of REPORT_HOLD instead) and go with the ``ready``,
    in one send; a long run's report goes at once, taking the waiting ones with it; the
    timer sends whatever still waits; the last run's report, with no run left to end,
    goes at once."""
    half = LINE_WINDOW // 2
    state = WorkerState(
        modes=[INLINE],
        queues=None,
        lookup_task=lambda name: name,
        logger=logging.getLogger("test"),
        prefetch={INLINE: AdaptiveWindow(size=LINE_WINDOW, cap=LINE_WINDOW)},
    )
    state.connected(welcome())
    assert state.take_ready({INLINE: 1}) is not None
    msgs = [job(seq) for seq in range(1, half + 5)]
    assert len(started(state.jobs_received(msgs, {INLINE: 1}))) == 1
    now = 0.0

    def run(ran: float) -> list[WorkerEffect]:
        nonlocal now
        (key,) = state.running
        state.run_entered(key, now)
        now += ran
        effects = state.run_finished(key, Completed(), {INLINE: 1}, now)
        assert len(started(effects)) == (1 if state.queued or state.running else 0)
        return effects

    effects = run(0.001)
    assert effects[-1] == ReportsLater(REPORT_HOLD) and WakeSender() not in effects
    for _ in range(half - 2):
        assert WakeSender() not in run(0.001)
    effects = run(0.001)  # half the window has run: a ready is due
    assert WakeSender() in effects and not any(isinstance(e, ReportsLater) for e in effects)
    reports = [m for m in state.outgoing() if isinstance(m, protocol.CompletedReport)]
    assert len(reports) == half and state.take_ready({INLINE: 0}) is not None
    assert WakeSender() not in run(0.001)  # waits: the first timer is still set
    assert state.reports_due() == [WakeSender()]  # REPORT_HOLD after the first wait
    assert len(state.outgoing()) == 1 and state.take_ready({INLINE: 0}) is None
    assert run(0.001)[-1] == ReportsLater(REPORT_HOLD)
    assert WakeSender() in run(SHORT_RUN)  # a long run's report goes at once, and the other
    assert len(state.outgoing()) == 2
    assert state.reports_due() == []  # the timer finds nothing waiting
    assert run(0.001) == [WakeSender()]  # the last: nothing held or running, no timer
    assert len(state.outgoing()) == 1 and state.idle


def test_a_report_waits_only_after_a_short_run_and_while_no_ready_is_due() -> None:
    assert report_waits(ready_due=False, ran=0.001, more=True)
    assert not report_waits(ready_due=True, ran=0.001, more=True)  # it goes with the ready
    assert not report_waits(ready_due=False, ran=SHORT_RUN, more=True)  # a long run: at once
    assert not report_waits(ready_due=False, ran=None, more=True)  # not known: at once
    assert not report_waits(ready_due=False, ran=0.001, more=False)  # no run left to end


def test_a_grown_window_is_advertised_in_the_next_ready() -> None:
    window = AdaptiveWindow(size=1, cap=6)
    state = inline_state(window)
    state.connected(welcome())
    ready = state.take_ready({INLINE: 2})
    assert ready is not None and ready.slots == {INLINE: 3}
    now = 0.0
    for seq in range(1, 60):
        msg = job(seq)
        key = (msg.job_id, msg.handoff_id)
        assert started(state.job_received(msg, {INLINE: 1})) == [key]
        state.run_entered(key)
        now += 0.002
        state.run_finished(key, Completed(), {INLINE: 2}, now)
    assert window.size == 6
    ready = state.take_ready({INLINE: 2})
    assert ready is not None and ready.slots == {INLINE: 8}


# --------------------------------------------------------------------------- settings


def test_a_window_grown_without_a_ready_asks_for_one_once_the_main_is_down_to_its_spare() -> None:
    """A run's end grew the window but was worth no ``ready`` (the main knew of two
    credits, its next job was coming); that job spent the main's credit down to the
    spare it keeps for an urgent job, so with the window empty the worker must ask for
    more, not idle its free slot until the running job ends (the adaptive property test,
    slow profile, found it)."""
    window = AdaptiveWindow(size=1, cap=4)
    state = inline_state(window)
    credits = Credits()
    state.connected(welcome())
    ready = state.take_ready({INLINE: 2})
    assert ready is not None
    credits.on_ready(ready.slots, ready.seen)
    assert credits.available(INLINE, leading=True) == 3
    first = job(credits.commit(INLINE) if credits.reserve(INLINE) else 0)
    key = (first.job_id, first.handoff_id)
    assert started(state.jobs_received([first], {INLINE: 2})) == [key]
    state.run_entered(key, 0.0)
    state.run_finished(key, Completed(), {INLINE: 2}, 0.0)
    assert window.size == 4
    assert state.take_ready({INLINE: 2}) is None, "the main knows of two credits"
    assert credits.reserve(INLINE)
    second = job(credits.commit(INLINE))
    assert started(state.jobs_received([second], {INLINE: 2})) == [
        (second.job_id, second.handoff_id)
    ]
    assert credits.available(INLINE, leading=True) == 1
    ready = state.take_ready({INLINE: 2})  # the second job starting, not yet entered
    assert ready is not None and ready.slots == {INLINE: 5}


def test_the_window_is_a_worker_setting_with_a_checked_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parser = cli.worker_parser()
    assert parser.parse_args(["--app", "m"]).prefetch is None  # two per slot of each mode
    assert parser.parse_args(["--app", "m", "--prefetch", "0"]).prefetch == 0
    monkeypatch.setenv("BROKER_PREFETCH", "5")
    assert cli.worker_parser().parse_args(["--app", "m"]).prefetch == 5
    with pytest.raises(SystemExit):
        parser.parse_args(["--app", "m", "--prefetch", "-1"])
    with pytest.raises(ConfigurationError):
        Worker("127.0.0.1", 1, worker_id="w", runners={INLINE: InlineRunner()}, prefetch=-1)
