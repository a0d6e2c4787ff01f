"""A workflow's retry (:func:`broker.dependencies.retry_plan`), carried out by a memory store.

Hypothesis builds workflows of a few members with random parents and options, fails some
members dead (their dependents cancelled, or run anyway), retries the workflow, then
completes whatever becomes due. Whatever the shape, every member then ends completed,
each child is made due at most once over the whole run (a continuation runs once), and
each child's count of parents is the number of its edges left to count.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from datetime import UTC, datetime

from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.memory import MemoryAdapter
from broker import dependencies
from broker.dependencies import Edge, Member, retry_plan, workflow_status
from broker.jobs import JobSpec, JobStatus, JSONValue, Outcome, ParentFailure, Settlement
from broker.testing import FakeClock

START = datetime(2030, 1, 1, tzinfo=UTC)


@st.composite
def workflows(draw: st.DrawFn) -> list[tuple[tuple[int, ...], bool, bool]]:
    """Per member: its parents (earlier members), whether it runs anyway, whether its
    first run fails dead."""
    size = draw(st.integers(2, 7))
    members = []
    for i in range(size):
        parents = tuple(sorted(draw(st.sets(st.integers(0, i - 1), max_size=3)))) if i else ()
        members.append((parents, draw(st.booleans()), draw(st.booleans())))
    return members


def _invariant(store: MemoryAdapter) -> None:
    open_edges = Counter(child for child, _ in store._open)
    for child, (pending, _, _) in store._waits.items():
        assert pending == open_edges[child], (child, pending, open_edges[child])


async def _run_due(store: MemoryAdapter, fail: set[uuid.UUID]) -> None:
    """Run every queued job until none is left: those in ``fail`` fail dead (once)."""
    while True:
        due = [j for j in store._jobs.values() if j.status is JobStatus.QUEUED]
        if not due:
            return
        for job in due:
            lease = uuid.uuid4()
            assert await store.mark_handed_off(job.id, lease, "w") is not None
            outcome = Outcome.FAIL if job.id in fail else Outcome.COMPLETE
            fail.discard(job.id)
            [ok] = await store.settle_many(
                [Settlement(job.id, lease, outcome, result=1, error="boom")]
            )
            assert ok
            _invariant(store)


async def _scenario(shape: list[tuple[tuple[int, ...], bool, bool]]) -> None:
    store = MemoryAdapter(clock=FakeClock(START), offload_threshold=None)
    releases: Counter[uuid.UUID] = Counter()
    release = store._deps.release

    async def counted(child_id: uuid.UUID, args: tuple[JSONValue, ...]) -> None:
        releases[child_id] += 1
        await release(child_id, args)

    store._deps.release = counted  # type: ignore[method-assign]
    workflow_id = uuid.uuid4()
    specs: list[JobSpec] = []
    for parents, anyway, _ in shape:
        specs.append(
            JobSpec(
                "t",
                workflow_id=workflow_id,
                depends_on=tuple(specs[p].id for p in parents),
                on_parent_failure=ParentFailure.RUN if anyway else ParentFailure.CANCEL,
            )
        )
    await store.enqueue_many(specs)
    await _run_due(store, {s.id for s, (_, _, dies) in zip(specs, shape, strict=True) if dies})
    await store.retry_workflow(workflow_id)
    _invariant(store)
    await _run_due(store, set())
    statuses = [store._jobs[s.id].status for s in specs]
    assert statuses == [JobStatus.COMPLETED] * len(specs), statuses
    assert all(n == 1 for n in releases.values()), releases


@settings(max_examples=60, deadline=None)
@given(workflows())
def test_a_retried_workflow_completes_with_each_child_released_once(
    shape: list[tuple[tuple[int, ...], bool, bool]],
) -> None:
    asyncio.run(_scenario(shape))


def test_an_operators_cancel_stands_and_a_cut_reason_revives_nothing() -> None:
    a, b, c = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    members = [
        Member(a, JobStatus.FAILED, "boom"),
        Member(b, JobStatus.CANCELLED, None),
        Member(c, JobStatus.CANCELLED, dependencies.parent_failed_reason(a, JobStatus.FAILED)),
    ]
    edges = [Edge(c, a, True), Edge(c, b, True)]
    plan = retry_plan(members, edges, {})
    assert (plan.requeue, plan.revive, plan.reopen) == ((a,), (), ())
    alone = retry_plan([members[0], members[2]], [Edge(c, a, True)], {})
    assert (alone.revive, alone.reopen, alone.pending) == ((c,), ((c, a),), {c: 1})


def test_the_workflow_status() -> None:
    s = JobStatus
    assert workflow_status([s.COMPLETED, s.WAITING]) == "running"
    assert workflow_status([s.COMPLETED, s.COMPLETED]) == "completed"
    assert workflow_status([s.FAILED, s.CANCELLED]) == "failed"
    assert workflow_status([s.COMPLETED, s.CANCELLED]) == "cancelled"


def test_parents_come_before_their_children() -> None:
    a, b, c = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    order = dependencies.parents_first([c, a, b], [Edge(c, a, False), Edge(a, b, False)])
    assert order == [b, a, c]
