"""The handoff core (:mod:`broker.core.handoff`) without sockets: credits, the returns (the
recovery ledger's entries), single events, and a hypothesis state machine that drives the
core through random interleavings against a tiny model of the store and of honest and
forging workers, checking the handoff invariants after every step.

Profiles: ``ci`` (the default: derandomized and bounded, a few seconds) and ``slow``
(``HYPOTHESIS_PROFILE=slow``, used by ``make test-slow``: random and much longer).
"""

from __future__ import annotations

import itertools
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from adapters.memory import MemoryAdapter
from broker.core.handoff import (
    STALL,
    STALL_AFTERMATH,
    Abort,
    ClaimJobs,
    Dispatch,
    Handoff,
    HandoffEffect,
    PlannedClaim,
    ReturnLease,
    Send,
    Settle,
    WakeDispatcher,
)
from broker.core.peers import CreditLimitError, Credits
from broker.exceptions import ProtocolError, StorageError
from broker.jobs import ExecutionMode, Job, JobSpec, JobStatus, Settlement
from broker.main.recovery import RecoveryLedger
from broker.wire import messages as protocol
from tests.unit.conftest import PROFILE

POOLED, FORKED = ExecutionMode.POOLED, ExecutionMode.FORKED
MODES = (POOLED, FORKED)
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
ACK = protocol.AckStatus
OUTCOMES = st.sampled_from(["answered", "answered", "answered", "unknown", "refused"])
"""How a claim call ends: it answers (each job won or lost), raises (committed or not), or
is refused for a value the store will never take."""


def make_job(n: int, *, mode: ExecutionMode = POOLED, queue: str = "a") -> Job:
    return Job(
        id=uuid.UUID(int=(1 << 64) + n),
        task="t",
        args=(),
        kwargs={},
        queue=queue,
        priority=0,
        status=JobStatus.QUEUED,
        attempts=0,
        max_attempts=3,
        run_at=EPOCH,
        created_at=EPOCH,
        updated_at=EPOCH,
        execution_mode=mode,
    )


def core_with_counter() -> Handoff:
    numbers = itertools.count(1)
    return Handoff(max_credit=10, new_lease=lambda: uuid.UUID(int=next(numbers)))


def worker_hello(
    worker_id: str,
    held: list[protocol.LeaseRef] | None = None,
    prefetch_modes: list[ExecutionMode] | None = None,
) -> protocol.Hello:
    return protocol.Hello(
        role=protocol.Role.WORKER,
        protocol=protocol.PROTOCOL_VERSION,
        worker_id=worker_id,
        modes=list(MODES),
        held_leases=held or [],
        prefetch_modes=prefetch_modes or [],
    )


def won(planned: PlannedClaim) -> Job:
    return replace(
        planned.job,
        status=JobStatus.HANDED_OFF,
        handoff_id=planned.lease,
        worker_id=planned.worker_id,
    )


# ---------------------------------------------------------------------- credits


def test_credit_is_the_slots_less_unseen_sends_and_reservations() -> None:
    credits = Credits()
    assert credits.available(POOLED) == 0 and not credits.reserve(POOLED)
    credits.on_ready({POOLED: 3}, seen=0)
    assert credits.reserve(POOLED) and credits.reserve(POOLED)
    assert credits.available(POOLED) == 1
    assert credits.commit(POOLED) == 1  # its seq
    credits.release(POOLED)
    assert credits.available(POOLED) == 2 and credits.in_flight_unseen == 1
    assert credits.modes_with_credit() == {POOLED} and credits.total_available() == 2


@settings(max_examples=50, deadline=None)
@given(
    slots=st.dictionaries(st.sampled_from(list(ExecutionMode)), st.integers(0, 3)),
    later=st.dictionaries(st.sampled_from(list(ExecutionMode)), st.integers(0, 3)),
    spare=st.sets(st.sampled_from(list(ExecutionMode))),
    leading=st.booleans(),
)
def test_the_totals_agree_with_each_modes_credit(
    slots: dict[ExecutionMode, int],
    later: dict[ExecutionMode, int],
    spare: set[ExecutionMode],
    leading: bool,
) -> None:
    """The totals look only at the modes the last ``ready`` listed: the same figures as
    asking every mode, whatever was reserved or sent before a ``ready`` that leaves a
    mode out."""
    credits = Credits()
    credits.keep_spare(spare)
    credits.on_ready(slots, seen=0)
    for mode in slots:
        if credits.reserve(mode, leading=True):
            credits.commit(mode)
        credits.reserve(mode, leading=True)
    credits.on_ready(later, seen=0)
    free = {mode: credits.available(mode, leading=leading) for mode in ExecutionMode}
    assert credits.modes_with_credit(leading=leading) == {m for m, n in free.items() if n > 0}
    assert credits.total_available(leading=leading) == sum(free.values())


def test_a_ready_that_crossed_a_job_on_the_wire_does_not_over_credit() -> None:
    credits = Credits()
    credits.on_ready({POOLED: 1}, seen=0)
    assert credits.reserve(POOLED)
    assert credits.commit(POOLED) == 1
    credits.on_ready({POOLED: 1}, seen=0)  # counted before it took in job 1
    assert credits.available(POOLED) == 0
    credits.on_ready({POOLED: 0}, seen=1)  # job 1 now fills the slot it reports
    assert credits.available(POOLED) == 0
    credits.on_ready({POOLED: 1}, seen=1)  # job 1 finished
    assert credits.available(POOLED) == 1


def test_a_ready_out_of_order_or_over_the_limit_is_refused_and_not_applied() -> None:
    credits = Credits(max_slots=5)
    credits.on_ready({POOLED: 2}, seen=0)
    with pytest.raises(ProtocolError, match="outside the jobs sent"):
        credits.on_ready({POOLED: 4}, seen=1)  # nothing was sent yet
    with pytest.raises(CreditLimitError, match="over this main's limit"):
        credits.on_ready({POOLED: 6}, seen=0)
    assert credits.available(POOLED) == 2
    assert credits.reserve(POOLED)
    credits.commit(POOLED)
    credits.on_ready({POOLED: 2}, seen=1)
    with pytest.raises(ProtocolError, match="outside the jobs sent"):
        credits.on_ready({POOLED: 2}, seen=0)  # seen went backwards


def test_releasing_a_credit_never_reserved_is_a_bug() -> None:
    with pytest.raises(RuntimeError, match="no pooled credit is reserved"):
        Credits().release(POOLED)


def test_restoring_a_failed_claim_does_not_refund_twice_after_a_newer_ready() -> None:
    credits = Credits()
    credits.on_ready({POOLED: 1}, seen=0)
    assert credits.reserve(POOLED)
    credits.on_ready({POOLED: 1}, seen=0)  # arrives while the claim is in flight
    assert credits.available(POOLED) == 0
    credits.release(POOLED)  # the claim was lost
    assert credits.available(POOLED) == 1


def test_a_mode_with_a_window_keeps_its_last_credit_for_a_leading_job() -> None:
    credits = Credits()
    credits.keep_spare([POOLED])
    credits.on_ready({POOLED: 3, FORKED: 1}, seen=0)
    assert credits.available(POOLED) == 2 and credits.available(POOLED, leading=True) == 3
    assert credits.available(FORKED) == 1  # no window: no spare
    assert credits.reserve(POOLED) and credits.reserve(POOLED)
    assert not credits.reserve(POOLED), "the backlog never takes the spare"
    assert credits.modes_with_credit() == {FORKED} and credits.total_available() == 1
    assert credits.reserve(POOLED, leading=True)
    assert not credits.reserve(POOLED, leading=True), "never more than the slots advertised"
    credits.release(POOLED)
    assert credits.available(POOLED) == 0 and credits.available(POOLED, leading=True) == 1


def test_a_pass_leaves_the_spare_and_an_urgent_enqueue_that_leads_takes_it() -> None:
    """Issue 35: during a drain every freed credit went to the backlog, so an urgent job
    found none at its insert; now the pass leaves one and the leading job takes it."""
    core = core_with_counter()
    peer = core.new_peer(1, now=0.0)
    core.hello(peer, worker_hello("w1", prefetch_modes=[POOLED]))
    core.ready(1, {POOLED: 3}, seen=0)
    backlog = [make_job(n) for n in range(5)]
    plan = core.plan(backlog, 0.0)
    assert [p.job for p in plan] == backlog[:2]
    assert core.credit() == 0, "the dispatcher sees no credit: no pass for nothing"
    urgent = JobSpec(task="t", priority=10)
    trailing = JobSpec(task="t", priority=-1)
    [planned] = core.plan_at_enqueue([urgent], EPOCH, leads=lambda mode, queue, key: True)
    assert planned is not None and planned.peer == 1
    assert core.plan_at_enqueue([trailing], EPOCH, leads=lambda mode, queue, key: True) == [None]
    assert core.plan_at_enqueue([urgent], EPOCH, leads=lambda mode, queue, key: False) == [None]


def test_a_worker_without_a_window_keeps_no_spare() -> None:
    core = core_with_counter()
    core.hello(core.new_peer(1, now=0.0), worker_hello("w1"))  # prefetch_modes: []
    core.ready(1, {POOLED: 2}, seen=0)
    assert len(core.plan([make_job(n) for n in range(3)], 0.0)) == 2


# ---------------------------------------------------------------------- the returns (ledger state)


def _dispatched_core() -> tuple[Handoff, list[PlannedClaim]]:
    core = core_with_counter()
    peer = core.new_peer(1, now=0.0)
    core.hello(peer, worker_hello("w1"))
    core.ready(1, {POOLED: 2}, seen=0)
    plan = core.plan([make_job(1), make_job(2)], 0.0)
    core.claimed(plan, [won(p) for p in plan])
    return core, plan


def test_a_disconnect_queues_every_held_lease_for_return_once() -> None:
    core, plan = _dispatched_core()
    effects = core.disconnect(1, 0.0)
    assert effects == [ReturnLease(p.job.id, p.lease, "worker connection ended") for p in plan]
    assert core.returns == {p.lease: p.job.id for p in plan}
    assert core.disconnect(1, 0.0) == [], "a second disconnect returns nothing"


def test_a_return_is_done_only_for_its_own_lease_and_job() -> None:
    core, plan = _dispatched_core()
    core.disconnect(1, 0.0)
    core.returned(plan[0].lease, plan[1].job.id)  # not that entry
    assert plan[0].lease in core.returns
    core.returned(plan[0].lease, plan[0].job.id)
    assert core.returns == {plan[1].lease: plan[1].job.id}


class FlakyReturns(MemoryAdapter):
    """Its first settlement raises: the store could not be reached. (A disconnect's leases
    are lost attempts, given back as ``LOST`` settlements.)"""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[uuid.UUID, uuid.UUID]] = []

    async def settle_many(self, settlements: Sequence[Settlement]) -> list[bool]:
        self.calls += [(s.job_id, s.handoff_id) for s in settlements]
        if len(self.calls) == 1:
            raise StorageError("store unreachable")
        return await super().settle_many(settlements)


async def test_the_ledger_gives_back_the_cores_returns_and_keeps_what_failed() -> None:
    core, plan = _dispatched_core()
    core.disconnect(1, 0.0)
    store = FlakyReturns()
    woken: list[bool] = []
    ledger = RecoveryLedger(store, core, on_returned=lambda: woken.append(True))
    assert len(ledger) == 2 and plan[0].lease in ledger
    assert not await ledger.flush(), "the failed return stays"
    assert ledger.pending() == {plan[0].lease: plan[0].job.id}
    assert woken == [], "unknown jobs: nothing was returned, so no dispatch pass"
    assert await ledger.flush()
    assert core.returns == {} and store.calls[-1] == (plan[0].job.id, plan[0].lease)


def test_a_stopping_main_returns_nothing_so_the_next_one_adopts() -> None:
    core, _ = _dispatched_core()
    assert core.disconnect(1, 0.0, stopping=True) == []
    assert core.returns == {}


def test_an_unknown_claim_outcome_returns_every_lease_and_frees_the_credit() -> None:
    core = core_with_counter()
    core.hello(core.new_peer(1, now=0.0), worker_hello("w1"))
    core.ready(1, {POOLED: 2}, seen=0)
    plan = core.plan([make_job(1), make_job(2)], 0.0)
    assert core.credit() == 0
    effects = core.claim_unknown(plan)
    assert [e.lease for e in effects if isinstance(e, ReturnLease)] == [p.lease for p in plan]
    assert core.credit() == 2 and core.claiming == {}


def test_a_refused_claim_is_split_under_fresh_leases_keeping_its_credit() -> None:
    core = core_with_counter()
    core.hello(core.new_peer(1, now=0.0), worker_hello("w1"))
    core.ready(1, {POOLED: 3}, seen=0)
    plan = core.plan([make_job(1), make_job(2), make_job(3)], 0.0)
    effects = core.claim_refused(plan)
    returned = {e.lease for e in effects if isinstance(e, ReturnLease)}
    halves = [e.claims for e in effects if isinstance(e, ClaimJobs)]
    assert returned == {p.lease for p in plan}
    assert [len(h) for h in halves] == [1, 2]
    fresh = {c.lease for h in halves for c in h}
    assert not fresh & returned and set(core.claiming) == fresh
    assert core.credit() == 0, "the halves keep the reservations"
    assert core.claim_refused(halves[0]) == [
        ReturnLease(halves[0][0].job.id, halves[0][0].lease, "claim outcome unknown")
    ], "a job alone is not split again"


def test_a_report_for_a_lease_another_connection_holds_is_stale() -> None:
    core, plan = _dispatched_core()
    core.hello(core.new_peer(2, now=0.0), worker_hello("w2"))
    report = protocol.CompletedReport(job_id=plan[0].job.id, handoff_id=plan[0].lease)
    [ack] = core.report(2, report)
    assert isinstance(ack, Send) and isinstance(ack.message, protocol.ReportAck)
    assert ack.message.status is ACK.STALE
    assert core.report(1, report) == [Settle(1, report)]


def test_adoption_after_a_restart_takes_held_orphans_and_returns_the_rest() -> None:
    core, plan = _dispatched_core()
    core.disconnect(1, 0.0, stopping=True)
    restarted = core_with_counter()
    restarted.load_orphans(won(p) for p in plan)
    keep = protocol.LeaseRef(job_id=plan[0].job.id, handoff_id=plan[0].lease)
    adopted, effects = restarted.hello(restarted.new_peer(7, now=0.0), worker_hello("w1", [keep]))
    assert adopted == [keep]
    assert effects == [
        ReturnLease(plan[1].job.id, plan[1].lease, "worker reconnected without this lease")
    ]
    assert restarted.orphans == {} and list(restarted.peers[7].leases) == [plan[0].lease]


# ---------------------------------------------------------------------- a stall of the main


def _ref(planned: PlannedClaim) -> protocol.LeaseRef:
    return protocol.LeaseRef(job_id=planned.job.id, handoff_id=planned.lease)


def test_a_connection_dropped_during_a_stall_parks_its_leases_for_the_same_worker() -> None:
    """The main's loop was stalled past the worker's liveness timeout: the worker gave the
    socket up but runs its jobs still. Its leases wait for its hello, which adopts those
    it lists and returns the rest; no other worker id touches them."""
    core, plan = _dispatched_core()
    assert core.disconnect(1, 10.0, stall=STALL) == []
    assert core.returns == {} and set(core.parked) == {p.lease for p in plan}
    assert core.hello(core.new_peer(2, now=10.0), worker_hello("w2", [_ref(plan[0])])) == (
        [],
        [],
    ), "another worker id adopts nothing"
    adopted, effects = core.hello(core.new_peer(3, now=10.5), worker_hello("w1", [_ref(plan[0])]))
    assert adopted == [_ref(plan[0])]
    assert effects == [
        ReturnLease(plan[1].job.id, plan[1].lease, "worker reconnected without this lease")
    ]
    assert core.parked == {} and list(core.peers[3].leases) == [plan[0].lease]


def test_a_drop_read_just_after_a_measured_stall_is_parked_and_a_later_one_returns() -> None:
    """The loop's first pass after a stall may run the liveness check before it reads the
    sockets that ended meanwhile: a drop within the aftermath still counts; after it, a
    drop is a dead worker, and its leases go back at once."""
    core, plan = _dispatched_core()
    core.tick(100.0, stall=20.0, timeout=15.0, ping=False)
    assert core.disconnect(1, 100.0 + STALL_AFTERMATH) == []
    assert set(core.parked) == {p.lease for p in plan}

    later, plan2 = _dispatched_core()
    later.tick(100.0, stall=20.0, timeout=15.0, ping=False)
    effects = later.disconnect(1, 100.1 + STALL_AFTERMATH)
    assert [e.lease for e in effects if isinstance(e, ReturnLease)] == [p.lease for p in plan2]
    assert later.parked == {}

    healthy, plan3 = _dispatched_core()
    healthy.tick(100.0, stall=STALL / 2, timeout=15.0, ping=False)
    effects = healthy.disconnect(1, 100.0, stall=STALL / 2)
    assert len([e for e in effects if isinstance(e, ReturnLease)]) == len(plan3)


def test_parked_leases_go_back_after_the_grace_which_a_new_stall_extends() -> None:
    core, plan = _dispatched_core()  # the reconnect grace is 30 s by default
    core.disconnect(1, 10.0, stall=5.0)
    assert core.tick(39.0, stall=0.0, timeout=15.0, ping=False) == []
    assert core.tick(45.0, stall=6.0, timeout=15.0, ping=False) == [], "stalled: excused"
    reason = "worker did not reconnect within the grace after the main's stall"
    assert core.tick(46.0, stall=0.0, timeout=15.0, ping=False) == [
        ReturnLease(p.job.id, p.lease, reason) for p in plan
    ]
    assert core.parked == {} and set(core.losses) == {p.lease for p in plan}


def test_a_parked_lease_that_settles_or_is_cancelled_is_forgotten() -> None:
    core, plan = _dispatched_core()
    report = protocol.CompletedReport(job_id=plan[0].job.id, handoff_id=plan[0].lease)
    assert core.report(1, report) == [Settle(1, report)]  # in flight when the socket ends
    core.disconnect(1, 10.0, stall=STALL)
    assert core.held_job(plan[0].lease) == won(plan[0])
    core.settled([(1, report, ACK.APPLIED)])
    core.cancelled(replace(won(plan[1]), status=JobStatus.CANCELLED))
    assert core.parked == {} and core.returns == {}


def test_a_stopping_main_parks_nothing() -> None:
    core, _ = _dispatched_core()
    assert core.disconnect(1, 10.0, stall=STALL, stopping=True) == []
    assert core.parked == {} and core.returns == {}


# ---------------------------------------------------------------------- the state machine


@dataclass
class Conn:
    """The model's view of one worker connection: what the worker itself knows."""

    worker_id: str
    capacity: dict[ExecutionMode, int]
    sent: dict[int, tuple[ExecutionMode, uuid.UUID]] = field(default_factory=dict)
    """seq -> (mode, lease) of every job message the main sent on this connection."""
    read: int = 0
    """The last seq the worker has read."""
    running: dict[uuid.UUID, ExecutionMode] = field(default_factory=dict)
    """Leases the worker runs (read, or adopted) and has not reported yet."""
    unacked: dict[uuid.UUID, protocol.CompletedReport | protocol.ReleaseReport] = field(
        default_factory=dict
    )
    ready_slots: dict[ExecutionMode, int] = field(default_factory=dict)
    ready_seen: int = 0
    spare: frozenset[ExecutionMode] = frozenset()
    """The modes its ``hello`` said have a prefetch window: their last credit is kept for
    a job that overtakes no waiting job."""
    live: bool = True
    """False once the worker moved to a newer connection (this one is a zombie)."""


class HandoffMachine(RuleBasedStateMachine):
    """The store model is ``job -> (status, lease)``: the lease is the last one the job
    was handed off under (kept after it settles, like the real store's ``handoff_id``)."""

    def __init__(self) -> None:
        super().__init__()
        self.numbers = itertools.count(1)
        self.core = self._new_core()
        self.jobs: list[Job] = []
        self.store: dict[uuid.UUID, tuple[JobStatus, uuid.UUID | None]] = {}
        self.by_id: dict[uuid.UUID, Job] = {}
        self.owner: dict[uuid.UUID, str] = {}
        """lease -> worker id it was claimed for."""
        self.lease_job: dict[uuid.UUID, uuid.UUID] = {}
        self.minted: set[uuid.UUID] = set()
        self.batches: list[tuple[PlannedClaim, ...]] = []
        self.pending: list[tuple[int, protocol.CompletedReport | protocol.ReleaseReport]] = []
        self.conns: dict[int, Conn] = {}
        self.latest: dict[str, int] = {}
        """worker id -> its latest connection (whose running jobs it remembers)."""
        self.ids = itertools.count(1)
        self.now = 0.0
        for _ in range(4):
            self.enqueue()

    def _new_core(self) -> Handoff:
        return Handoff(
            max_credit=10,
            new_lease=lambda: uuid.UUID(int=next(self.numbers)),
            reconnect_grace=10.0,
        )

    # ------------------------------------------------------------------ effects

    def apply(self, effects: list[HandoffEffect]) -> None:
        for effect in effects:
            match effect:
                case Dispatch(peer=peer, seq=seq, job=job):
                    lease = job.handoff_id
                    assert lease is not None
                    assert self.store[job.id] == (JobStatus.HANDED_OFF, lease), (
                        "a job was sent that the store did not hand off under its lease"
                    )
                    conn = self.conns[peer]
                    assert seq == len(conn.sent) + 1, "job messages are numbered in order"
                    conn.sent[seq] = (job.execution_mode, lease)
                case Send(peer=peer, message=message):
                    conn = self.conns[peer]
                    match message:
                        case protocol.ReportAck(handoff_id=lease):
                            conn.unacked.pop(lease, None)
                        case protocol.CancelJob(handoff_id=lease):
                            conn.running.pop(lease, None)
                case Settle(peer=peer, report=report):
                    status, lease = self.store[report.job_id]
                    assert status is JobStatus.HANDED_OFF and lease == report.handoff_id, (
                        f"a report was accepted under lease {report.handoff_id}, but the "
                        f"store has the job {status} under {lease}: a stale lease would settle"
                    )
                    self.pending.append((peer, report))
                case ClaimJobs(claims=claims):
                    self._minted(claims)
                    self.batches.append(claims)
                case ReturnLease(lease=lease):
                    assert lease in self.core.returns
                case WakeDispatcher():
                    pass  # the dispatcher's nudge: another pass, no change to the queue

    def _minted(self, claims: tuple[PlannedClaim, ...] | list[PlannedClaim]) -> None:
        for planned in claims:
            assert planned.lease not in self.minted, "a lease is minted once"
            self.minted.add(planned.lease)
            self.owner[planned.lease] = planned.worker_id
            self.lease_job[planned.lease] = planned.job.id

    def _commit(self, planned: PlannedClaim) -> Job | None:
        """The store claims the job under the planned lease, if it is still queued."""
        status, _ = self.store[planned.job.id]
        if status is not JobStatus.QUEUED:
            return None
        self.store[planned.job.id] = (JobStatus.HANDED_OFF, planned.lease)
        return won(planned)

    def _live(self) -> list[int]:
        """The live worker connections (a client's takes no jobs and sends no ``ready``)."""
        return sorted(p for p, c in self.conns.items() if c.live and p in self.core.worker_peers)

    # ------------------------------------------------------------------ peers

    @precondition(lambda self: len(self.jobs) < 16)
    @rule()
    def enqueue(self) -> None:
        n = len(self.jobs)
        job = make_job(n, mode=MODES[n % 3 // 2], queue="ab"[n % 4 // 3])
        self.jobs.append(job)
        self.by_id[job.id] = job
        self.store[job.id] = (JobStatus.QUEUED, None)
        self.core.queue_changed()  # the insert's notification wakes the dispatcher

    def _stored_queued(self, mode: ExecutionMode) -> None:
        """The main's own enqueue stored a queued job of ``mode`` (not handed off)."""
        n = len(self.jobs)
        job = make_job(n, mode=mode, queue="ab"[n % 4 // 3])
        self.jobs.append(job)
        self.by_id[job.id] = job
        self.store[job.id] = (JobStatus.QUEUED, None)
        self.core.jobs_added({mode})

    @initialize(data=st.data())
    def two_workers(self, data: st.DataObject) -> None:
        self.hello(data, "w1", {POOLED: 2, FORKED: 1}, None, frozenset({POOLED}))
        self.hello(data, "w2", {POOLED: 1, FORKED: 1}, ["a"])

    @precondition(lambda self: len(self.core.worker_peers) < 4)
    @rule(
        data=st.data(),
        worker=st.sampled_from(["w1", "w2", "w3"]),
        capacity=st.fixed_dictionaries({POOLED: st.integers(1, 3), FORKED: st.integers(0, 2)}),
        queues=st.sampled_from([None, ["a"], ["b"]]),
        spare=st.frozensets(st.sampled_from(MODES)),
    )
    def hello(
        self,
        data: st.DataObject,
        worker: str,
        capacity: dict[ExecutionMode, int],
        queues: list[str] | None,
        spare: frozenset[ExecutionMode] = frozenset(),
    ) -> None:
        """A worker connects (first time, or again with the leases it still runs)."""
        remembered: dict[uuid.UUID, ExecutionMode] = {}
        if worker in self.latest:  # the worker moves to this connection
            previous = self.conns[self.latest[worker]]
            previous.live = False
            remembered = previous.running
        keep = (
            data.draw(st.lists(st.sampled_from(sorted(remembered)), unique=True))
            if remembered
            else []
        )
        held = [protocol.LeaseRef(job_id=self.lease_job[lease], handoff_id=lease) for lease in keep]
        pid = next(self.ids)
        self.conns[pid] = Conn(
            worker, capacity, running={lease: remembered[lease] for lease in keep}, spare=spare
        )
        self.latest[worker] = pid
        peer = self.core.new_peer(pid, now=self.now)
        hello = protocol.Hello(
            role=protocol.Role.WORKER,
            protocol=protocol.PROTOCOL_VERSION,
            worker_id=worker,
            modes=list(MODES),
            queues=queues,
            held_leases=held,
            prefetch_modes=sorted(spare),
        )
        adopted, effects = self.core.hello(peer, hello)
        for ref in adopted:
            assert self.store[ref.job_id] == (JobStatus.HANDED_OFF, ref.handoff_id)
            assert self.owner[ref.handoff_id] == worker, "only a worker's own leases are adopted"
        self.apply(effects)
        self._ready(pid, data)  # a worker's first message after the welcome

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def ready(self, data: st.DataObject) -> None:
        self._ready(data.draw(st.sampled_from(self._live())), data)

    def _ready(self, pid: int, data: st.DataObject) -> None:
        """The worker reads up to some job and says how many slots it has free."""
        conn = self.conns[pid]
        self._read(conn, data.draw(st.integers(conn.read, len(conn.sent)), label="read up to"))
        busy = Counter(conn.running.values())
        slots = {mode: max(0, conn.capacity[mode] - busy[mode]) for mode in MODES}
        self.apply(self.core.ready(pid, slots, conn.read))
        conn.ready_slots, conn.ready_seen = slots, conn.read

    def _read(self, conn: Conn, upto: int) -> None:
        """The worker takes in the job messages up to ``upto`` and starts them."""
        for seq in range(conn.read + 1, upto + 1):
            mode, lease = conn.sent[seq]
            conn.running[lease] = mode
        conn.read = upto

    @precondition(lambda self: len(self.core.peers) - len(self.core.worker_peers) < 3)
    @rule()
    def client_connects(self) -> None:
        """An application's ``Client`` connects: a peer that holds no leases and takes no
        jobs, whose reports are all stale (see :meth:`report`)."""
        pid = next(self.ids)
        self.conns[pid] = Conn("", {})
        peer = self.core.new_peer(pid, now=self.now)
        hello = protocol.Hello(role=protocol.Role.CLIENT, protocol=protocol.PROTOCOL_VERSION)
        assert self.core.hello(peer, hello) == ([], [])

    @precondition(lambda self: self.core.peers)
    @rule(
        data=st.data(),
        kind=st.sampled_from(["drain", "disconnect", "stalled disconnect", "pause", "bad ready"]),
    )
    def peer_event(self, data: st.DataObject, kind: str) -> None:
        """A worker drains, its connection ends (while the main's loop runs, or while it
        is stalled: its leases are parked for the worker's hello), the transport pauses
        (or resumes) it over its outbox cap, or it sends a ``ready`` out of order
        (refused, nothing applied); a client's connection ends."""
        pid = data.draw(st.sampled_from(sorted(self.core.peers)))
        conn = self.conns[pid]
        if pid not in self.core.worker_peers:
            kind = "disconnect"  # the main routes a client nothing else (broker.main.main)
        if kind == "drain":
            self.apply(self.core.draining(pid))
        elif kind in ("disconnect", "stalled disconnect"):
            conn.live = False
            stall = 3.0 if kind == "stalled disconnect" else 0.0
            self.apply(self.core.disconnect(pid, self.now, stall=stall))
        elif kind == "pause":
            liveness = self.core.peers[pid].liveness
            liveness.paused_since = self.now if liveness.paused_since is None else None
        else:
            with pytest.raises(ProtocolError):
                self.core.ready(pid, {POOLED: 1}, len(conn.sent) + 1)

    @rule(
        data=st.data(),
        elapsed=st.sampled_from([1.0, 6.0]),
        stall=st.sampled_from([0.0, 0.0, 3.0]),
    )
    def liveness_tick(self, data: st.DataObject, elapsed: float, stall: float) -> None:
        """Time passes: parked leases whose grace is over go back, the peers silent too
        long are aborted (then disconnected), the others pinged; each live worker answers
        or stays silent."""
        self.now += elapsed
        effects = self.core.tick(self.now, stall=stall, timeout=15.0, ping=True)
        for effect in effects:
            if isinstance(effect, Send):
                self.apply([effect])
                if self.conns[effect.peer].live and data.draw(st.integers(0, 4), label="pong") > 0:
                    assert isinstance(effect.message, protocol.Ping)
                    self.core.pong(effect.peer, effect.message.nonce, self.now)
            elif isinstance(effect, Abort):
                self.conns[effect.peer].live = False
                self.apply(self.core.disconnect(effect.peer, self.now))
            else:
                event("a parked lease went back after its grace")
                self.apply([effect])

    # ------------------------------------------------------------------ dispatch

    @rule(data=st.data(), outcome=OUTCOMES)
    def dispatch_pass(self, data: st.DataObject, outcome: str) -> None:
        """A whole pass: plan, then claim at once."""
        before = len(self.batches)
        self.plan(data)
        if len(self.batches) > before:
            self._claim(self.batches.pop(), data, outcome)

    @rule(data=st.data())
    def plan(self, data: st.DataObject) -> None:
        """The dispatcher reads eligible jobs (as the store would select them) and plans;
        as it does, it reads no mode proven drained, and a read proves its modes drained
        only when it came back short and every job in it found a slot."""
        modes = self.core.modes_with_credit() - self.core.drained
        queues = self.core.served_queues()
        started = self.core.queue_changes
        eligible = [
            job
            for job in self.jobs
            if self.store[job.id][0] is JobStatus.QUEUED
            and job.execution_mode in modes
            and (queues is None or job.queue in queues)
        ]
        limit = self.core.credit() + len(self.core.claiming)  # as the dispatcher reads
        eligible = eligible[:limit]
        order = data.draw(st.permutations(range(len(eligible))))
        before = self._leading_credit()
        planned = self.core.plan([eligible[i] for i in order], 0.0)
        for (pid, mode), free in self._leading_credit().items():
            if mode in self.conns[pid].spare:
                # A pass never takes a spare credit: it is kept for a job that leads.
                assert free >= min(1, before[pid, mode]), f"a pass took {pid}'s {mode} spare"
        full = len(eligible) == limit or len(planned) < len(eligible)
        if len(self.jobs) < 16 and data.draw(st.booleans(), label="enqueued during the read"):
            # The main stored a job while the read was under way: the read did not see
            # it, so it proves nothing about that job's mode (the others, it still may).
            self._stored_queued(data.draw(st.sampled_from(MODES), label="its mode"))
        self.core.read_eligible(started, modes, full=full, queues=queues)
        self._minted(planned)
        if planned:
            self.batches.append(tuple(planned))

    def _leading_credit(self) -> dict[tuple[int, ExecutionMode], int]:
        """Every worker connection's free credit per mode, its spare counted."""
        return {
            (pid, mode): peer.credits.available(mode, leading=True)
            for pid, peer in self.core.worker_peers.items()
            for mode in MODES
        }

    @precondition(lambda self: self.batches)
    @rule(data=st.data(), outcome=OUTCOMES)
    def claim(self, data: st.DataObject, outcome: str) -> None:
        """A claim call answers (each job won or lost), raises (committed or not), or is
        refused for a value the store will never take."""
        self._claim(
            self.batches.pop(data.draw(st.integers(0, len(self.batches) - 1))), data, outcome
        )

    def _claim(self, batch: tuple[PlannedClaim, ...], data: st.DataObject, outcome: str) -> None:
        if outcome == "refused":
            self.apply(self.core.claim_refused(batch))
            return
        wins = [p for p in batch if data.draw(st.integers(0, 3), label="won") > 0]
        got = [job for job in map(self._commit, wins) if job is not None]
        if outcome == "answered":
            self.apply(self.core.claimed(batch, got))
        else:
            self.apply(self.core.claim_unknown(batch))

    @precondition(lambda self: len(self.jobs) < 16)
    @rule(data=st.data(), outcome=OUTCOMES)
    def enqueue_handed_off(self, data: st.DataObject, outcome: str) -> None:
        """A job is enqueued through the main: if the core plans it at once, the store
        writes it handed off in the insert (or the insert's outcome is unknown). It must
        never overtake a job that was waiting for the same worker."""
        n = len(self.jobs)
        job = make_job(n, mode=MODES[n % 3 // 2], queue="ab"[n % 4 // 3])
        spec = JobSpec(task="t", id=job.id, queue=job.queue, execution_mode=job.execution_mode)
        backlog_credit = self.core.credit(job.execution_mode)
        # The read-ahead's word, as the dispatcher gives it: the job leads when no job of
        # its mode waits (all have one priority here, and a tie is not a lead).
        being_claimed = {p.job.id for p in self.core.claiming.values()}
        waiting = {
            other.execution_mode
            for other in self.jobs
            if self.store[other.id][0] is JobStatus.QUEUED and other.id not in being_claimed
        }
        leads = data.draw(st.booleans(), label="the read-ahead is current")
        [planned] = self.core.plan_at_enqueue(
            [spec], EPOCH, (lambda mode, queue, key: mode not in waiting) if leads else None
        )
        if planned is not None and backlog_credit == 0:
            event("enqueue: handed off on the spare credit")
        self.jobs.append(job)
        self.by_id[job.id] = job
        self.store[job.id] = (JobStatus.QUEUED, None)
        event("enqueue: " + ("queued" if planned is None else "handed off at once"))
        if planned is None:
            self.core.jobs_added({job.execution_mode})  # the main's own insert, queued
            return
        peer = self.core.peers[planned.peer]
        being_claimed = {p.job.id for p in self.core.claiming.values()}
        overtaken = [
            other.id
            for other in self.jobs[:-1]
            if self.store[other.id][0] is JobStatus.QUEUED
            and other.execution_mode is job.execution_mode
            and peer.serves(other)
            and other.id not in being_claimed
        ]
        assert not overtaken, f"a job enqueued now went ahead of waiting jobs {overtaken}"
        self._minted([planned])
        if outcome == "refused":  # the insert was refused: nothing stored, lease unused
            del self.store[job.id]
            self.jobs.pop()
            del self.by_id[job.id]
            self.apply(self.core.claim_unknown([planned]))
            return
        if data.draw(st.booleans(), label="committed"):
            self.store[job.id] = (JobStatus.HANDED_OFF, planned.lease)
        if outcome == "answered" and self.store[job.id][0] is JobStatus.HANDED_OFF:
            self.apply(self.core.claimed([planned], [won(planned)]))
        elif outcome == "answered":  # stored queued (say, not due by the store's clock)
            self.apply(self.core.claimed([planned], []))
        else:
            self.apply(self.core.claim_unknown([planned]))
        # A job stored queued after all was a claim not won: the core counted that as a
        # change. One handed off changes no queue.

    # ------------------------------------------------------------------ reports

    @precondition(lambda self: self.core.peers and self.lease_job)
    @rule(data=st.data(), kind=st.sampled_from(["honest", "honest", "again", "forged"]))
    def report(self, data: st.DataObject, kind: str) -> None:
        """An honest worker takes in the jobs sent to it, finishes one and reports it; or
        re-sends a report not acknowledged yet; or any connection reports any lease ever
        minted (held elsewhere, stale, settled, forged). Half the accepted reports settle
        at once, the others wait (in order or not) for :meth:`settle`."""
        live = self._live()
        honest = [
            p for p in live if self.conns[p].running or self.conns[p].read < len(self.conns[p].sent)
        ]
        again = [p for p in live if self.conns[p].unacked]
        msg: protocol.CompletedReport | protocol.ReleaseReport
        if kind == "honest" and honest:
            pid = data.draw(st.sampled_from(honest))
            conn = self.conns[pid]
            self._read(conn, len(conn.sent))
            if not conn.running:
                return
            lease = data.draw(st.sampled_from(sorted(conn.running)))
            del conn.running[lease]
            job_id = self.lease_job[lease]
            if data.draw(st.booleans(), label="release"):
                msg = protocol.ReleaseReport(job_id=job_id, handoff_id=lease, reason="draining")
            else:
                msg = protocol.CompletedReport(job_id=job_id, handoff_id=lease)
            conn.unacked[lease] = msg
        elif kind == "again" and again:
            pid = data.draw(st.sampled_from(again))
            conn = self.conns[pid]
            msg = conn.unacked[data.draw(st.sampled_from(sorted(conn.unacked)))]
        else:
            pid = data.draw(st.sampled_from(sorted(self.core.peers)))
            lease = data.draw(st.sampled_from(sorted(self.lease_job)))
            msg = protocol.CompletedReport(job_id=self.lease_job[lease], handoff_id=lease)
        self.apply(self.core.report(pid, msg))
        if self.pending and data.draw(st.booleans(), label="settle now"):
            self._settle(len(self.pending) - 1, data)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def settle(self, data: st.DataObject) -> None:
        self._settle(data.draw(st.integers(0, len(self.pending) - 1)), data)

    def _settle(self, index: int, data: st.DataObject) -> None:
        """The store applies an accepted report, fenced on its lease, then it is acked."""
        peer, msg = self.pending.pop(index)
        refused = data.draw(st.integers(0, 5), label="refused") == 0
        status, lease = self.store[msg.job_id]
        done = JobStatus.QUEUED if isinstance(msg, protocol.ReleaseReport) else JobStatus.COMPLETED
        if refused:
            ack = ACK.REFUSED
        elif status is JobStatus.HANDED_OFF and lease == msg.handoff_id:
            self.store[msg.job_id] = (done, lease)
            ack = ACK.APPLIED
        elif status is done and lease == msg.handoff_id:
            ack = ACK.DUPLICATE
        else:
            ack = ACK.STALE
        self.apply(self.core.settled([(peer, msg, ack)]))

    # ------------------------------------------------------------------ exits

    @precondition(lambda self: self.core.returns)
    @rule(data=st.data())
    def ledger_returns(self, data: st.DataObject) -> None:
        """The ledger gives some leases back; the store's return is fenced on the lease."""
        for lease, job_id in data.draw(
            st.lists(st.sampled_from(sorted(self.core.returns.items())), unique=True)
        ):
            if self.store.get(job_id) == (JobStatus.HANDED_OFF, lease):
                self.store[job_id] = (JobStatus.QUEUED, lease)
            self.core.returned(lease, job_id)
            self.core.queue_changed()  # the ledger wakes the dispatcher

    @precondition(lambda self: self.core.orphans)
    @rule()
    def orphan_deadline(self) -> None:
        self.apply(self.core.orphan_deadline())

    @precondition(lambda self: self.core.dispatched)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        job = self.jobs[data.draw(st.integers(0, len(self.jobs) - 1), label="job")]
        status, lease = self.store[job.id]
        if status.is_active:
            status = JobStatus.CANCELLED
            self.store[job.id] = (status, lease)
        self.apply(self.core.cancelled(replace(job, status=status, handoff_id=lease)))

    @precondition(lambda self: self.core.dispatched)
    @rule(data=st.data())
    def restart(self, data: st.DataObject) -> None:
        """The main stops and a new one starts: claims in flight land or not, reports not
        settled yet are lost (their workers still run the jobs), the returns not made yet
        are forgotten, and the store's handoffs become the new main's orphans."""
        for batch in self.batches:
            for planned in batch:
                if data.draw(st.booleans()):
                    self._commit(planned)
        self.batches.clear()
        self.pending.clear()
        for pid in list(self.core.peers):
            assert self.core.disconnect(pid, 0.0, stopping=True) == []
        for conn in self.conns.values():
            conn.live = False
            conn.unacked.clear()  # answered stale by the next main, if re-sent
        self.core = self._new_core()
        self.core.load_orphans(
            replace(
                self.by_id[job_id], status=status, handoff_id=lease, worker_id=self.owner[lease]
            )
            for job_id, (status, lease) in self.store.items()
            if status is JobStatus.HANDED_OFF and lease is not None
        )
        for worker, pid in sorted(self.latest.items()):  # the workers come back (or not)
            if data.draw(st.booleans(), label=f"{worker} reconnects"):
                self.hello(data, worker, self.conns[pid].capacity, None)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def credits_never_exceed_the_advertised_slots(self) -> None:
        reserved = Counter(
            (planned.peer, planned.job.execution_mode)
            for batch in self.batches
            for planned in batch
        )
        for pid in self.core.peers:
            conn = self.conns[pid]
            for mode in MODES:
                unseen = sum(
                    1 for seq, (m, _) in conn.sent.items() if m is mode and seq > conn.ready_seen
                )
                assert unseen + reserved[pid, mode] <= conn.ready_slots.get(mode, 0), (
                    f"peer {pid} {mode}: {unseen} sent since its ready + {reserved[pid, mode]} "
                    f"reserved > {conn.ready_slots.get(mode, 0)} slots advertised"
                )

    @invariant()
    def only_worker_connections_are_worker_peers(self) -> None:
        worker = protocol.Role.WORKER
        workers = {p: peer for p, peer in self.core.peers.items() if peer.role is worker}
        assert self.core.worker_peers == workers
        for peer in self.core.peers.values():
            assert peer.role is worker or not peer.leases, "a client holds a lease"

    @invariant()
    def the_lease_index_is_what_the_peers_hold(self) -> None:
        """The core's index of lease holders (what a report, a settle and a cancel look
        up) is exactly the union of its worker connections' held leases."""
        held = {lease: peer for peer in self.core.worker_peers.values() for lease in peer.leases}
        assert dict(self.core.holders.by_lease) == held

    @invariant()
    def every_lease_is_in_exactly_one_place(self) -> None:
        places: Counter[uuid.UUID] = Counter(self.core.claiming.keys())
        assert set(self.core.claiming) == {p.lease for b in self.batches for p in b}
        for peer in self.core.peers.values():
            places.update(peer.leases.keys())
        places.update(self.core.orphans.keys())
        places.update(self.core.parked.keys())
        places.update(self.core.returns.keys())
        doubled = {lease: n for lease, n in places.items() if n > 1}
        assert not doubled, (
            f"leases in more than one place (claims, peers, orphans, parked, returns): {doubled}"
        )
        for job_id, (status, lease) in self.store.items():
            if status is JobStatus.HANDED_OFF:
                assert places[lease] == 1, (
                    f"job {job_id} is handed off under lease {lease}, which no claim, peer, "
                    "orphan, parked entry or return holds: it would never run nor go back"
                )
        for lease, parked in self.core.parked.items():
            assert self.owner[lease] == parked.worker_id, "parked for another worker id"


HandoffMachine.TestCase.settings = settings.get_profile(PROFILE)
TestHandoffMachine = pytest.mark.timeout(900)(HandoffMachine.TestCase)  # for the slow profile


# ---------------------------------------------------------------------- routing by task


def test_a_worker_that_declared_its_tasks_is_planned_only_their_jobs() -> None:
    """Routing by the task catalog: until it declares, a worker runs any task (a worker
    of a release without catalogs); once it has, only those, and the read is told which
    tasks some connected worker runs (none left out while an undeclared one is
    connected). A declaration wakes the dispatcher and unproves what was drained."""
    core = core_with_counter()
    old, new = core.new_peer(1, now=0.0), core.new_peer(2, now=0.0)
    core.hello(old, worker_hello("old"))
    assert core.runnable_tasks() is None and core.unserved(["t", "x"]) == []
    assert core.declared(1, ["t"]) == [WakeDispatcher()]
    assert core.runnable_tasks() == frozenset({"t"})
    assert core.unserved(["x", "t", "x"]) == ["x"]
    core.ready(1, {POOLED: 4}, seen=0)
    x_job = replace(make_job(1), task="x")
    assert core.plan([x_job, make_job(2)], 0.0)[0].job.id == make_job(2).id
    core.hello(new, worker_hello("new"))
    assert core.runnable_tasks() is None, "an undeclared worker runs any task"
    core.declared(2, ["t", "x"])
    core.ready(2, {POOLED: 1}, seen=0)
    assert core.runnable_tasks() == frozenset({"t", "x"}) and core.unserved(["x"]) == []
    [planned] = core.plan([replace(make_job(3), task="x")], 0.0)
    assert planned.peer == 2
    core.disconnect(2, 1.0)
    assert core.unserved(["x"]) == ["x"]
    assert core.declared(2, ["x"]) == [], "a connection that ended declares nothing"
