"""The worker's rules, driven by calling ``WorkerState`` directly: no socket, no loop."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from broker.core.worker_effects import (
    Drain,
    StartRun,
    StopFast,
    StopRun,
    WakeSender,
    WorkerEffect,
)
from broker.core.worker_state import WorkerState
from broker.exceptions import ProtocolError, TaskNotFoundError
from broker.jobs import ExecutionMode
from broker.model.bounds import RUNNER_START_FAILURES_FORGIVEN, RUNNER_START_FAILURES_TRACKED
from broker.tasks.runner import Completed, Failed, LeaseKey, Released, Rescheduled, RunOutcome
from broker.wire import messages as protocol
from tests.unit.conftest import PROFILE

INLINE = ExecutionMode.INLINE
POOLED = ExecutionMode.POOLED
LIMIT = 1_000_000


def lookup(name: str) -> object:
    if name.startswith("missing"):
        raise TaskNotFoundError(f"task {name!r} is not registered")
    return name


def make_state(queues: list[str] | None = None) -> WorkerState:
    return WorkerState(
        modes=[INLINE], queues=queues, lookup_task=lookup, logger=logging.getLogger("test")
    )


def welcome(
    adopted: Sequence[LeaseKey] = (),
    *,
    max_line_bytes: int = LIMIT,
    max_payload_bytes: int | None = None,
    max_payload_depth: int = 32,
) -> protocol.Welcome:
    return protocol.Welcome(
        main_id="main",
        protocol=protocol.PROTOCOL_VERSION,
        ping_interval=5.0,
        adopted=[protocol.LeaseRef(*key) for key in adopted],
        max_line_bytes=max_line_bytes,
        max_payload_bytes=max_payload_bytes,
        max_payload_depth=max_payload_depth,
    )


def job(
    seq: int, name: str = "add", mode: ExecutionMode = INLINE, queue: str = "default"
) -> protocol.JobHandoff:
    return protocol.JobHandoff(
        seq=seq,
        job_id=uuid.uuid4(),
        handoff_id=uuid.uuid4(),
        task=name,
        args=[1, 2],
        kwargs={},
        execution_mode=mode,
        attempt=1,
        max_attempts=3,
        timeout=None,
        queue=queue,
    )


def key_of(
    msg: protocol.JobHandoff
    | protocol.CompletedReport
    | protocol.FailedReport
    | protocol.ReleaseReport,
) -> LeaseKey:
    return (msg.job_id, msg.handoff_id)


def ack(
    key: LeaseKey, status: protocol.AckStatus = protocol.AckStatus.APPLIED
) -> protocol.ReportAck:
    return protocol.ReportAck(job_id=key[0], handoff_id=key[1], status=status)


def started(effects: list[WorkerEffect]) -> list[LeaseKey]:
    return [
        (e.assignment.job_id, e.assignment.handoff_id) for e in effects if isinstance(e, StartRun)
    ]


def start(state: WorkerState, msg: protocol.JobHandoff, free: int = 2) -> LeaseKey:
    """Receive ``msg`` and enter its run, as the worker's task would."""
    (key,) = started(state.job_received(msg, {INLINE: free}))
    state.run_entered(key)
    return key


FREE: Mapping[ExecutionMode, int] = {INLINE: 2}


# --------------------------------------------------------------------------- seq and seen


def test_seen_follows_every_job_decided_on() -> None:
    state = make_state()
    state.connected(welcome())
    assert state.outgoing() == []
    assert state.take_ready(FREE) == protocol.Ready(slots={INLINE: 2}, seen=0)
    assert state.take_ready(FREE) is None, "one ready per change, not one per call"

    first = job(1)
    effects = state.job_received(first, FREE)
    assert started(effects) == [key_of(first)]
    # The runner has not taken the slot yet: the state subtracts it itself.
    assert state.job_received(job(2, mode=POOLED), FREE) == [WakeSender()]
    assert state.take_ready(FREE) == protocol.Ready(slots={INLINE: 1}, seen=2)
    state.run_entered(key_of(first))
    assert state.capacity_changed() == [WakeSender()]
    assert state.take_ready({INLINE: 1}) == protocol.Ready(slots={INLINE: 1}, seen=2)


def test_a_seq_that_does_not_advance_is_a_protocol_error() -> None:
    state = make_state()
    state.connected(welcome())
    state.job_received(job(3), FREE)
    with pytest.raises(ProtocolError, match="seq 3 is not after the last one seen"):
        state.job_received(job(3), FREE)


def test_seq_starts_again_on_each_connection() -> None:
    state = make_state()
    state.connected(welcome())
    state.job_received(job(5, mode=POOLED), FREE)
    state.disconnected()
    state.connected(welcome())
    state.outgoing()
    assert state.take_ready(FREE) == protocol.Ready(slots={INLINE: 2}, seen=0)
    state.job_received(job(1, mode=POOLED), FREE)


# --------------------------------------------------------------------------- per-job decisions


@pytest.mark.parametrize(
    ("msg", "reason"),
    [
        (job(1, mode=POOLED), "does not run pooled jobs"),
        (job(1, queue="mail"), "does not serve queue 'mail'"),
    ],
)
def test_a_job_this_worker_cannot_run_is_released(msg: protocol.JobHandoff, reason: str) -> None:
    state = make_state(queues=["default"])
    state.connected(welcome())
    assert state.job_received(msg, FREE) == [WakeSender()]
    (release,) = state.outgoing()
    assert isinstance(release, protocol.ReleaseReport) and reason in release.reason
    assert state.take_ready(FREE) == protocol.Ready(slots={INLINE: 2}, seen=1)


def test_an_unknown_task_fails_without_retry_and_takes_no_slot() -> None:
    state = make_state()
    state.connected(welcome())
    assert state.job_received(job(1, "missing.task"), FREE) == [WakeSender()]
    (failed,) = state.outgoing()
    assert isinstance(failed, protocol.FailedReport)
    assert failed.retry is False and "'missing.task' is not registered" in failed.error
    assert state.idle


def test_a_job_over_the_free_slots_is_released() -> None:
    state = make_state()
    state.connected(welcome())
    start(state, job(1), free=1)
    effects = state.job_received(job(2), {INLINE: 0})
    assert started(effects) == []
    (release,) = state.outgoing()
    assert isinstance(release, protocol.ReleaseReport) and "no free inline slot" in release.reason


def test_a_repeated_lease_is_neither_run_nor_released() -> None:
    state = make_state()
    state.connected(welcome())
    first = job(1)
    key = start(state, first)
    assert started(state.job_received(msgspec.structs.replace(first, seq=2), FREE)) == []
    assert state.outgoing() == []
    assert list(state.running) == [key]

    state.run_finished(key, Completed(5))
    state.outgoing()
    assert started(state.job_received(msgspec.structs.replace(first, seq=3), FREE)) == []
    assert state.outgoing() == [], "a reported lease is not released either"
    assert state.outbox[key] == protocol.CompletedReport(*key, result=5)


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [
        (Completed(7), protocol.CompletedReport),
        (Failed("boom", retry=False), protocol.FailedReport),
        (Released("no child"), protocol.ReleaseReport),
        (Rescheduled(3.0), protocol.RescheduleReport),
    ],
)
def test_each_outcome_becomes_its_report(outcome: RunOutcome, expected: type[Any]) -> None:
    state = make_state()
    state.connected(welcome())
    key = start(state, job(1))
    assert state.run_finished(key, outcome) == [WakeSender()]
    (report,) = state.outgoing()
    assert isinstance(report, expected) and key_of(report) == key
    assert state.idle and not state.flushed


def test_an_invalid_reschedule_fails_the_job() -> None:
    state = make_state()
    state.connected(welcome())
    key = start(state, job(1))
    state.run_finished(key, Rescheduled(-1.0))
    (report,) = state.outgoing()
    assert isinstance(report, protocol.FailedReport) and "invalid reschedule" in report.error


@pytest.mark.parametrize(
    ("result", "limits", "problem"),
    [
        ("x" * 200, {"max_payload_bytes": 100}, "bytes"),
        (_deep := [[[[[[1]]]]]], {"max_payload_depth": 3}, "deep"),
        ("x" * 500, {"max_line_bytes": 300}, "over the main's limit of 300"),
        (float("nan"), {}, "cannot be sent as JSON"),
    ],
)
def test_a_result_the_main_cannot_take_fails_without_retry(
    result: Any, limits: dict[str, Any], problem: str
) -> None:
    state = make_state()
    state.connected(welcome(**limits))
    key = start(state, job(1))
    state.run_finished(key, Completed(result))
    (report,) = state.outgoing()
    assert isinstance(report, protocol.FailedReport) and report.retry is False
    assert problem in report.error
    assert state.outbox[key] == report, "the replacement is what is re-sent later"


def test_an_abandoned_run_reports_nothing() -> None:
    state = make_state()
    state.connected(welcome())
    key = start(state, job(1))
    state.run_finished(key, None)
    assert state.outgoing() == [] and state.idle and state.flushed


# --------------------------------------------------------------------------- outbox and acks


def test_unacked_reports_are_held_and_resent_after_a_reconnect() -> None:
    state = make_state()
    state.connected(welcome())
    running = start(state, job(1))
    done = start(state, job(2))
    state.run_finished(done, Completed(1))
    (report,) = state.outgoing()
    assert state.held_leases() == [running, done]

    state.disconnected()
    assert state.run_finished(running, Completed(2)) == [], "no connection: nothing to wake"
    assert state.held_leases() == [done, running]
    effects = state.connected(welcome(adopted=[done, running]))
    assert effects == [WakeSender()]
    resent = state.outgoing()
    assert [key_of(r) for r in resent] == [done, running]  # type: ignore[arg-type]
    assert resent[0] == report
    assert state.take_ready(FREE) == protocol.Ready(slots={INLINE: 2}, seen=0)


def test_a_lease_not_adopted_is_logged_and_still_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = make_state()
    state.connected(welcome())
    key = start(state, job(1))
    state.disconnected()
    with caplog.at_level(logging.INFO, logger="test"):
        state.connected(welcome(adopted=[]))
    assert "lease not adopted by the main" in caplog.text
    state.run_finished(key, Completed())
    assert [type(m) for m in state.outgoing()] == [protocol.CompletedReport]


@pytest.mark.parametrize("status", list(protocol.AckStatus))
def test_every_ack_status_forgets_the_report(
    status: protocol.AckStatus, caplog: pytest.LogCaptureFixture
) -> None:
    state = make_state()
    state.connected(welcome())
    key = start(state, job(1))
    state.run_finished(key, Completed())
    state.outgoing()
    with caplog.at_level(logging.INFO, logger="test"):
        assert state.ack_received(ack(key, status)) == []
    assert state.flushed and state.held_leases() == []
    if status is protocol.AckStatus.REFUSED:
        assert "report refused" in caplog.text
    if status is protocol.AckStatus.STALE:
        assert "report stale" in caplog.text
    assert state.ack_received(ack(key, status)) == [], "a repeated ack is harmless"


def test_a_report_acked_before_it_was_sent_again_is_not_sent() -> None:
    state = make_state()
    state.connected(welcome())
    key = start(state, job(1))
    state.run_finished(key, Completed())
    state.outgoing()
    state.disconnected()
    state.connected(welcome())
    state.ack_received(ack(key))  # from the first connection, arriving late
    assert state.outgoing() == []


# --------------------------------------------------------------------------- cancel


def test_cancel_stops_a_running_job_and_its_outcome_is_still_reported() -> None:
    state = make_state()
    state.connected(welcome())
    key = start(state, job(1))
    assert state.cancel_received(protocol.CancelJob(*key)) == [StopRun(key, INLINE)]
    state.run_finished(key, Failed("cancelled"))
    (report,) = state.outgoing()
    assert isinstance(report, protocol.FailedReport) and report.retry is True


def test_cancel_for_a_job_not_running_here_does_nothing() -> None:
    state = make_state()
    state.connected(welcome())
    assert state.cancel_received(protocol.CancelJob(uuid.uuid4(), uuid.uuid4())) == []


# --------------------------------------------------------------------------- draining


def test_drain_sequence() -> None:
    state = make_state()
    state.connected(welcome())
    state.outgoing()
    state.take_ready(FREE)
    key = start(state, job(1))

    assert state.drain_requested() == [Drain(), WakeSender()]
    assert state.outgoing() == [protocol.Draining()]
    assert state.take_ready({INLINE: 1}) == protocol.Ready(slots={INLINE: 0}, seen=1)

    late = job(2)
    assert started(state.job_received(late, {INLINE: 1})) == []
    (release,) = state.outgoing()
    assert isinstance(release, protocol.ReleaseReport) and "draining" in release.reason
    assert state.take_ready({INLINE: 1}) == protocol.Ready(slots={INLINE: 0}, seen=2)

    assert not state.idle
    state.run_finished(key, Completed())
    assert state.idle and not state.flushed
    state.outgoing()
    state.ack_received(ack(key_of(late)))
    state.ack_received(ack(key))
    assert state.flushed, "a draining worker may exit once every report is acknowledged"

    state.disconnected()
    state.connected(welcome())
    assert state.outgoing() == [protocol.Draining()], "said again on a new connection"


def test_a_second_stop_gives_running_jobs_back() -> None:
    state = make_state()
    state.connected(welcome())
    key = start(state, job(1))
    state.drain_requested()
    state.outgoing()
    state.take_ready(FREE)
    assert state.drain_requested() == [StopFast()]
    assert state.fast
    assert state.drain_requested() == [], "a third request changes nothing"
    assert state.stop_run(key, give_up=state.fast) == StopRun(key, INLINE)
    state.run_finished(key, Failed("cancelled"))
    state.outgoing()
    assert isinstance(state.outbox[key], protocol.ReleaseReport)


def test_fast_at_once_drains_and_stops_fast() -> None:
    state = make_state()
    assert state.drain_requested(fast=True) == [Drain(), StopFast()]


def test_a_drain_deadline_fails_the_jobs_it_stops() -> None:
    state = make_state()
    state.connected(welcome())
    key = start(state, job(1))
    state.drain_requested()
    assert state.stop_run(key, give_up=False) == StopRun(key, INLINE)
    state.run_finished(key, Failed("cancelled"))
    assert isinstance(state.outbox[key], protocol.FailedReport)
    assert state.stop_run(key, give_up=True) is None, "a finished job has nothing to stop"


def test_pings_are_answered_in_order() -> None:
    state = make_state()
    state.connected(welcome())
    state.take_ready(FREE)
    assert state.ping_received(1) == [WakeSender()]
    state.ping_received(2)
    assert state.outgoing() == [protocol.Pong(nonce=1), protocol.Pong(nonce=2)]


# --------------------------------------------------------------------------- start-up failures


def handed_again(state: WorkerState, seq: int, job_id: uuid.UUID) -> LeaseKey:
    """The same job handed to this worker again, under a new lease, and started."""
    return start(state, msgspec.structs.replace(job(seq), job_id=job_id))


def test_a_job_whose_runner_cannot_start_goes_back_unharmed_then_counts_attempts() -> None:
    state = make_state()
    state.connected(welcome())
    job_id = uuid.uuid4()
    reports = []
    for seq in range(1, RUNNER_START_FAILURES_FORGIVEN + 3):
        key = handed_again(state, seq, job_id)
        state.run_finished(key, Released("the runner process could not start: ImportError"))
        (report,) = state.outgoing()
        reports.append(report)
    forgiven = reports[:RUNNER_START_FAILURES_FORGIVEN]
    counted = reports[RUNNER_START_FAILURES_FORGIVEN:]
    assert all(isinstance(r, protocol.ReleaseReport) for r in forgiven), "no attempt counted"
    for failures, report in enumerate(counted, RUNNER_START_FAILURES_FORGIVEN + 1):
        assert isinstance(report, protocol.FailedReport), "each later one is an attempt"
        assert report.retry and not report.lost, "retried by the job's own rules"
        assert f"failed to start {failures} times for this job" in report.error
        assert "ImportError" in report.error, "the last start-up error is shown"


@given(
    st.lists(
        st.tuples(
            st.integers(0, 2),
            st.sampled_from(
                [Released("r"), Completed(1), Failed("x"), Failed("l", lost=True), Rescheduled(1)]
            ),
        ),
        max_size=30,
    )
)
@settings(settings.get_profile(PROFILE))
def test_start_failures_count_per_job_and_a_run_starts_the_count_again(
    events: list[tuple[int, RunOutcome]],
) -> None:
    state = make_state()
    state.connected(welcome())
    job_ids = [uuid.uuid4() for _ in range(3)]
    failures = [0, 0, 0]
    for seq, (which, outcome) in enumerate(events, 1):
        key = handed_again(state, seq, job_ids[which])
        state.run_finished(key, outcome)
        (report,) = state.outgoing()
        if not isinstance(outcome, Released):
            failures[which] = 0
            assert not isinstance(report, protocol.ReleaseReport)
            continue
        failures[which] += 1
        if failures[which] <= RUNNER_START_FAILURES_FORGIVEN:
            assert isinstance(report, protocol.ReleaseReport)
        else:
            assert isinstance(report, protocol.FailedReport) and report.retry
            assert f"failed to start {failures[which]} times" in report.error


def test_a_cancelled_or_drained_job_given_back_by_its_runner_is_not_counted() -> None:
    state = make_state()
    state.connected(welcome())
    job_id = uuid.uuid4()
    for seq in range(1, RUNNER_START_FAILURES_FORGIVEN + 3):
        key = handed_again(state, seq, job_id)
        state.cancel_received(protocol.CancelJob(*key))
        state.run_finished(key, Released("the runner process could not start: killed"))
        assert isinstance(state.outgoing()[0], protocol.ReleaseReport)
    key = handed_again(state, 100, job_id)
    state.drain_requested()
    state.run_finished(key, Released("the runner process could not start: killed"))
    assert any(isinstance(m, protocol.ReleaseReport) for m in state.outgoing())


def test_the_start_failure_counts_are_bounded_and_drop_the_oldest() -> None:
    state = make_state()
    state.connected(welcome())
    seq = 0

    def fail(job_id: uuid.UUID) -> protocol.Message:
        nonlocal seq
        seq += 1
        state.run_finished(handed_again(state, seq, job_id), Released("r"))
        (report,) = state.outgoing()
        return report

    oldest, recent = uuid.uuid4(), uuid.uuid4()
    for _ in range(RUNNER_START_FAILURES_FORGIVEN):
        fail(oldest)
    for _ in range(RUNNER_START_FAILURES_TRACKED - 2):
        fail(uuid.uuid4())
    for _ in range(RUNNER_START_FAILURES_FORGIVEN):
        fail(recent)
    fail(uuid.uuid4())  # one job too many: the least recently failed is forgotten
    assert len(state._start_failures) == RUNNER_START_FAILURES_TRACKED
    assert isinstance(fail(recent), protocol.FailedReport), "a recent count is kept"
    assert isinstance(fail(oldest), protocol.ReleaseReport), "the oldest count was dropped"


# --------------------------------------------------------------------------- property


CAPACITY = 3


class WorkerRules(RuleBasedStateMachine):
    """Random interleavings of jobs, runs, acks, cancels, drains and reconnects against a
    fake runner with ``CAPACITY`` slots and a fake main that acks what it received."""

    def __init__(self) -> None:
        super().__init__()
        self.state = make_state()
        self.seq = 0
        self.starting: set[LeaseKey] = set()
        self.entered: set[LeaseKey] = set()
        self.reported: set[LeaseKey] = set()
        """Runs finished with an outcome, and jobs decided without a run."""
        self.acked: dict[LeaseKey, int] = {}
        """How many acks found the report still in the outbox (must end at exactly one)."""
        self.received: list[LeaseKey] = []
        """Reports the fake main received and has not yet acknowledged."""
        self.connected = False

    def free(self) -> dict[ExecutionMode, int]:
        # The runner's own count: it covers only the runs that entered it.
        return {INLINE: CAPACITY - len(self.entered)}

    def flush(self) -> None:
        for msg in self.state.outgoing():
            if isinstance(
                msg, protocol.CompletedReport | protocol.FailedReport | protocol.ReleaseReport
            ):
                self.received.append(key_of(msg))
            elif isinstance(msg, protocol.RescheduleReport):
                self.received.append((msg.job_id, msg.handoff_id))
        ready = self.state.take_ready(self.free())
        if ready is not None:
            promised = ready.slots[INLINE]
            assert promised <= CAPACITY - len(self.entered) - len(self.starting)

    def ack(self, key: LeaseKey, status: protocol.AckStatus) -> None:
        before = key in self.state.outbox
        self.state.ack_received(ack(key, status))
        if before:
            self.acked[key] = self.acked.get(key, 0) + 1

    @precondition(lambda self: not self.connected)
    @rule()
    def connect(self) -> None:
        self.state.connected(welcome(adopted=self.state.held_leases()))
        self.connected = True
        self.received.clear()

    @precondition(lambda self: self.connected)
    @rule()
    def disconnect(self) -> None:
        self.state.disconnected()
        self.connected = False

    @precondition(lambda self: self.connected)
    @rule(task=st.sampled_from(["add", "add", "missing"]), mode=st.sampled_from([INLINE, POOLED]))
    def job_arrives(self, task: str, mode: ExecutionMode) -> None:
        self.seq += 1
        msg = job(self.seq, task, mode)
        effects = self.state.job_received(msg, self.free())
        if started(effects):
            self.starting.add(key_of(msg))
        else:
            self.reported.add(key_of(msg))

    @precondition(lambda self: self.starting)
    @rule(data=st.data())
    def run_enters(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.starting)))
        self.state.run_entered(key)
        self.starting.remove(key)
        self.entered.add(key)

    @precondition(lambda self: self.entered)
    @rule(
        data=st.data(),
        outcome=st.sampled_from(
            [Completed(1), Failed("x"), Failed("y", retry=False), Released("r"), Rescheduled(1)]
        ),
    )
    def run_finishes(self, data: st.DataObject, outcome: RunOutcome) -> None:
        key = data.draw(st.sampled_from(sorted(self.entered)))
        self.state.run_finished(key, outcome)
        self.entered.remove(key)
        self.reported.add(key)

    @precondition(lambda self: self.connected)
    @rule()
    def send(self) -> None:
        self.flush()

    @precondition(lambda self: self.received)
    @rule(data=st.data(), status=st.sampled_from(list(protocol.AckStatus)))
    def main_acks(self, data: st.DataObject, status: protocol.AckStatus) -> None:
        key = data.draw(st.sampled_from(self.received))
        self.received.remove(key)
        self.ack(key, status)

    @precondition(lambda self: self.acked)
    @rule(data=st.data())
    def main_acks_again(self, data: st.DataObject) -> None:
        self.ack(data.draw(st.sampled_from(sorted(self.acked))), protocol.AckStatus.DUPLICATE)

    @precondition(lambda self: self.connected and (self.entered or self.starting))
    @rule(data=st.data())
    def main_cancels(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.entered | self.starting)))
        assert self.state.cancel_received(protocol.CancelJob(*key)) == [StopRun(key, INLINE)]

    @rule(fast=st.booleans())
    def drain(self, fast: bool) -> None:
        self.state.drain_requested(fast)

    @invariant()
    def held_leases_are_running_or_unacked(self) -> None:
        unacked = {key for key in self.reported if key not in self.acked}
        held = self.state.held_leases()
        assert len(held) == len(set(held))
        assert set(held) == self.starting | self.entered | unacked
        assert set(self.state.running) == self.starting | self.entered

    @invariant()
    def runs_never_exceed_the_slots(self) -> None:
        assert len(self.state.running) <= CAPACITY

    @precondition(lambda self: self.connected and self.state.held_leases())
    @rule(data=st.data())
    def main_repeats_a_held_lease(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.state.held_leases())))
        self.seq += 1
        repeat = msgspec.structs.replace(job(self.seq), job_id=key[0], handoff_id=key[1])
        before = dict(self.state.outbox)
        assert started(self.state.job_received(repeat, self.free())) == []
        assert self.state.outbox == before

    @invariant()
    def a_report_is_forgotten_at_most_once(self) -> None:
        assert all(count == 1 for count in self.acked.values())

    def teardown(self) -> None:
        # Eventually: every run ends, a connection stays up, and the main acks everything.
        for key in sorted(self.starting):
            self.run_enters_key(key)
        for key in sorted(self.entered):
            self.state.run_finished(key, Completed())
            self.entered.remove(key)
            self.reported.add(key)
        if not self.connected:
            self.connect()
        self.flush()
        for key in list(self.received):
            self.ack(key, protocol.AckStatus.APPLIED)
        assert self.state.flushed and self.state.held_leases() == []
        assert self.acked.keys() == self.reported
        assert all(count == 1 for count in self.acked.values())

    def run_enters_key(self, key: LeaseKey) -> None:
        self.state.run_entered(key)
        self.starting.remove(key)
        self.entered.add(key)


WorkerRules.TestCase.settings = settings.get_profile(PROFILE)
test_worker_rules = WorkerRules.TestCase
