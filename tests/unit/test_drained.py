"""When an enqueue may hand its job off at once (broker/core/drained.py and
:meth:`broker.core.handoff.Handoff.plan_at_enqueue`): only for a mode the dispatcher proved
drained, in the queues its reads covered, with nothing changed since, for a job that is
due, has no concurrency key and finds a free slot. Pure: no store, no socket."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.core.handoff import Handoff, PlannedClaim
from broker.jobs import DispatchKey, ExecutionMode, JobSpec, dispatch_key
from broker.storage import QueueSettings
from broker.wire import messages as protocol
from tests.unit.conftest import PROFILE

POOLED = ExecutionMode.POOLED


def _worker_joins(
    core: Handoff, peer_id: int, worker_id: str, slots: int, queues: list[str] | None = None
) -> None:
    """A worker connects, says hello (pooled and forked, serving ``queues``) and offers
    ``slots`` pooled slots."""
    core.hello(
        core.new_peer(peer_id, 0.0),
        protocol.Hello(
            role=protocol.Role.WORKER,
            protocol=protocol.PROTOCOL_VERSION,
            worker_id=worker_id,
            modes=[POOLED, ExecutionMode.FORKED],
            queues=queues,
        ),
    )
    core.ready(peer_id, {POOLED: slots}, seen=0)


def _core_with_idle_worker(slots: int = 2) -> Handoff:
    core = Handoff()
    _worker_joins(core, 1, "w", slots)
    return core


NOW = datetime(2030, 1, 1, tzinfo=UTC)


def test_only_a_drained_mode_takes_jobs_at_enqueue() -> None:
    core = _core_with_idle_worker()
    spec = JobSpec(task="t")
    assert core.plan_at_enqueue([spec], NOW) == [None]  # nothing read yet
    started = core.queue_changes
    core.read_eligible(started, [POOLED], full=True, queues=None)  # more may wait
    assert core.plan_at_enqueue([spec], NOW) == [None]
    core.read_eligible(started, [POOLED], full=False, queues=None)
    [planned] = core.plan_at_enqueue([spec], NOW)
    assert planned is not None and planned.job.id == spec.id and planned.worker_id == "w"
    assert core.credit(POOLED) == 1  # reserved before the insert


def test_a_change_during_the_read_means_nothing_is_known_drained() -> None:
    core = _core_with_idle_worker()
    started = core.queue_changes
    core.queue_changed()  # say a lease came back while the read was out
    core.read_eligible(started, [POOLED], full=False, queues=None)
    assert core.plan_at_enqueue([JobSpec(task="t")], NOW) == [None]


def test_a_drained_proof_holds_only_for_the_queues_its_reads_covered() -> None:
    """A read while the only worker serving every queue was paused covered queue ``a``
    alone: once that worker is dispatchable again, a pooled job in queue ``b`` may be
    waiting for it, so an enqueue must not take its slot at once (found by the handoff
    state machine's long profile)."""
    core = _core_with_idle_worker()
    _worker_joins(core, 2, "w-a", 1, queues=["a"])
    wide = core.peers[1].liveness
    wide.paused_since = 0.0  # over its outbox cap: not dispatchable
    assert core.served_queues() == {"a"}
    core.read_eligible(core.queue_changes, [POOLED], full=False, queues=core.served_queues())
    assert core.plan_at_enqueue([JobSpec(task="t", queue="a")], NOW) != [None]
    wide.paused_since = None
    assert core.plan_at_enqueue([JobSpec(task="t", queue="a")], NOW) == [None]
    core.read_eligible(core.queue_changes, [POOLED], full=False, queues=core.served_queues())
    assert core.plan_at_enqueue([JobSpec(task="t", queue="b")], NOW) != [None]


def test_jobs_not_due_with_a_concurrency_key_or_without_a_free_slot_wait() -> None:
    core = _core_with_idle_worker(slots=1)
    core.read_eligible(core.queue_changes, [POOLED, ExecutionMode.FORKED], full=False, queues=None)
    later = JobSpec(task="t", run_at=NOW + timedelta(seconds=5))
    keyed = JobSpec(task="t", concurrency_key="k", concurrency_limit=1)
    forked = JobSpec(task="t", execution_mode=ExecutionMode.FORKED)  # no forked slot
    first, second = JobSpec(task="t"), JobSpec(task="t")
    plans = core.plan_at_enqueue([later, keyed, forked, first, second], NOW)
    assert [p is not None for p in plans] == [False, False, False, True, False]
    assert plans[3] is not None and plans[3].job.id == first.id
    assert isinstance(plans[3].lease, uuid.UUID)


def test_during_a_drain_a_job_that_leads_takes_a_free_slot_at_enqueue() -> None:
    """Issue 35: no mode is drained while a backlog drains, but a job that stands before
    every job still waiting of its mode (``leads``, the read-ahead's word) may go at
    once all the same, on the same terms: due, no key, a free slot, no queue settings."""
    core = _core_with_idle_worker(slots=2)
    asked: list[tuple[ExecutionMode, str, DispatchKey]] = []

    def leads(mode: ExecutionMode, queue: str, key: DispatchKey) -> bool:
        asked.append((mode, queue, key))
        return key[0] < 0  # a priority above the backlog's 0

    backlog, urgent = JobSpec(task="t"), JobSpec(task="t", priority=10, queue="q")
    later = JobSpec(task="t", priority=10, run_at=NOW + timedelta(seconds=5))
    plans = core.plan_at_enqueue([backlog, later, urgent], NOW, leads)
    assert [p is not None for p in plans] == [False, False, True]
    assert (POOLED, "q", dispatch_key(10, NOW, NOW)) in asked
    assert core.credit(POOLED) == 1, "its slot reserved before the insert"
    core.flow.apply(QueueSettings("q", paused=True))
    assert core.plan_at_enqueue([urgent], NOW, leads) == [None], "a queue with settings"
    assert core.plan_at_enqueue([JobSpec(task="t", priority=10)], NOW, leads) != [None]
    assert core.plan_at_enqueue([JobSpec(task="t", priority=10)], NOW, leads) == [None]


@settings(settings.get_profile(PROFILE))
@given(
    st.lists(st.tuples(st.integers(0, 3), st.sampled_from([None, ["a"], ["b"]])), max_size=8),
    st.lists(
        st.tuples(st.sampled_from([POOLED, ExecutionMode.FORKED]), st.sampled_from("ab")),
        max_size=12,
    ),
)
def test_an_enqueue_of_many_places_them_as_one_at_a_time_would(
    workers: list[tuple[int, list[str] | None]], jobs: list[tuple[ExecutionMode, str]]
) -> None:
    """A batch enqueue plans its jobs in one plan: each goes to the worker, and gets the
    lease, it would have got enqueued alone, one after the other."""
    specs = [JobSpec(task="t", queue=queue, execution_mode=mode) for mode, queue in jobs]
    cores = []
    for _ in range(2):
        numbers = iter(range(1, 1000))
        core = Handoff(new_lease=lambda numbers=numbers: uuid.UUID(int=next(numbers)))
        for pid, (slots, queues) in enumerate(workers, start=1):
            _worker_joins(core, pid, f"w{pid}", slots, queues)
            core.ready(pid, {POOLED: slots, ExecutionMode.FORKED: slots // 2}, seen=0)
        core.read_eligible(
            core.queue_changes, [POOLED, ExecutionMode.FORKED], full=False, queues=None
        )
        cores.append(core)
    together = cores[0].plan_at_enqueue(specs, NOW)
    alone = [planned for spec in specs for planned in cores[1].plan_at_enqueue([spec], NOW)]

    def placed(plans: list[PlannedClaim | None]) -> list[tuple[int, uuid.UUID, uuid.UUID] | None]:
        return [None if p is None else (p.peer, p.lease, p.job.id) for p in plans]

    assert placed(together) == placed(alone)
