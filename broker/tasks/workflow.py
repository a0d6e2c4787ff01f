"""Chains, groups and fan-in: jobs composed from bound task calls, as one enqueue.

``chain(fetch.bind(url), parse.bind(), store.bind())`` runs each step after the one
before has completed, its result first in the next step's arguments;
``group(resize.bind(i) for i in images)`` runs its members side by side;
``group(...).then(summarise.bind())`` runs ``summarise`` once every member has completed,
with the list of their results (in the group's order) as its first argument.

A workflow is only a set of jobs with ``depends_on`` edges (see :mod:`broker.dependencies`):
:func:`workflow_specs` turns it into specs, parents first, all carrying one
``workflow_id``; the client enqueues them in one request. Whether a continuation runs is
decided by the store, inside the settle of the member that completed the set, so it is
made due exactly once however workers fail. A step's arguments are checked against its
task's signature when the workflow is built (with a stand-in for the result it will
receive), so a step that could never run is refused before anything is stored.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from broker.exceptions import InvalidJobError
from broker.jobs import JobSpec, JSONValue, ParentFailure, ParentResults, random_uuid
from broker.model.bounds import MAX_CHAIN_STEPS, MAX_GROUP_MEMBERS
from broker.tasks.registry import Enqueued, Task, TaskCall

_RECEIVED = object()
"""Stands for the parent result a step will receive, when its arguments are checked."""


@dataclass(frozen=True)
class Step:
    """One task call in a workflow (:meth:`Task.bind`): the task with its options, and the
    arguments it is given beyond any parent result it receives."""

    call: TaskCall[Any, Any]
    args: tuple[JSONValue, ...] = ()
    kwargs: dict[str, JSONValue] = field(default_factory=dict)
    on_parent_failure: ParentFailure = ParentFailure.CANCEL

    def spec(
        self,
        workflow_id: uuid.UUID,
        depends_on: tuple[uuid.UUID, ...] = (),
        receives: ParentResults = ParentResults.NONE,
    ) -> JobSpec:
        """This step's job, its arguments checked with the parent result it receives."""
        received = () if receives is ParentResults.NONE else (_RECEIVED,)
        self.call.task.check_arguments((*received, *self.args), self.kwargs)
        spec = self.call.task.spec(
            self.args,
            self.kwargs,
            run_at=self.call.run_at,
            idempotency_key=self.call.idempotency_key,
            **self.call.overrides,
        )
        return replace(
            spec,
            depends_on=depends_on,
            parent_results=receives,
            on_parent_failure=self.on_parent_failure if depends_on else ParentFailure.CANCEL,
            workflow_id=workflow_id,
        )

    def run_anyway(self) -> Step:
        """This step runs even if a parent ends dead or cancelled (its result is ``None``)."""
        return replace(self, on_parent_failure=ParentFailure.RUN)


@dataclass(frozen=True)
class Chain:
    """Steps run one after another, each receiving the result of the one before."""

    steps: tuple[Step, ...]


@dataclass(frozen=True)
class Group:
    """Steps run side by side."""

    members: tuple[Step, ...]

    def then(self, step: Step) -> FanIn:
        """``step`` runs once every member has completed, with their results (a list in
        the group's order) as its first argument."""
        return FanIn(self, step)


@dataclass(frozen=True)
class FanIn:
    """A group and the step that runs over all its results."""

    group: Group
    step: Step


Workflow = Chain | Group | FanIn


def chain(*steps: Step) -> Chain:
    """Steps run in order, each receiving the result of the one before as its first
    argument (at most :data:`~broker.model.bounds.MAX_CHAIN_STEPS`)."""
    if not steps:
        raise InvalidJobError("a chain needs at least one step")
    if len(steps) > MAX_CHAIN_STEPS:
        raise InvalidJobError(f"a chain has at most {MAX_CHAIN_STEPS} steps (got {len(steps)})")
    return Chain(_steps(steps))


def group(steps: Iterable[Step]) -> Group:
    """Steps run side by side (at most :data:`~broker.model.bounds.MAX_GROUP_MEMBERS`)."""
    members = _steps(steps, limit=MAX_GROUP_MEMBERS)
    if not members:
        raise InvalidJobError("a group needs at least one member")
    return Group(members)


def _steps(steps: Iterable[Step], limit: int | None = None) -> tuple[Step, ...]:
    out = []
    for step in steps:
        if not isinstance(step, Step):
            raise InvalidJobError(f"a workflow is made of task.bind(...) steps, not {step!r}")
        out.append(step)
        if limit is not None and len(out) > limit:
            raise InvalidJobError(f"a group has at most {limit} members")
    return tuple(out)


def workflow_specs(workflow: Workflow, workflow_id: uuid.UUID | None = None) -> list[JobSpec]:
    """The jobs of ``workflow``, each parent before its children, under one workflow id
    (a fresh one by default): the last spec is the workflow's final job (a chain's last
    step, a fan-in's continuation; a group has none of its own)."""
    wid = workflow_id or random_uuid()
    match workflow:
        case Chain(steps=steps):
            specs = [steps[0].spec(wid)]
            for step in steps[1:]:
                specs.append(step.spec(wid, (specs[-1].id,), ParentResults.FIRST_ARG))
            return specs
        case Group(members=members):
            return [m.spec(wid) for m in members]
        case FanIn(group=members, step=step):
            specs = workflow_specs(members, wid)
            parents = tuple(s.id for s in specs)
            return [*specs, step.spec(wid, parents, ParentResults.LIST_ARG)]
    raise InvalidJobError(f"not a workflow: {workflow!r}")


@dataclass(frozen=True, slots=True)
class EnqueuedWorkflow:
    """The main's answer to a workflow's enqueue: its id, its jobs' ids (each parent before
    its children, in the order :func:`workflow_specs` gives) and its final job's id (a
    chain's last step, a fan-in's continuation; ``None`` for a bare group), the one to
    wait on for the workflow's result."""

    workflow_id: uuid.UUID
    job_ids: tuple[uuid.UUID, ...]
    final_job_id: uuid.UUID | None
    final: Enqueued | None = field(default=None, compare=False, repr=False)
    """The handle of the final job (``None`` for a bare group): its :meth:`Enqueued.result`
    is the workflow's result, decoded by the final step's task."""

    async def result(self, *, timeout: float = 60.0) -> Any:  # noqa: ASYNC109 - how long to wait
        """The final job's result (:meth:`Enqueued.result`).

        :raises InvalidJobError: a bare group has no final job (wait on its members).
        """
        return await self._final().result(timeout=timeout)

    def result_sync(self, *, timeout: float = 60.0) -> Any:
        """The blocking twin of :meth:`result`, for a workflow from a ``SyncClient``."""
        return self._final().result_sync(timeout=timeout)

    def _final(self) -> Enqueued:
        if self.final is None:
            raise InvalidJobError(
                "a bare group has no final job: wait on its members, or add .then(step)"
            )
        return self.final


def final_job(workflow: Workflow, specs: list[JobSpec]) -> uuid.UUID | None:
    """The id of ``workflow``'s final job among its ``specs`` (see :class:`EnqueuedWorkflow`)."""
    return None if isinstance(workflow, Group) else specs[-1].id


def final_task(workflow: Workflow) -> Task[Any, Any] | None:
    """The task of ``workflow``'s final step, whose return annotation types its result."""
    match workflow:
        case Chain(steps=steps):
            return steps[-1].call.task
        case FanIn(step=step):
            return step.call.task
    return None


def bind(task: Task[Any, Any] | TaskCall[Any, Any], *args: JSONValue, **kwargs: JSONValue) -> Step:
    """A step of ``task`` (or of a call with options) with these arguments; what
    :meth:`Task.bind` returns."""
    call = task if isinstance(task, TaskCall) else task.options()
    return Step(call, tuple(args), dict(kwargs))
