"""How a chain, a group and a fan-in become jobs (:func:`broker.tasks.workflow.workflow_specs`):
parents first, one workflow id, each step receiving what its place gives it, and the
bounds and argument checks at build time."""

from __future__ import annotations

import pytest

from broker import InvalidJobError, chain, group
from broker.jobs import ParentFailure, ParentResults
from broker.tasks.registry import TaskRegistry, task
from broker.tasks.workflow import workflow_specs

registry = TaskRegistry()


@task(name="t.step", registry=registry)
def step(value: int, extra: int = 0) -> int:
    return value + extra


@task(name="t.fan_in", registry=registry)
def fan_in(values: list[int]) -> int:
    return sum(values)


def test_a_chain_is_a_line_of_jobs_each_receiving_the_result_before() -> None:
    specs = workflow_specs(chain(step.bind(1), step.bind(extra=2), step.bind()))
    assert [s.depends_on for s in specs] == [(), (specs[0].id,), (specs[1].id,)]
    assert [s.parent_results for s in specs] == [
        ParentResults.NONE,
        ParentResults.FIRST_ARG,
        ParentResults.FIRST_ARG,
    ]
    assert specs[1].kwargs == {"extra": 2} and specs[0].args == (1,)
    assert len({s.workflow_id for s in specs}) == 1 and specs[0].workflow_id is not None


def test_a_fan_in_depends_on_every_member_in_the_groups_order() -> None:
    members = group(step.bind(i) for i in range(5))
    specs = workflow_specs(members.then(fan_in.bind().run_anyway()))
    *parents, last = specs
    assert last.depends_on == tuple(p.id for p in parents)
    assert last.parent_results is ParentResults.LIST_ARG
    assert last.on_parent_failure is ParentFailure.RUN
    assert all(not p.depends_on for p in parents)
    assert [p.args for p in workflow_specs(members)] == [(i,) for i in range(5)]


def test_steps_are_checked_with_the_result_they_will_receive() -> None:
    with pytest.raises(TypeError, match=r"t\.step"):
        workflow_specs(chain(step.bind(1), step.bind(1, 2)))
    with pytest.raises(TypeError, match=r"t\.fan_in"):
        workflow_specs(group([step.bind(1)]).then(fan_in.bind(3)))


def test_the_bounds_hold_when_the_workflow_is_built() -> None:
    with pytest.raises(InvalidJobError, match="at most 100 steps"):
        chain(*(step.bind() for _ in range(101)))
    with pytest.raises(InvalidJobError, match="at most 1000 members"):
        group(step.bind(i) for i in range(1001))
    with pytest.raises(InvalidJobError, match="at least one"):
        group([])
    with pytest.raises(InvalidJobError, match=r"task\.bind"):
        chain(step)  # type: ignore[arg-type]
