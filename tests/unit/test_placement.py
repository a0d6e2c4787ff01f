"""Which worker a plan picks (:mod:`broker.core.placement`): the ranking a plan keeps picks
exactly what asking every worker for its credit, job by job, picked."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.core import placement as placement_module
from broker.core.affinity import Affinity, Route
from broker.core.peers import Credits, Liveness, Peer
from broker.core.placement import Placement
from broker.jobs import ExecutionMode, Job, JobSpec
from broker.wire import messages as protocol
from tests.unit.conftest import PROFILE

MODES = [ExecutionMode.POOLED, ExecutionMode.FORKED]
NOW = datetime(2026, 1, 1, tzinfo=UTC)

workers_ = st.lists(
    st.tuples(
        st.fixed_dictionaries({mode: st.integers(0, 4) for mode in MODES}),
        st.sampled_from([None, frozenset("a"), frozenset("b"), frozenset("ab")]),
        st.sampled_from(["w1", "w2", "w3"]),
        st.sampled_from([None, frozenset("x"), frozenset("y"), frozenset("xy"), frozenset()]),
    ),
    min_size=0,
    max_size=8,
)
jobs_ = st.lists(
    st.tuples(
        st.sampled_from(MODES),
        st.sampled_from("abc"),
        st.sampled_from([None, None, "w1", "w2", "w4"]),  # the state holder, if any
        st.sampled_from("xyz"),  # the task
    ),
    max_size=30,
)
Workers = list[tuple[dict[ExecutionMode, int], frozenset[str] | None, str, frozenset[str] | None]]
Jobs = list[tuple[ExecutionMode, str, str | None, str]]


def _peers(workers: Workers) -> list[Peer]:
    peers = []
    for pid, (slots, queues, worker_id, tasks) in enumerate(workers, start=1):
        peer = Peer(pid, Liveness(0.0, 0), Credits(10), protocol.Role.WORKER, worker_id)
        peer.queues = queues
        peer.tasks = tasks
        peer.credits.on_ready(slots, 0)
        peers.append(peer)
    return peers


def _affinity() -> Affinity:
    """w1 and w2 are connected (w2 without its state); w4 left, its grace not over."""
    affinity = Affinity(60.0, started=0.0)
    affinity.joined("w1")
    affinity.joined("w2", state_kept=False)
    affinity.joined("w4")
    affinity.left("w4", 0.0)
    return affinity


def _reference_pick(
    affinity: Affinity, workers: list[Peer], job: Job, turn: int
) -> tuple[Peer | None, Route | None]:
    """:meth:`Placement.pick` as it was: every worker asked for every job."""
    holder = job.state_holder
    if holder is None:
        return _reference(workers, job, turn), None
    route = affinity.route(job, holder, 1.0)
    own = [peer for peer in workers if peer.worker_id == holder and peer.serves(job)]
    if own and route is not None and not route.state_lost:
        return _reference(own, job, turn), route
    elsewhere = affinity.route(job, "", 1.0)
    if elsewhere is None:
        return None, None
    return _reference(workers, job, turn), elsewhere


def _reference(workers: list[Peer], job: Job, turn: int) -> Peer | None:
    """The most free as it was: every worker asked, in the rotation from ``turn``."""
    best: Peer | None = None
    best_free = -1
    for i in range(len(workers)):
        peer = workers[(turn + i) % len(workers)]
        free = peer.credits.available(job.execution_mode)
        if free > best_free and peer.serves(job):
            best, best_free = peer, free
    return best


@settings(settings.get_profile(PROFILE))
@given(workers_, jobs_, st.integers(0, 3), st.sampled_from([0, placement_module.FEW]))
def test_a_plan_picks_the_worker_every_worker_asked_would_pick(
    workers: Workers, jobs: Jobs, plans: int, few: int
) -> None:
    """The most free serving worker (its queue and its task), ties going round in turns,
    a state holder's own connections first while they may take its job, through several
    plans (each ranking afresh) and the reservations each makes; with the ranking for
    any number of workers (``few`` 0) too."""
    with mock.patch.object(placement_module, "FEW", few):
        _plans(workers, jobs, plans)


def _plans(workers: Workers, jobs: Jobs, plans: int) -> None:
    mine, theirs = _peers(workers), _peers(workers)
    placement = Placement(60.0)
    placement.affinity = _affinity()
    affinity = _affinity()
    turn = 0
    for start in range(plans + 1):
        placement.start(mine)
        for mode, queue, holder, task in jobs[start::2]:
            spec = JobSpec(task=task, queue=queue, execution_mode=mode)
            job = replace(Job.from_spec(spec, NOW), local_state=True, state_holder=holder)
            turn += 1
            expected, expected_route = _reference_pick(affinity, theirs, job, turn)
            got, route = placement.pick(job, 1.0)
            assert route == expected_route
            assert (got.id if got else None) == (expected.id if expected else None)
            if got is not None and expected is not None and got.credits.reserve(mode):
                assert expected.credits.reserve(mode)
                placement.reserved(got, mode)


@settings(settings.get_profile(PROFILE))
@given(workers_, jobs_, st.sampled_from([0, placement_module.FEW]))
def test_a_job_is_never_handed_to_a_worker_without_its_task(
    workers: Workers, jobs: Jobs, few: int
) -> None:
    """Routing by the task catalog: whatever the credits, queues, state holders and
    rankings, a worker that declared its tasks is picked only for a job of one of them
    (a worker that declared none runs any); and a job some free worker serving its queue
    declared is placed (it never waits for a worker that cannot run it)."""
    with mock.patch.object(placement_module, "FEW", few):
        peers = _peers(workers)
        placement = Placement(60.0)
        placement.start(peers)
        for mode, queue, _, task in jobs:
            spec = JobSpec(task=task, queue=queue, execution_mode=mode)
            job = Job.from_spec(spec, NOW)
            got, _ = placement.pick(job, 1.0)
            if got is None:
                assert not any(p.serves(job) and p.credits.available(mode) > 0 for p in peers), (
                    "a worker that could run the job was passed over"
                )
                continue
            assert got.tasks is None or task in got.tasks
            assert got.serves_queue(queue)
            if got.credits.reserve(mode):
                placement.reserved(got, mode)
