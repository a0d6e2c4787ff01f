"""The rules of lost attempts and affinity, without I/O: what a lost attempt settles to
(:func:`broker.retry.lost_attempt`), which worker may take a recovery
(:class:`broker.core.affinity.Affinity`), and how the handoff core plans around it."""

from __future__ import annotations

import logging
import math
import uuid
from dataclasses import replace
from datetime import timedelta

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from adapters.memory import MemoryAdapter
from broker import settlement
from broker.core.affinity import Affinity, Route
from broker.core.handoff import Dispatch, Handoff, WakeDispatcher
from broker.jobs import Claim, Job, JobSpec, JobStatus, Outcome
from broker.retry import lost_attempt
from broker.tasks.registry import TaskRegistry, task
from broker.wire import messages as protocol
from tests.unit.test_handoff import EPOCH, POOLED, core_with_counter, make_job, won, worker_hello

GRACE = 60.0
HOLDERS = st.sampled_from(["a", "b", "c"])


def lost_job(recoveries: int = 0, **changes: object) -> Job:
    job = replace(make_job(1), status=JobStatus.HANDED_OFF, worker_id="a", **changes)
    return replace(job, recoveries=recoveries)


# ---------------------------------------------------------------------- lost attempts


@given(
    recoveries=st.integers(0, 10),
    own_cap=st.none() | st.integers(0, 6),
    default_cap=st.integers(0, 6),
    attempts=st.integers(0, 5),
)
def test_a_lost_attempt_counts_a_recovery_never_an_attempt_and_stops_at_its_cap(
    recoveries: int, own_cap: int | None, default_cap: int, attempts: int
) -> None:
    job = replace(lost_job(recoveries, max_recoveries=own_cap), attempts=attempts)
    lease = uuid.uuid4()
    s = lost_attempt(job, lease, "worker connection ended", EPOCH, default_cap)
    cap = default_cap if own_cap is None else own_cap
    assert (s.job_id, s.handoff_id, s.outcome) == (job.id, lease, Outcome.LOST)
    after = settlement.apply(job, settlement.settle(s, EPOCH))
    assert after.recoveries == recoveries + 1 and after.attempts == attempts
    if recoveries + 1 > cap:
        assert after.status is JobStatus.FAILED
        assert after.last_error is not None
        assert after.last_error.startswith(
            f"recovery limit reached: {recoveries + 1} attempts ended by a lost worker"
        )
        assert f"max_recoveries={cap}" in after.last_error
        assert "worker connection ended" in after.last_error
    else:
        assert after.status is JobStatus.QUEUED
        assert after.run_at == EPOCH, "a recovery runs again at once: no backoff"


def test_only_a_local_state_job_names_its_state_holder() -> None:
    plain = lost_attempt(lost_job(), uuid.uuid4(), "lost", EPOCH)
    kept = lost_attempt(lost_job(local_state=True), uuid.uuid4(), "lost", EPOCH)
    assert plain.state_holder is None and kept.state_holder == "a"
    job = settlement.apply(lost_job(local_state=True), settlement.settle(kept, EPOCH))
    assert job.state_holder == "a"
    claim = settlement.hand_off(Claim(job.id, uuid.uuid4(), "b"), EPOCH)
    assert settlement.apply(job, claim).state_holder is None, "a claim clears it"


def test_an_operator_retry_gives_a_dead_job_its_recoveries_back() -> None:
    dead = replace(lost_job(4), status=JobStatus.FAILED)
    assert settlement.apply(dead, settlement.revive(EPOCH)).recoveries == 0


def test_a_task_declares_its_recovery_cap_and_local_state() -> None:
    registry = TaskRegistry()

    @task(registry=registry, max_recoveries=1, local_state=True)
    def crunch() -> None: ...

    spec = crunch.spec()
    assert spec.max_recoveries == 1 and spec.local_state
    assert JobSpec(task="t").max_recoveries is None, "the main's default applies"


# ---------------------------------------------------------------------- affinity rule


@given(
    holder=HOLDERS,
    worker=HOLDERS,
    connected=st.booleans(),
    left=st.floats(0, 1000),
    now=st.floats(0, 2000),
    gone=st.booleans(),
)
def test_a_recovery_goes_only_to_its_holder_until_the_grace_ends_or_the_state_is_gone(
    holder: str, worker: str, connected: bool, left: float, now: float, gone: bool
) -> None:
    affinity = Affinity(GRACE, started=0.0)
    affinity.joined(holder, state_kept=not gone)
    if not connected:
        affinity.left(holder, left)
    job = replace(make_job(1), state_holder=holder)
    route = affinity.route(job, worker, now)
    waiting = connected or now < left + GRACE
    if gone:
        assert route is not None and route.state_lost, "a holder without its state waits none"
    elif worker == holder:
        assert route is not None and not route.state_lost, "the holder itself always may"
    elif waiting:
        assert route is None, "another worker waits while the holder may come back"
    else:
        assert route is not None and route.state_lost, "after the grace: anyone, told"
    assert affinity.route(make_job(1), worker, now) is not None, "no holder: anyone"


def test_a_holder_never_seen_by_this_main_gets_the_grace_from_its_start() -> None:
    affinity = Affinity(GRACE, started=100.0)
    job = replace(make_job(1), state_holder="a")
    assert affinity.route(job, "b", 100.0 + GRACE - 1) is None
    assert affinity.deadline("a") == 100.0 + GRACE
    route = affinity.route(job, "b", 100.0 + GRACE)
    assert route is not None and route.state_lost


def test_the_wait_lasts_while_any_session_of_the_holder_is_connected() -> None:
    affinity = Affinity(GRACE, started=0.0)
    affinity.joined("a")
    affinity.joined("a")  # it reconnected before its old socket was found dead
    affinity.left("a", 10.0)
    assert affinity.deadline("a") == math.inf
    affinity.left("a", 20.0)
    assert affinity.deadline("a") == 20.0 + GRACE


def test_a_new_lost_attempt_on_a_worker_that_had_lost_its_state_waits_again() -> None:
    affinity = Affinity(GRACE, started=0.0)
    affinity.joined("a", state_kept=False)
    job = replace(make_job(1), state_holder="a")
    route = affinity.route(job, "b", 1.0)
    assert route is not None and route.state_lost
    affinity.holds_again("a")
    assert affinity.route(job, "b", 1.0) is None


# ---------------------------------------------------------------------- the core


def two_workers(core: Handoff) -> None:
    for peer_id, worker_id in ((1, "a"), (2, "b")):
        core.hello(core.new_peer(peer_id, now=0.0), worker_hello(worker_id))
        core.ready(peer_id, {POOLED: 2}, seen=0)


def test_the_core_holds_a_recovery_for_its_holder_and_wakes_when_the_grace_ends() -> None:
    core = Handoff(max_credit=10, affinity_grace=GRACE)
    two_workers(core)
    job = replace(make_job(1), state_holder="a")
    [planned] = core.plan([job], 5.0)
    assert planned.worker_id == "a" and not planned.state_lost, "the holder, not the idler"
    core.claim_unknown([planned])
    effects = core.disconnect(1, 10.0)
    assert WakeDispatcher() not in effects, "nothing waited on it yet"
    assert core.plan([job], 11.0) == [], "b is idle, but a may come back"
    assert core.awaiting == {job.id: "a"} and core.wake_at(0.0) == 10.0 + GRACE
    [planned] = core.plan([job], 10.0 + GRACE)
    assert planned.worker_id == "b" and planned.state_lost
    assert core.awaiting == {}
    [dispatched] = [e for e in core.claimed([planned], [won(planned)]) if isinstance(e, Dispatch)]
    assert dispatched.state_lost


def test_a_holder_leaving_wakes_the_dispatcher_for_the_jobs_it_held_back() -> None:
    core = Handoff(max_credit=10, affinity_grace=GRACE)
    two_workers(core)
    core.draining(1)  # connected, but takes nothing: its recovery waits for it
    job = replace(make_job(1), state_holder="a")
    assert core.plan([job], 1.0) == []
    assert core.wake_at(0.0) == 1.0 + GRACE, "the wait's deadline, to extend it"
    assert WakeDispatcher() in core.disconnect(1, 2.0)
    assert core.wake_at(0.0) == 1.0 + GRACE, "the deadline is looked at once more"
    assert core.plan([job], 1.0 + GRACE) == [], "the holder left: no extension"
    assert core.wake_at(0.0) == 2.0 + GRACE, "then the grace after it left decides"


def test_a_worker_back_without_its_state_releases_its_recoveries_at_once() -> None:
    core = Handoff(max_credit=10, affinity_grace=GRACE)
    two_workers(core)
    core.disconnect(1, 1.0)
    hello = replace_hello(worker_hello("a"), local_state_lost=True)
    core.hello(core.new_peer(3, now=2.0), hello)
    core.ready(3, {POOLED: 2}, seen=0)
    job = replace(make_job(1), state_holder="a")
    [planned] = core.plan([job], 2.0)
    assert planned.state_lost, "wherever it runs, the state is gone"


def replace_hello(hello: protocol.Hello, **changes: object) -> protocol.Hello:
    values = {name: getattr(hello, name) for name in hello.__struct_fields__}
    return protocol.Hello(**{**values, **changes})


def test_lost_leases_of_a_disconnect_are_settled_as_recoveries() -> None:
    core = core_with_counter()
    two_workers(core)
    plan = core.plan([make_job(1)], 0.0)
    core.claimed(plan, [won(plan[0])])
    core.disconnect(plan[0].peer, 1.0)
    assert set(core.losses) == {plan[0].lease}
    assert core.losses[plan[0].lease].reason == "worker connection ended"
    core.returned(plan[0].lease, plan[0].job.id)
    assert core.losses == {}


async def test_a_lost_report_settles_through_the_store_as_a_recovery() -> None:
    store = MemoryAdapter()
    [result] = await store.enqueue_many([JobSpec(task="t", max_recoveries=0)])
    [job] = await store.mark_handed_off_many([Claim(result.job.id, lease := uuid.uuid4(), "a")])
    [applied] = await store.settle_many([lost_attempt(job, lease, "child died", job.run_at)])
    stored = await store.get_job(job.id)
    assert applied and stored is not None and stored.status is JobStatus.FAILED
    assert (stored.recoveries, stored.attempts) == (1, 0)
    assert stored.run_at - job.run_at < timedelta(seconds=1)


# ---------------------------------------------------------------------- the cap on a wait


MAX_WAIT = 300.0


def test_a_connected_holder_that_never_frees_a_slot_keeps_its_recovery_up_to_the_maximum(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The pi-dispatch rule: at each deadline the wait is extended (and logged, with its
    reason) while the holder is connected; at the maximum any worker may run the job,
    told its state is gone, and that is logged once."""
    caplog.set_level(logging.INFO, logger="broker.main")
    core = Handoff(max_credit=10, affinity_grace=GRACE, affinity_max_wait=MAX_WAIT)
    two_workers(core)
    core.ready(1, {POOLED: 0}, seen=0)  # the holder stays, but never frees a slot
    job = replace(make_job(1), state_holder="a")
    assert core.plan([job], 0.0) == []
    assert core.wake_at(0.0) == GRACE
    for step in range(1, 5):
        assert core.plan([job], step * GRACE) == [], "extended: the holder is connected"
        assert core.wake_at(0.0) == (step + 1) * GRACE
    assert core.plan([job], MAX_WAIT - 1) == []
    [planned] = core.plan([job], MAX_WAIT)
    assert planned.worker_id == "b" and planned.state_lost
    assert core.awaiting == {} and core.affinity.waits == {}
    extended = [r for r in caplog.records if r.getMessage().startswith("recovery wait extended")]
    assert len(extended) == 4
    assert all("reason=holder connected" in r.getMessage() for r in extended)
    released = [r for r in caplog.records if "maximum wait" in r.getMessage()]
    assert len(released) == 1 and "holder=a" in released[0].getMessage()


def test_a_paused_queue_extends_a_wait_its_holder_left_up_to_the_maximum() -> None:
    """A holder gone past its grace releases its recovery, unless the job's queue is
    paused (an input of the core): then the wait is extended, up to the maximum."""
    affinity = Affinity(GRACE, started=0.0, max_wait=MAX_WAIT)
    job = replace(make_job(1), state_holder="a")
    affinity.joined("a")
    affinity.left("a", 0.0)
    assert affinity.route(job, "b", 1.0, queue_paused=True) is None
    assert affinity.route(job, "b", GRACE + 1, queue_paused=True) is None, "paused: extended"
    assert affinity.route(job, "b", GRACE + 1) == Route(state_lost=True), "not paused: over"
    assert affinity.route(job, "b", MAX_WAIT + 1, queue_paused=True) == Route(state_lost=True)


events_ = st.lists(
    st.tuples(
        st.floats(0.0, 200.0),  # time passing
        st.sampled_from(["join", "leave", "pause", "resume", "look"]),
    ),
    max_size=40,
)


@example(
    events=[(108.93093381093608, "join"), (19.749300522181017, "join")],
    grace=0.0,
    max_wait=19.749300522181017,
)
@given(events_, st.floats(0.0, 120.0), st.floats(1.0, 600.0))
def test_a_recovery_never_waits_past_the_maximum_nor_leaves_a_connected_holder_before(
    events: list[tuple[float, str]], grace: float, max_wait: float
) -> None:
    """Whatever the holder and the queue do: once a wait has lasted ``max_wait``, any
    worker may take the job (told its state is gone); before that, while the holder is
    connected or the queue paused, no other worker may; and the next look the core asks
    for (its wake) never lies in the past."""
    affinity = Affinity(grace, started=0.0, max_wait=max_wait)
    job = replace(make_job(1), state_holder="a")
    affinity.joined("a")
    now, paused, began = 0.0, False, None
    for elapsed, event in events:
        now += elapsed
        if event == "join":
            affinity.joined("a")
        elif event == "leave" and affinity.sessions["a"] > 0:
            affinity.left("a", now)
        paused = {"pause": True, "resume": False}.get(event, paused)
        route = affinity.route(job, "b", now, queue_paused=paused)
        began = now if began is None else began
        if began + max_wait <= now:  # as the core adds it: ``now - began`` rounds apart
            assert route == Route(state_lost=True)
        elif affinity.sessions["a"] > 0 or paused:
            assert route is None
        assert affinity.wake_at(job.id, "a", {job.execution_mode}) >= now or route is not None
