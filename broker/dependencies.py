"""What a parent's end does to the jobs that depend on it: the dependency rule, written once.

A job enqueued with ``depends_on`` is stored ``waiting``, with one edge per parent and a
count of the parents it still waits for. Every store carries out the same rule, inside
the transaction of the move that ended the parent (a fenced settle, a cancel, or the
child's own enqueue when a parent had already ended):

=====================  ======================  ===================================
parent ends            ``on_parent_failure``   the waiting child
=====================  ======================  ===================================
``completed``          either                  counts it; at 0 it becomes ``queued``
``failed``/cancelled   ``cancel`` (default)    ``cancelled``, ``last_error`` naming
                                               the parent; its own children follow
``failed``/cancelled   ``run``                 counts it; at 0 it becomes ``queued``
=====================  ======================  ===================================

Why this makes a fan-in's continuation exactly-once: the count goes down only inside the
transaction of a move the fence accepted (a stale or repeated report changes nothing, so
counts nothing), each edge is counted once (it is marked done as it is counted, so a
parent revived by an operator and completing again counts nothing more), and the count
is a field of the child's own row, so two parents ending at once on PostgreSQL serialise
on that row and exactly one of them sees it reach zero. A cut commit loses the parent's
move and the count together.

:func:`propagate` is the whole walk, over a :class:`DependencyStore` each adapter
implements for its own transaction; the decisions in it are the pure functions below.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from broker.exceptions import InvalidJobError
from broker.jobs import JobSpec, JobStatus, JSONValue, ParentFailure, ParentResults


@dataclass(frozen=True, slots=True)
class Waiting:
    """A child as a parent's end finds it, after its count went down."""

    status: JobStatus
    pending: int
    """Parents it still waits for, this one counted."""
    on_parent_failure: ParentFailure
    parent_results: ParentResults
    args: tuple[JSONValue, ...]


@dataclass(frozen=True, slots=True)
class CancelChild:
    """The child becomes ``cancelled`` with this ``last_error``."""

    reason: str


def ends_parent(status: JobStatus) -> bool:
    """Whether a job reaching ``status`` has ended as a parent: every terminal status."""
    return status.is_terminal


def parent_failed_reason(parent_id: uuid.UUID, status: JobStatus) -> str:
    """The ``last_error`` of a child cancelled because its parent did not complete."""
    return f"parent job {parent_id} ended {status.value}"


def after_parents(
    child: Waiting, ended: Sequence[tuple[uuid.UUID, JobStatus]]
) -> CancelChild | Literal["due"] | None:
    """What the parents in ``ended`` (this move's, already counted in ``child.pending``)
    do to ``child``: :class:`CancelChild`, ``"due"`` (it has no parent left: fetch the
    parents' results and :func:`due_args`), or ``None`` (it waits on)."""
    if child.status is not JobStatus.WAITING:
        return None  # cancelled meanwhile (by an operator, or by another parent)
    if child.on_parent_failure is ParentFailure.CANCEL:
        for parent_id, status in ended:
            if status is not JobStatus.COMPLETED:
                return CancelChild(parent_failed_reason(parent_id, status))
    return "due" if child.pending <= 0 else None


def due_args(
    mode: ParentResults, args: Sequence[JSONValue], results: Sequence[JSONValue]
) -> tuple[JSONValue, ...]:
    """A due child's arguments: its own, after its parents' ``results`` (in ``depends_on``
    order; ``None`` for a parent that did not complete) as ``mode`` asks."""
    match mode:
        case ParentResults.NONE:
            return tuple(args)
        case ParentResults.FIRST_ARG:
            return (results[0], *args)
        case ParentResults.LIST_ARG:
            return (list(results), *args)


def ended_at_enqueue(
    parents: Sequence[uuid.UUID], status_of: Mapping[uuid.UUID, JobStatus]
) -> list[tuple[uuid.UUID, JobStatus]]:
    """The parents an enqueue names that have ended already (``status_of``: every parent
    the store holds, locked for the enqueue's transaction), which :func:`propagate` then
    counts for the new child as if they had just ended.

    :raises InvalidJobError: a parent is not in the store (never enqueued, or pruned):
        parents must exist first, which is also why no cycle can form.
    """
    missing = [p for p in parents if p not in status_of]
    if missing:
        raise InvalidJobError(f"depends_on names job {missing[0]}, which is not in the store")
    return [(p, status_of[p]) for p in parents if ends_parent(status_of[p])]


class DependencyStore(Protocol):
    """One store transaction, as :func:`propagate` needs it. Every method acts inside the
    transaction of the move that ended the parents (a store that never suspends may
    implement the coroutines without awaiting anything)."""

    async def open_edges(
        self, parent_ids: Sequence[uuid.UUID]
    ) -> list[tuple[uuid.UUID, uuid.UUID]]:
        """Mark done the edges from these parents not done yet; ``(child, parent)`` for
        each one marked, so each edge is counted once whoever asks again."""

    async def count_down(self, child_id: uuid.UUID, parents: int) -> Waiting | None:
        """Take ``parents`` off the child's count, locking its row until the transaction
        ends; the child as it now stands, ``None`` if it is gone."""

    async def parent_results(self, child_id: uuid.UUID) -> list[JSONValue]:
        """The results of the child's parents, in ``depends_on`` order (``None`` for one
        that did not complete, or is gone)."""

    async def release(self, child_id: uuid.UUID, args: tuple[JSONValue, ...]) -> None:
        """``waiting`` → ``queued``, due at once, with these arguments."""

    async def cancel_waiting(self, child_id: uuid.UUID, reason: str) -> None:
        """``waiting`` → ``cancelled`` with ``last_error`` ``reason``."""


async def count_ended_at_enqueue(
    store: DependencyStore, specs: Sequence[JobSpec], status_of: Mapping[uuid.UUID, JobStatus]
) -> None:
    # A job cancelled here is cancelled by its own enqueue: nobody can wait on it yet.
    """Count, for the jobs of an enqueue (``specs``, their edges just written), the parents
    that have ended already (:func:`ended_at_enqueue`), as if they had just ended."""
    ended: dict[uuid.UUID, JobStatus] = {}
    for spec in specs:
        ended.update(ended_at_enqueue(spec.depends_on, status_of))
    if ended:
        await propagate(store, list(ended.items()))


@dataclass(frozen=True, slots=True)
class Carried:
    """What :func:`propagate` did: how many children became due, and which it cancelled
    (their waiters are owed an answer: see :class:`broker.storage.SupportsEndNotice`)."""

    released: int
    cancelled: tuple[uuid.UUID, ...]


async def propagate(
    store: DependencyStore, ended: Sequence[tuple[uuid.UUID, JobStatus]]
) -> Carried:
    """Carry the parents in ``ended`` (each just moved to a terminal status by a move the
    store accepted) to their children, and a cancelled child on to its own. Children are
    visited in id order, so two transactions on PostgreSQL lock the rows they share in
    one order."""
    released = 0
    cancelled: list[uuid.UUID] = []
    while ended:
        status_of = dict(ended)
        by_child: dict[uuid.UUID, list[tuple[uuid.UUID, JobStatus]]] = {}
        for child_id, parent_id in await store.open_edges(list(status_of)):
            by_child.setdefault(child_id, []).append((parent_id, status_of[parent_id]))
        ended = []
        for child_id in sorted(by_child):
            parents = by_child[child_id]
            child = await store.count_down(child_id, len(parents))
            if child is None:
                continue
            verdict = after_parents(child, parents)
            if isinstance(verdict, CancelChild):
                await store.cancel_waiting(child_id, verdict.reason)
                ended.append((child_id, JobStatus.CANCELLED))
                cancelled.append(child_id)
            elif verdict == "due":
                results = await store.parent_results(child_id)
                await store.release(child_id, due_args(child.parent_results, child.args, results))
                released += 1
    return Carried(released, tuple(cancelled))


# --------------------------------------------------------------------------- workflows


@dataclass(frozen=True, slots=True)
class Member:
    """A workflow's job as a store reads it for :func:`workflow_status` and
    :func:`retry_plan`: its status and its ``last_error`` (which names the parent that
    cancelled it, :func:`parent_failed_reason`)."""

    id: uuid.UUID
    status: JobStatus
    last_error: str | None = None


@dataclass(frozen=True, slots=True)
class Edge:
    """One parent of a workflow's job, and whether its end has been counted."""

    child: uuid.UUID
    parent: uuid.UUID
    done: bool


WorkflowStatus = Literal["running", "completed", "failed", "cancelled"]
"""A workflow's status, derived from its members' (:func:`workflow_status`)."""


def workflow_status(statuses: Sequence[JobStatus]) -> WorkflowStatus:
    """A workflow's status from its members': ``running`` while any is waiting, queued or
    handed off; then ``completed`` if every one completed, ``failed`` if one ended dead
    (its dependents cancelled because of it count as that failure), else ``cancelled``."""
    if any(not s.is_terminal for s in statuses):
        return "running"
    if all(s is JobStatus.COMPLETED for s in statuses):
        return "completed"
    if any(s is JobStatus.FAILED for s in statuses):
        return "failed"
    return "cancelled"


@dataclass(frozen=True, slots=True)
class RetryPlan:
    """What a workflow's retry changes, in one transaction: ``requeue`` the dead members
    (as ``retry_dead`` does), ``revive`` the dependents cancelled because of them
    (``cancelled`` → ``waiting``, ``last_error`` cleared), mark ``reopen`` edges not
    counted again, and set each touched child's count of parents to ``pending``."""

    requeue: tuple[uuid.UUID, ...]
    revive: tuple[uuid.UUID, ...]
    reopen: tuple[tuple[uuid.UUID, uuid.UUID], ...]
    """``(child, parent)``."""
    pending: dict[uuid.UUID, int]

    @property
    def empty(self) -> bool:
        return not self.requeue


def retry_plan(
    members: Sequence[Member], edges: Sequence[Edge], parent_status: Mapping[uuid.UUID, JobStatus]
) -> RetryPlan:
    """The retry of a workflow whose jobs are ``members`` (parents before children) and
    whose parent edges are ``edges``; ``parent_status``: the status of every parent
    named in ``edges`` (members or not; one missing is taken as gone).

    Every dead (``failed``) member runs again. A ``cancelled`` member is revived when its
    ``last_error`` says a parent ended (:func:`parent_failed_reason`) and that parent is
    retried or revived, and none of its other parents has ended otherwise than
    completed (an operator's cancel stands). A revived member's edges from retried or
    revived parents are counted again, so it is released by their new end, once: its
    count is the number of its edges left uncounted, the invariant every store keeps. A
    member still ``waiting`` that had counted a retried parent's end (``run`` anyway)
    counts that parent again too, so it waits for the new end instead of running with
    ``None`` for it."""
    status = {m.id: m.status for m in members}
    status_of = {**parent_status, **status}
    parents: dict[uuid.UUID, list[Edge]] = {}
    for edge in edges:
        parents.setdefault(edge.child, []).append(edge)
    requeue = [m.id for m in members if m.status is JobStatus.FAILED]
    again = set(requeue)
    revive: list[uuid.UUID] = []
    for m in members:  # parents before children: a revived parent is known to its children
        if m.status is not JobStatus.CANCELLED or not m.last_error:
            continue
        mine = parents.get(m.id, [])
        named = [
            e.parent
            for e in mine
            if e.parent in again
            and m.last_error == parent_failed_reason(e.parent, status_of[e.parent])
        ]
        others_fine = all(
            e.parent in again
            or status_of.get(e.parent) is JobStatus.COMPLETED
            or (e.parent in status_of and not status_of[e.parent].is_terminal)
            for e in mine
        )
        if named and others_fine:
            revive.append(m.id)
            again.add(m.id)
    revived = set(revive)
    reopen: list[tuple[uuid.UUID, uuid.UUID]] = []
    pending: dict[uuid.UUID, int] = {}
    for child, mine in parents.items():
        if child not in revived and status.get(child) is not JobStatus.WAITING:
            continue
        opened = [(child, e.parent) for e in mine if e.done and e.parent in again]
        if opened or child in revived:
            reopen += opened
            pending[child] = sum(1 for e in mine if not e.done) + len(opened)
    return RetryPlan(tuple(requeue), tuple(revive), tuple(reopen), pending)


def parents_first(ids: Sequence[uuid.UUID], edges: Sequence[Edge]) -> list[uuid.UUID]:
    """``ids`` (a workflow's jobs in enqueue order) with every parent before its children,
    the enqueue order kept otherwise: jobs of one batch share a creation time, so a store
    reading them by it may give a child first."""
    among = set(ids)
    parents: dict[uuid.UUID, set[uuid.UUID]] = {}
    for e in edges:
        if e.child in among and e.parent in among:
            parents.setdefault(e.child, set()).add(e.parent)
    placed: set[uuid.UUID] = set()
    order: list[uuid.UUID] = []
    left = list(ids)
    while left:
        rest = []
        for job_id in left:
            if parents.get(job_id, set()) <= placed:
                placed.add(job_id)
                order.append(job_id)
            else:
                rest.append(job_id)
        if len(rest) == len(left):  # a cycle cannot form; keep the rest as read
            order += rest
            break
        left = rest
    return order
