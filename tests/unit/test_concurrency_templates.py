"""``@task(concurrency_key="sync:{account_id}", concurrency_limit=1)``: the key is formatted
from each job's arguments, by keyword or by position, and a missing one is a clear error."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from adapters.memory import MemoryAdapter
from broker.exceptions import ConfigurationError, InvalidJobError
from broker.jobs import ExecutionMode
from broker.tasks.registry import TaskRegistry, task


@pytest.fixture
def registry() -> TaskRegistry:
    return TaskRegistry()


def test_the_key_is_formatted_from_keyword_and_positional_arguments(
    registry: TaskRegistry,
) -> None:
    @task(
        name="app.sync", concurrency_key="sync:{account_id}", concurrency_limit=1, registry=registry
    )
    def sync(account_id: int, full: bool = False) -> None:
        pass

    assert sync.spec(kwargs={"account_id": 7}).concurrency_key == "sync:7"
    assert sync.spec([7]).concurrency_key == "sync:7", "positional args bind by parameter name"
    assert sync.spec([8], {"full": True}).concurrency_key == "sync:8"
    assert sync.spec([7]).concurrency_limit == 1
    assert sync.concurrency_key == "sync:{account_id}", "the task keeps its template"


def test_defaults_nested_values_and_var_keyword(registry: TaskRegistry) -> None:
    @task(
        name="app.export",
        concurrency_key="export:{tenant[id]}:{fmt}",
        concurrency_limit=2,
        registry=registry,
    )
    def export(tenant: dict[str, Any], fmt: str = "csv") -> None:
        pass

    assert export.spec([{"id": "t1"}]).concurrency_key == "export:t1:csv"
    assert export.spec([{"id": "t1"}], {"fmt": "json"}).concurrency_key == "export:t1:json"

    @task(name="app.any", concurrency_key="any:{region}", concurrency_limit=1, registry=registry)
    def anything(*args: Any, **kwargs: Any) -> None:
        pass

    assert anything.spec([1, 2], {"region": "eu"}).concurrency_key == "any:eu"
    with pytest.raises(InvalidJobError, match="'region'"):
        anything.spec([1, 2])


def test_a_missing_argument_names_itself(registry: TaskRegistry) -> None:
    @task(
        name="app.sync", concurrency_key="sync:{account_id}", concurrency_limit=1, registry=registry
    )
    def sync(account_id: int = 0, **extra: Any) -> None:
        pass

    @task(name="app.strict", concurrency_key="s:{who}", concurrency_limit=1, registry=registry)
    def strict(who: str) -> None:
        pass

    with pytest.raises(InvalidJobError) as raised:
        strict.spec()
    message = str(raised.value)
    assert "'who'" in message and "app.strict" in message and "s:{who}" in message
    # Arguments that do not fit the signature fall back to the keyword arguments alone.
    with pytest.raises(InvalidJobError, match="'who'"):
        strict.spec([1, 2, 3])
    assert strict.spec([1, 2, 3], {"who": "x"}).concurrency_key == "s:x"


def test_literal_keys_and_explicit_overrides_are_not_templates(registry: TaskRegistry) -> None:
    @task(name="app.lit", concurrency_key="global", concurrency_limit=3, registry=registry)
    def lit(x: int) -> None:
        pass

    @task(name="app.esc", concurrency_key="a{{b}}:{x}", concurrency_limit=1, registry=registry)
    def esc(x: int) -> None:
        pass

    assert lit.spec([1]).concurrency_key == "global"
    assert esc.spec([5]).concurrency_key == "a{b}:5"
    assert esc.spec([5], concurrency_key="{x}").concurrency_key == "{x}", "overrides are literal"


def test_bad_templates_are_refused_at_registration(registry: TaskRegistry) -> None:
    def fn(account_id: int) -> None:
        pass

    for template, message in [
        ("sync:{acount_id}", "'acount_id', which is not a parameter"),
        ("sync:{0}", "must name parameters"),
        ("sync:{}", "must name parameters"),
        ("sync:{account_id", "not a valid template"),
        # A width would make every job's key that long (issue 30: 400 MB an enqueue).
        ("sync:{account_id:>400000000}", "conversion or format spec"),
        ("sync:{account_id!r}", "conversion or format spec"),
        ("sync:{account_id:{account_id}}", "conversion or format spec"),
    ]:
        with pytest.raises(ConfigurationError, match=message):
            task(name="t", concurrency_key=template, concurrency_limit=1, registry=registry)(fn)


async def test_jobs_of_one_account_run_one_at_a_time(registry: TaskRegistry) -> None:
    @task(
        name="app.sync",
        concurrency_key="sync:{account_id}",
        concurrency_limit=1,
        mode="inline",
        registry=registry,
    )
    def sync(account_id: int) -> None:
        pass

    store = MemoryAdapter()
    await store.enqueue_many([sync.spec([1]), sync.spec([1]), sync.spec([2])])
    eligible = await store.select_eligible(modes=[ExecutionMode.INLINE])
    assert len(eligible) == 3
    first_of_1 = next(j for j in eligible if j.args == (1,))
    assert await store.mark_handed_off(first_of_1.id, uuid.uuid4(), "w") is not None
    waiting = await store.select_eligible(modes=[ExecutionMode.INLINE])
    assert sorted(j.concurrency_key or "" for j in waiting) == ["sync:2"]
