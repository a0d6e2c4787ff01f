"""The dependency rule (:mod:`broker.dependencies`) under every order of parent moves.

A state machine drives a memory store (which carries the rule out with no I/O) through
parents that complete, fail, are lost and retried, cancelled and revived, with reports
that arrive stale or twice; its model says, from the parents' first ends alone, what the
child must be. It checks that the child is made due exactly once, only once every parent
has ended (completed, unless it runs anyway), with the results the parents held then.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from adapters.memory import MemoryAdapter
from broker import dependencies
from broker.exceptions import InvalidJobError
from broker.jobs import (
    Job,
    JobSpec,
    JobStatus,
    JSONValue,
    Outcome,
    ParentFailure,
    ParentResults,
    Settlement,
)
from broker.testing import FakeClock

START = datetime(2030, 1, 1, tzinfo=UTC)

OUTCOMES = st.sampled_from(["complete", "dead", "retry", "lost"])


class DependencyMachine(RuleBasedStateMachine):
    """Model: each parent's *first end* (the status it first reached that ends a parent,
    and its result if it completed), the leases each parent was handed off under, and
    the reports that went through (to send again)."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = FakeClock(START)
        self.store = MemoryAdapter(clock=self.clock, offload_threshold=None)
        self.releases = 0
        release = self.store._deps.release

        async def counted(child_id: uuid.UUID, args: tuple[JSONValue, ...]) -> None:
            self.releases += 1
            await release(child_id, args)

        self.store._deps.release = counted  # type: ignore[method-assign]
        self.parents: list[uuid.UUID] = []
        self.first_end: dict[uuid.UUID, tuple[JobStatus, JSONValue]] = {}
        self.leases: dict[uuid.UUID, list[uuid.UUID]] = {}
        self.sent: list[Settlement] = []
        self.expected_args: tuple[Any, ...] | None = None
        self.results = iter(range(10**6))

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        self.loop.close()

    @initialize(parents=st.integers(1, 4), runs=st.booleans())
    def enqueue(self, parents: int, runs: bool) -> None:
        specs = [JobSpec("p") for _ in range(parents)]
        self.policy = ParentFailure.RUN if runs else ParentFailure.CANCEL
        child = JobSpec(
            "c",
            args=["own"],
            depends_on=tuple(s.id for s in specs),
            parent_results=ParentResults.LIST_ARG,
            on_parent_failure=self.policy,
        )
        self.run(self.store.enqueue_many([*specs, child]))
        self.parents = [s.id for s in specs]
        self.child = child.id
        for p in self.parents:
            self.leases[p] = []

    def status(self, job_id: uuid.UUID) -> JobStatus:
        job: Job | None = self.run(self.store.get_job(job_id))
        assert job is not None
        return job.status

    def note_ends(self) -> None:
        """Record the first end of every parent that has just ended, and, the moment the
        child should become due, the arguments it should get (the results then)."""
        for p in self.parents:
            status = self.status(p)
            if p not in self.first_end and dependencies.ends_parent(status):
                job = self.run(self.store.get_job(p))
                assert job is not None
                self.first_end[p] = (status, job.result)
        if self.expected_args is None and self.due_expected():
            results = []
            for p in self.parents:
                job = self.run(self.store.get_job(p))
                assert job is not None
                results.append(job.result if job.status is JobStatus.COMPLETED else None)
            self.expected_args = (results, "own")

    def cancelled_expected(self) -> bool:
        return self.policy is ParentFailure.CANCEL and any(
            s is not JobStatus.COMPLETED for s, _ in self.first_end.values()
        )

    def due_expected(self) -> bool:
        return len(self.first_end) == len(self.parents) and not self.cancelled_expected()

    # ------------------------------------------------------------------ rules

    @rule(i=st.integers(0, 3))
    def claim(self, i: int) -> None:
        p = self.parents[i % len(self.parents)]
        lease = uuid.uuid4()
        if self.run(self.store.mark_handed_off(p, lease, "w")) is not None:
            self.leases[p].append(lease)

    @rule(i=st.integers(0, 3), outcome=OUTCOMES, stale=st.booleans())
    def report(self, i: int, outcome: str, stale: bool) -> None:
        p = self.parents[i % len(self.parents)]
        if not self.leases[p]:
            return
        lease = self.leases[p][0 if stale else -1]
        result = next(self.results)
        settlement = {
            "complete": Settlement(p, lease, Outcome.COMPLETE, result=result),
            "dead": Settlement(p, lease, Outcome.FAIL, error="boom"),
            "retry": Settlement(p, lease, Outcome.FAIL, error="boom", run_at=START),
            "lost": Settlement(p, lease, Outcome.LOST, error="lost", run_at=START),
        }[outcome]
        [applied] = self.run(self.store.settle_many([settlement]))
        if applied:
            self.sent.append(settlement)
        self.note_ends()

    @rule(data=st.data())
    def resend(self, data: st.DataObject) -> None:
        if self.sent:
            settlement = data.draw(st.sampled_from(self.sent))
            assert self.run(self.store.settle_many([settlement, settlement])) == [False, False]
            self.note_ends()

    @rule(i=st.integers(0, 3))
    def cancel(self, i: int) -> None:
        self.run(self.store.cancel(self.parents[i % len(self.parents)]))
        self.note_ends()

    @rule(i=st.integers(0, 3))
    def revive(self, i: int) -> None:
        self.run(self.store.retry_dead(self.parents[i % len(self.parents)]))
        self.note_ends()

    # ------------------------------------------------------------------ invariants

    @invariant()
    def the_child_is_what_the_first_ends_say(self) -> None:
        if not self.parents:
            return
        child = self.run(self.store.get_job(self.child))
        assert child is not None
        if self.cancelled_expected():
            assert child.status is JobStatus.CANCELLED
            assert self.releases == 0
        elif self.due_expected():
            assert child.status is JobStatus.QUEUED
            assert self.releases == 1, "the continuation was made due more than once"
            assert child.args == self.expected_args
        else:
            assert child.status is JobStatus.WAITING
            assert self.releases == 0


DependencyMachine.TestCase.settings = settings(
    stateful_step_count=30, suppress_health_check=[HealthCheck.too_slow]
)
TestDependencyMachine = pytest.mark.timeout(900)(DependencyMachine.TestCase)


def _child(pending: int, policy: ParentFailure, status: JobStatus = JobStatus.WAITING) -> Any:
    return dependencies.Waiting(status, pending, policy, ParentResults.NONE, ())


def test_the_rule_table() -> None:
    """The table in :mod:`broker.dependencies`, row by row."""
    parent = uuid.uuid4()
    done = [(parent, JobStatus.COMPLETED)]
    dead = [(parent, JobStatus.FAILED)]
    after = dependencies.after_parents
    assert after(_child(1, ParentFailure.CANCEL), done) is None
    assert after(_child(0, ParentFailure.CANCEL), done) == "due"
    cancelled = after(_child(1, ParentFailure.CANCEL), dead)
    assert isinstance(cancelled, dependencies.CancelChild) and str(parent) in cancelled.reason
    assert after(_child(0, ParentFailure.RUN), dead) == "due"
    assert after(_child(0, ParentFailure.RUN, JobStatus.CANCELLED), done) is None
    assert dependencies.due_args(ParentResults.LIST_ARG, ("x",), [1, None]) == ([1, None], "x")
    assert dependencies.due_args(ParentResults.FIRST_ARG, (), [7]) == (7,)
    assert dependencies.due_args(ParentResults.NONE, (1,), [7]) == (1,)
    with pytest.raises(InvalidJobError, match="not in the store"):
        dependencies.ended_at_enqueue([parent], {})
    assert dependencies.ended_at_enqueue([parent], {parent: JobStatus.QUEUED}) == []
