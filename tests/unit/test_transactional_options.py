"""``broker.client.transactional.job_spec``: the job a transactional enqueue stores, from a task
or a name and the options of ``Client.enqueue``, checked before any database is touched."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from broker.client.transactional import job_spec
from broker.exceptions import InvalidJobError
from broker.jobs import ExecutionMode, JobSpec
from broker.tasks.registry import TaskRegistry, task

registry = TaskRegistry()


@task(name="t.unique", queue="q", retries=0, mode="inline", unique=True, registry=registry)
def unique_task(n: int) -> None: ...


def test_a_task_gives_its_defaults_and_options_override_them() -> None:
    spec = job_spec(unique_task, [1])
    assert (spec.task, spec.queue, spec.max_attempts, spec.execution_mode) == (
        "t.unique",
        "q",
        1,
        ExecutionMode.INLINE,
    )
    assert spec.unique_key is not None and spec.unique_key.startswith("t.unique:")
    spec = job_spec(unique_task, [1], queue="other", execution_mode="forked", unique_key="k")
    assert (spec.queue, spec.execution_mode, spec.unique_key) == (
        "other",
        ExecutionMode.FORKED,
        "k",
    )


def test_a_name_gets_the_job_defaults_and_a_delay_runs_from_now() -> None:
    before = datetime.now(UTC)
    spec = job_spec("t.plain", [1], {"a": 2}, delay=30)
    assert (spec.task, spec.args, spec.kwargs, spec.queue) == ("t.plain", (1,), {"a": 2}, "default")
    assert spec.run_at is not None
    assert (
        before + timedelta(seconds=30) <= spec.run_at <= datetime.now(UTC) + timedelta(seconds=30)
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"delay": 1, "run_at": datetime.now(UTC)}, "run_at or delay"),
        ({"delay": -1}, "delay"),
        ({"execution_mode": "threaded"}, "execution_mode must be one of"),
        ({"queue": ""}, "queue"),
        ({"priority": 2**40}, "32 bits"),
    ],
)
def test_bad_options_are_refused_with_the_jobs_own_errors(
    options: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidJobError, match=message):
        job_spec("t.plain", **options)  # type: ignore[arg-type]


def test_a_database_that_cannot_hold_the_store_is_refused_by_name() -> None:
    from broker.client.transactional import enqueue_on_statements
    from broker.exceptions import ConfigurationError

    class Unused:
        def execute(self, *args: object, **kwargs: object) -> object:
            raise AssertionError("nothing may be executed")

    with pytest.raises(ConfigurationError, match="'mysql'"):
        enqueue_on_statements(Unused(), "mysql", [job_spec("t.plain")])


def test_a_task_object_binds_its_arguments_before_a_job_is_built() -> None:
    with pytest.raises(TypeError, match="cannot take these arguments"):
        job_spec(unique_task, [1, 2, 3])
    assert job_spec(unique_task, [7]).args == (7,)


def test_a_name_and_the_same_options_again_check_each_jobs_arguments_and_mint_its_id() -> None:
    """A name with the same options call after call gets a spec made from one checked
    with them (``_options_spec``): each job is the spec a whole ``JobSpec`` makes, with
    its own arguments (checked) and id; an option equal to a valid one but of another
    type (``True`` for ``1``) is still refused, and one that cannot key the cache is
    made and checked as ever, as is one that is not an option."""
    first = job_spec("t.same", [1], {"k": "v"}, priority=1, execution_mode="inline")
    second = job_spec("t.same", (2,), None, priority=1, execution_mode="inline")
    for spec, args, kwargs in ((first, (1,), {"k": "v"}), (second, (2,), {})):
        whole = JobSpec(task="t.same", args=args, kwargs=kwargs, priority=1, id=spec.id)
        assert spec == replace(whole, execution_mode=ExecutionMode.INLINE)
    assert first.id != second.id
    with pytest.raises(InvalidJobError, match="JSON"):
        job_spec("t.same", [float("nan")], priority=1, execution_mode="inline")
    with pytest.raises(InvalidJobError, match="kwargs"):
        job_spec("t.same", [1], {1: 2}, priority=1, execution_mode="inline")  # type: ignore[dict-item]
    with pytest.raises(InvalidJobError, match="priority"):
        job_spec("t.same", [1], priority=True, execution_mode="inline")
    with pytest.raises(InvalidJobError, match="priority"):
        job_spec("t.same", [1], priority=[1])  # type: ignore[arg-type]
    given = first.id  # a field of a spec that is no option is the spec's own
    assert job_spec("t.same", [1], priority=1, id=given).id == given  # type: ignore[call-arg]
