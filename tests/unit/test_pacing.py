"""The dispatcher's pacing rules (:mod:`broker.core.pacing`) on a fake clock: when it
listens to the store, pauses, polls or reads a second time, when a next run time it read
may be used again, how long it sleeps idle, and the read-ahead that serves passes between
reads of the store. No event loop, no store."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from broker.core import pacing
from broker.core.handoff import PlannedClaim
from broker.core.pacing import READ_AHEAD_MAX_AGE, Pacing, ReadAhead
from broker.jobs import (
    DispatchKey,
    EnqueueResult,
    ExecutionMode,
    Job,
    JobSpec,
    dispatch_key,
    new_job_fields,
    utcnow,
)

POOLED, INLINE = ExecutionMode.POOLED, ExecutionMode.INLINE
WALL = datetime(2030, 1, 1, tzinfo=UTC)
LINGER = pacing.LISTEN_LINGER


class FakeClocks:
    """The loop's clock (seconds) and the wall clock, moved together by the test."""

    def __init__(self) -> None:
        self.t = 100.0

    def now(self) -> float:
        return self.t

    def wall(self) -> datetime:
        return WALL + timedelta(seconds=self.t)

    def pacing(self, poll: float = 1.0, fallback: float = 30.0, retry: float = 0.5) -> Pacing:
        return Pacing(
            now=self.now,
            clock=self.wall,
            poll_interval=poll,
            notify_fallback_interval=fallback,
            retry_interval=retry,
        )


def test_the_dispatcher_listens_only_while_credit_exists_and_lingers_after() -> None:
    """A notification helps only a main that can hand the job off; slots freed and spent
    again within the linger keep the notifications on (a busy drain never stops
    listening)."""
    clocks = FakeClocks()
    rules = clocks.pacing()
    assert not rules.listen(0)  # no worker: nobody to wake
    assert rules.listen(2)
    rules.listened()
    assert not rules.stop_listening(1)
    clocks.t += LINGER - 0.1
    assert not rules.stop_listening(0), "within the linger of the last free slot"
    clocks.t += 0.1
    assert rules.stop_listening(0)
    rules.stopped_listening()
    assert not rules.listening


def test_a_nudge_while_listening_is_only_noted_and_keeps_the_listener_on() -> None:
    clocks = FakeClocks()
    rules = clocks.pacing()
    assert rules.nudged(), "not listening: the listener looks at the credit now"
    assert rules.listen(1)
    rules.listened()
    clocks.t += LINGER - 0.1
    assert not rules.nudged(), "listening: no wake-up for the listener"
    clocks.t += LINGER - 0.1
    assert not rules.stop_listening(0), "the nudge counts as credit seen"
    clocks.t += 0.1
    assert rules.stop_listening(0)


def test_without_notifications_a_pass_polls_every_poll_interval() -> None:
    """Another process's insert is found only by looking: a pass counts as a queue change
    at least every ``poll_interval``, however often passes run; never while listening."""
    clocks = FakeClocks()
    rules = clocks.pacing(poll=1.0)
    assert rules.poll_due()
    clocks.t += 0.5
    assert not rules.poll_due()
    clocks.t += 0.5
    assert rules.poll_due()
    assert not rules.poll_due(), "counted once per interval"
    rules.listened()
    clocks.t += 5
    assert not rules.poll_due()
    rules.stopped_listening()
    assert rules.poll_due()


def test_passes_pause_for_the_retry_interval_after_a_claim_raised() -> None:
    clocks = FakeClocks()
    rules = clocks.pacing(retry=0.5)
    assert rules.pause() == 0.0
    rules.claim_failed()
    clocks.t += 0.2
    assert abs(rules.pause() - 0.3) < 1e-9
    assert rules.pause() == 0.0, "one pause per failure"
    rules.claim_failed()
    clocks.t += 0.6
    assert rules.pause() == 0.0, "passed already"
    clocks.t += 0.1
    rules.claim_failed()
    assert rules.pause() == 0.5, "a later failure pauses again"


def test_a_wake_is_worth_a_pass_only_with_a_free_slot() -> None:
    assert Pacing.worth_a_pass(1)
    assert not Pacing.worth_a_pass(0)


def test_a_second_read_only_for_modes_left_when_the_first_read_filled() -> None:
    """One mode's backlog filled the read (every job read was placed, or held back for its
    state holder), while other modes still have credit: read again for those."""
    left = {INLINE}
    assert Pacing.read_again(left, read=4, planned=3, held=0)
    assert Pacing.read_again(left, read=5, planned=3, held=1)
    assert not Pacing.read_again(left, read=4, planned=4, held=0), "all placed"
    assert not Pacing.read_again(left, read=4, planned=3, held=1), "the rest held back"
    assert not Pacing.read_again(set(), read=4, planned=1, held=0), "no mode left"


def test_a_next_run_time_read_is_used_again_only_while_nothing_changed() -> None:
    """Each read scanned every queued row on PostgreSQL. It holds while the notifications
    are live (any insert then wakes the dispatcher and counts as a change), for the
    change count, modes and queues it was read for, and while it is still ahead."""
    clocks = FakeClocks()
    rules = clocks.pacing()
    later = clocks.wall() + timedelta(seconds=10)
    rules.next_run_read({POOLED}, None, 3, later)
    assert rules.known_next_run({POOLED}, None, 3) is None, "not listening"
    rules.listened()
    known = rules.known_next_run({POOLED}, None, 3)
    assert known is not None and known.at == later
    assert rules.known_next_run({POOLED}, None, 4) is None, "a change since"
    assert rules.known_next_run({POOLED, INLINE}, None, 3) is None, "other modes"
    assert rules.known_next_run({POOLED}, {"q"}, 3) is None, "other queues"
    clocks.t += 10
    assert rules.known_next_run({POOLED}, None, 3) is None, "due now"
    rules.next_run_read({POOLED}, {"q"}, 3, None)
    known = rules.known_next_run({POOLED}, {"q"}, 3)
    assert known is not None and known.at is None, "nothing scheduled holds too"


def test_the_idle_timeout() -> None:
    clocks = FakeClocks()
    rules = clocks.pacing(poll=1.0, fallback=30.0)
    soon = clocks.wall() + timedelta(seconds=0.25)
    far = clocks.wall() + timedelta(hours=1)
    # Until the next scheduled job, capped by the poll or the fallback interval.
    assert rules.idle_timeout(soon, polling=True, affinity_wake=None) == 0.25
    assert rules.idle_timeout(far, polling=True, affinity_wake=None) == 1.0
    assert rules.idle_timeout(far, polling=False, affinity_wake=None) == 30.0
    # Nothing scheduled, or due jobs that could not go out: the ceiling, never zero (a
    # report or a ready wakes the dispatcher; a timer of zero would spin).
    assert rules.idle_timeout(None, polling=False, affinity_wake=None) == 30.0
    past = clocks.wall() - timedelta(seconds=5)
    assert rules.idle_timeout(past, polling=True, affinity_wake=None) == 1.0
    # A held-back job's grace ending caps it (not below zero once passed).
    assert rules.idle_timeout(None, polling=False, affinity_wake=clocks.t + 2) == 2.0
    assert rules.idle_timeout(soon, polling=False, affinity_wake=clocks.t + 2) == 0.25
    assert rules.idle_timeout(far, polling=False, affinity_wake=clocks.t - 1) == 0.0


def test_a_failed_read_of_the_next_run_time_sleeps_the_retry_interval() -> None:
    assert FakeClocks().pacing(retry=0.5).after_failed_read() == 0.5


def _job(mode: ExecutionMode = POOLED, key: str | None = None) -> Job:
    spec = JobSpec(
        task="t",
        execution_mode=mode,
        concurrency_key=key,
        concurrency_limit=None if key is None else 1,
    )
    return Job.from_spec(spec, utcnow())


def test_the_read_ahead_serves_only_while_its_read_holds() -> None:
    ahead = ReadAhead()
    jobs = [_job() for _ in range(6)]
    assert ahead.serve({POOLED}, None, 2, 0, 0.0) is None  # nothing read yet
    ahead.fill(jobs, {POOLED}, None, 6, started=0, now=0.0)
    assert ahead.serve({POOLED}, None, 2, 0, 0.0) == (jobs[:2], True)
    ahead.planned([PlannedClaim(1, "w", job, uuid.uuid4()) for job in jobs[:2]])
    assert ahead.serve({POOLED}, None, 2, 0, 0.01) == (jobs[2:4], True)
    # Not for another change count, other queues, a mode it was not read for, or too late.
    assert ahead.serve({POOLED}, None, 2, 1, 0.01) is None
    assert ahead.serve({POOLED}, {"q"}, 2, 0, 0.01) is None
    assert ahead.serve({POOLED, ExecutionMode.INLINE}, None, 2, 0, 0.01) is None
    assert ahead.serve({POOLED}, None, 2, 0, READ_AHEAD_MAX_AGE + 0.01) is None
    # Fewer held than asked for: only when the read was all there is.
    assert ahead.serve({POOLED}, None, 5, 0, 0.01) is None
    ahead.fill(jobs[:3], {POOLED}, None, 6, started=0, now=0.0)
    assert ahead.serve({POOLED}, None, 5, 0, 0.01) == (jobs[:3], False)


def test_the_read_ahead_grows_only_while_nothing_changes() -> None:
    ahead = ReadAhead()
    assert ahead.read_size({POOLED}, None, 3, 0, batch=100, now=0.0) == 3
    jobs = [_job() for _ in range(3)]
    ahead.fill(jobs, {POOLED}, None, 3, started=0, now=0.0)
    ahead.planned([PlannedClaim(1, "w", job, uuid.uuid4()) for job in jobs])  # it ran out
    late = READ_AHEAD_MAX_AGE + 0.01  # its age does not matter once it ran out
    assert ahead.read_size({POOLED}, None, 3, 0, batch=100, now=late) == 6
    assert ahead.read_size({POOLED}, None, 3, 0, batch=4, now=late) == 4
    assert ahead.read_size({POOLED}, None, 3, 1, batch=100, now=late) == 3  # a change
    assert ahead.read_size({POOLED}, {"q"}, 3, 0, batch=100, now=late) == 3


def test_a_read_that_grew_old_with_jobs_left_is_followed_by_one_of_what_it_served() -> None:
    """Slow jobs free slots a few at a time: a read that ages out mostly unused must not
    be followed by one twice its size (each would be read and decoded for nothing)."""
    ahead = ReadAhead()
    jobs = [_job() for _ in range(40)]
    ahead.fill(jobs, {POOLED}, None, 40, started=0, now=0.0)
    for taken in (jobs[:2], jobs[2:5]):
        served = ahead.serve({POOLED}, None, len(taken), 0, 0.01)
        assert served == (taken, True)
        ahead.planned([PlannedClaim(1, "w", job, uuid.uuid4()) for job in taken])
    late = READ_AHEAD_MAX_AGE + 0.01
    assert ahead.serve({POOLED}, None, 2, 0, late) is None  # too old to serve
    assert ahead.read_size({POOLED}, None, 2, 0, batch=100, now=late) == 5
    assert ahead.read_size({POOLED}, None, 8, 0, batch=100, now=late) == 8  # a pass's need
    # Still young, it would be doubled only once it ran out (fewer left than a pass needs).
    assert ahead.read_size({POOLED}, None, 36, 0, batch=100, now=0.02) == 80


def test_a_read_holding_a_keyed_job_serves_one_pass_only() -> None:
    """The store leaves out the jobs whose key is full when it reads, and claims fill
    keys: a keyed job must not be planned from a read older than its pass."""
    ahead = ReadAhead()
    jobs = [_job(), _job(key="k"), _job()]
    ahead.fill(jobs, {POOLED}, None, 3, started=0, now=0.0)
    assert ahead.serve({POOLED}, None, 1, 0, 0.0) == (jobs[:1], True)
    assert ahead.serve({POOLED}, None, 1, 0, 0.0) is None
    assert ahead.read_size({POOLED}, None, 1, 0, batch=100, now=0.0) == 1


def _enqueued(
    priority: int = 0, mode: ExecutionMode = POOLED, key: str | None = None
) -> EnqueueResult:
    """The result of the main's enqueue of one job, created now."""
    spec = JobSpec(
        task="t",
        priority=priority,
        execution_mode=mode,
        concurrency_key=key,
        concurrency_limit=None if key is None else 1,
    )
    return EnqueueResult.inserted(new_job_fields(spec, utcnow()))


def test_the_read_ahead_outlives_an_insert_only_of_jobs_that_stand_after_it() -> None:
    ahead = ReadAhead()
    jobs = [_job() for _ in range(4)]
    ahead.fill(jobs, {POOLED}, None, 6, started=0, now=0.0)
    assert ahead.serve({POOLED}, None, 5, 0, 0.0) == (jobs, False)  # all there is
    ahead.inserted(0, 1, [_enqueued()])
    assert ahead.serve({POOLED}, None, 2, 1, 0.0) == (jobs[:2], True)
    # It no longer holds every job: fewer held than asked for means a read.
    assert ahead.serve({POOLED}, None, 5, 1, 0.0) is None
    # A job of a mode it was not read for stands before nothing it holds.
    ahead.inserted(1, 2, [_enqueued(priority=9, mode=ExecutionMode.INLINE)])
    assert ahead.serve({POOLED}, None, 1, 2, 0.0) == (jobs[:1], True)


def test_a_job_enqueued_before_the_read_ahead_takes_its_place_in_it() -> None:
    """Issue 35: an urgent job enqueued during a drain keeps the read current, first in
    it, so the job after it may still be handed off at its enqueue (see
    ``ReadAhead.leads``)."""
    jobs = [_job() for _ in range(4)]
    ahead = ReadAhead()
    ahead.fill(jobs, {POOLED}, None, 4, started=0, now=0.0)
    urgent = _enqueued(priority=5)
    assert ahead.inserted(0, 1, [urgent]) == 1
    assert ahead.serve({POOLED}, None, 2, 1, 0.0) == ([urgent.job, jobs[0]], True)


def test_a_job_that_ties_where_the_read_ended_or_has_a_key_retires_it() -> None:
    jobs = [_job() for _ in range(4)]
    tie = EnqueueResult(jobs[-1], duplicate=False)  # where the read ended: the store decides
    for added in ([_enqueued(), tie], [_enqueued(priority=5, key="k")]):
        ahead = ReadAhead()
        ahead.fill(jobs, {POOLED}, None, 4, started=0, now=0.0)
        assert ahead.inserted(0, 1, added) == 1
        assert ahead.serve({POOLED}, None, 1, 1, 0.0) is None
    # Nor a burst past twice what the read asked for (no pass takes from it meanwhile).
    ahead = ReadAhead()
    ahead.fill(jobs[:2], {POOLED}, None, 2, started=0, now=0.0)
    assert ahead.inserted(0, 1, [_enqueued(priority=5) for _ in range(2)]) == 2
    assert ahead.inserted(1, 2, [_enqueued(priority=5)]) == 1
    assert ahead.serve({POOLED}, None, 1, 2, 0.0) is None
    # Nor does an insert bring a read that was already out of date back.
    ahead = ReadAhead()
    ahead.fill(jobs, {POOLED}, None, 4, started=0, now=0.0)
    ahead.inserted(1, 2, [_enqueued()])
    assert ahead.serve({POOLED}, None, 1, 2, 0.0) is None


def _key(result: EnqueueResult) -> DispatchKey:
    job = result.job
    return dispatch_key(job.priority, job.run_at, job.created_at)


def test_a_job_leads_only_before_every_job_still_waiting_of_its_mode() -> None:
    """``ReadAhead.leads``: what an enqueue may hand off at once during a drain."""
    jobs = [_job() for _ in range(4)]
    ahead = ReadAhead()
    urgent, later = _key(_enqueued(priority=5)), _key(_enqueued())
    assert not ahead.leads(POOLED, "default", urgent, 0, 0.0), "nothing read yet"
    ahead.fill(jobs, {POOLED}, {"default"}, 4, started=0, now=0.0)
    assert ahead.leads(POOLED, "default", urgent, 0, 0.0)
    assert not ahead.leads(POOLED, "default", later, 0, 0.0), "the backlog goes first"
    assert not ahead.leads(INLINE, "default", urgent, 0, 0.0), "a mode not read"
    assert not ahead.leads(POOLED, "other", urgent, 0, 0.0), "a queue not read"
    assert not ahead.leads(POOLED, "default", urgent, 1, 0.0), "something changed"
    assert not ahead.leads(POOLED, "default", urgent, 0, READ_AHEAD_MAX_AGE + 0.01)
    # Its first job is the store's best one waiting: one queued before the urgent one wins.
    first = _enqueued(priority=9)
    ahead.inserted(0, 1, [first])
    assert not ahead.leads(POOLED, "default", urgent, 1, 0.0)
    ahead.planned([PlannedClaim(1, "w", first.job, uuid.uuid4())])  # being claimed
    assert ahead.leads(POOLED, "default", urgent, 1, 0.0)
    # All planned: before where the read ended, or anything if it held every job.
    ahead.planned([PlannedClaim(1, "w", job, uuid.uuid4()) for job in jobs])
    assert not ahead.leads(POOLED, "default", later, 1, 0.0), "the read left some out"
    assert ahead.leads(POOLED, "default", urgent, 1, 0.0)
    ahead.fill(jobs[:2], {POOLED}, {"default"}, 4, started=1, now=0.0)
    ahead.planned([PlannedClaim(1, "w", job, uuid.uuid4()) for job in jobs[:2]])
    assert ahead.leads(POOLED, "default", later, 1, 0.0), "it held every job"


def test_an_insert_says_how_many_of_its_jobs_overtake_the_read_ahead() -> None:
    """Issue 35: jobs enqueued before what the read-ahead holds are counted for an
    express pass; jobs after it are not, and a read already out of date counts none."""
    jobs = [_job() for _ in range(4)]
    ahead = ReadAhead()
    ahead.fill(jobs, {POOLED}, None, 4, started=0, now=0.0)
    assert ahead.inserted(0, 1, [_enqueued()]) == 0
    assert ahead.inserted(1, 2, [_enqueued(priority=5), _enqueued(), _enqueued(priority=9)]) == 2
    assert ahead.inserted(2, 3, [_enqueued(priority=9)]) == 1, "the last kept it current"
    assert ahead.inserted(5, 6, [_enqueued(priority=9)]) == 0, "out of date"


def test_an_express_pass_goes_one_claim_beyond_the_cap_and_no_further() -> None:
    assert Pacing.express(0, claims=0, cap=2) == 0, "nothing overtakes: an ordinary pass"
    assert Pacing.express(3, claims=0, cap=2) == 3
    assert Pacing.express(1, claims=2, cap=2) == 1, "at the cap: one claim more"
    assert Pacing.express(1, claims=3, cap=2) == 0


STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("read"), st.integers(1, 6)),
        st.tuples(st.just("insert"), st.sampled_from([-1, 0, 0, 5])),
        st.tuples(st.just("serve"), st.integers(1, 4)),
        st.tuples(st.just("enqueue"), st.sampled_from([0, 5, 9])),
    ),
    max_size=40,
)


@given(STEPS)
def test_the_read_ahead_only_ever_serves_the_stores_best_jobs(steps: list[tuple[str, int]]) -> None:
    """The priority rule on the main's side (issue 35): across any interleaving of reads,
    the main's own enqueues (of any priority) and passes, what the read-ahead serves is
    always the best jobs the store holds, in dispatch order, so a job enqueued with a
    higher priority is never passed over for one read before it; and a job it says
    leads (which the enqueue hands off at once, never stored queued) stands before every
    job the store holds."""
    store: list[Job] = []
    changes = 0
    ahead = ReadAhead()
    clock = iter(range(1, 10_000))

    def new_job(priority: int) -> Job:
        at = WALL + timedelta(seconds=next(clock))
        return Job.from_spec(JobSpec(task="t", priority=priority), at)

    def order(job: Job) -> DispatchKey:
        return dispatch_key(job.priority, job.run_at, job.created_at)

    for _ in range(5):
        store.append(new_job(0))
    for step, value in steps:
        best = sorted(store, key=order)
        if step == "read":
            ahead.fill(best[:value], {POOLED}, None, value, started=changes, now=0.0)
        elif step == "enqueue":
            job = new_job(value)
            if ahead.leads(POOLED, job.queue, order(job), changes, 0.0):
                assert all(order(job) < order(other) for other in store), "overtook one"
            else:
                store.append(job)
                changes += 1
                ahead.inserted(changes - 1, changes, [EnqueueResult(job, duplicate=False)])
        elif step == "insert":
            job = new_job(value)
            store.append(job)
            changes += 1
            ahead.inserted(changes - 1, changes, [EnqueueResult(job, duplicate=False)])
        else:
            served = ahead.serve({POOLED}, None, value, changes, 0.0)
            if served is None:
                continue
            jobs, _full = served
            assert jobs == best[: len(jobs)], "served past a better job in the store"
            ahead.planned(
                [PlannedClaim(1, "w", job, uuid.uuid4(), state_lost=False) for job in jobs]
            )
            store = [job for job in store if job not in jobs]
