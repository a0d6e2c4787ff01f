"""The task catalog's rules (:mod:`broker.catalog`) on the memory adapter: a job by name
gets its task's declared defaults where the request says nothing, the newest declaration
wins (with a warning), and an undeclared name is refused once the catalog is in use."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

import pytest

from adapters.memory import MemoryAdapter
from broker import catalog, protocol
from broker.catalog import Catalog
from broker.exceptions import InvalidJobError, UnknownTaskError
from broker.jobs import ExecutionMode, JobSpec
from broker.retry import ExponentialBackoff, FixedBackoff
from broker.tasks import TaskRegistry, default_unique_key, task

NOW = datetime(2030, 1, 1, tzinfo=UTC)


def _declared(name: str = "app.sync", **kw: object) -> protocol.TaskDeclaration:
    return protocol.TaskDeclaration(name=name, **kw)  # type: ignore[arg-type]


async def _catalog(*declared: tuple[str, list[protocol.TaskDeclaration]]) -> Catalog:
    found = Catalog(MemoryAdapter())
    await found.load()
    for worker, tasks in declared:
        found.record(worker, tasks, NOW)
    return found


async def test_unsaid_fields_take_the_declared_defaults_and_said_ones_win() -> None:
    found = await _catalog(
        (
            "w1",
            [
                _declared(
                    queue="sync",
                    priority=3,
                    max_attempts=1,
                    timeout=30.0,
                    execution_mode=ExecutionMode.FORKED,
                    concurrency_key="acct:{account}",
                    concurrency_limit=1,
                    unique=True,
                    parameters=["account", "full"],
                )
            ],
        )
    )
    request = protocol.JobRequest(task="app.sync", args=[7], kwargs={"full": True})
    spec = found.job_spec(request, NOW, allow_unknown=False)
    assert (spec.queue, spec.priority, spec.max_attempts, spec.timeout) == ("sync", 3, 1, 30.0)
    assert spec.execution_mode is ExecutionMode.FORKED
    assert (spec.concurrency_key, spec.concurrency_limit) == ("acct:7", 1)
    assert spec.unique_key == default_unique_key("app.sync", [7], {"full": True})
    said = protocol.JobRequest(
        task="app.sync", args=[7], queue="mine", max_attempts=5, concurrency_key="k",
        concurrency_limit=2, unique_key="u",
    )  # fmt: skip
    spec = found.job_spec(said, NOW, allow_unknown=False)
    assert (spec.queue, spec.max_attempts, spec.priority) == ("mine", 5, 3)
    assert (spec.concurrency_key, spec.concurrency_limit, spec.unique_key) == ("k", 2, "u")


async def test_a_template_the_job_cannot_fill_is_refused() -> None:
    found = await _catalog(
        ("w1", [_declared(concurrency_key="acct:{account}", concurrency_limit=1)])
    )
    with pytest.raises(InvalidJobError, match="needs the argument 'account'"):
        found.job_spec(protocol.JobRequest(task="app.sync"), NOW, allow_unknown=False)


async def test_unknown_names_are_refused_once_the_catalog_is_in_use() -> None:
    empty = await _catalog()
    spec = empty.job_spec(protocol.JobRequest(task="app.any"), NOW, allow_unknown=False)
    assert spec == JobSpec(task="app.any", id=spec.id), "not in use yet: broker defaults"
    found = await _catalog(("w1", [_declared()]))
    with pytest.raises(UnknownTaskError, match=r"no worker has declared task 'app\.snyc'"):
        found.job_spec(protocol.JobRequest(task="app.snyc"), NOW, allow_unknown=False)
    allowed = found.job_spec(protocol.JobRequest(task="app.snyc"), NOW, allow_unknown=True)
    assert allowed.max_attempts == 11


async def test_the_newest_declaration_wins_and_a_difference_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryAdapter()
    found = Catalog(store)
    await found.load()
    old = found.record("w-old", [_declared(max_attempts=11)], NOW)
    await found.save("w-old", old, NOW)
    with caplog.at_level(logging.WARNING, "broker.main"):
        new = found.record("w-new", [_declared(max_attempts=1)], NOW + timedelta(seconds=1))
    await found.save("w-new", new, NOW + timedelta(seconds=1))
    assert "workers declare a task with different defaults" in caplog.text
    assert "task=app.sync" in caplog.text
    assert "fields=max_attempts" in caplog.text
    spec = found.job_spec(protocol.JobRequest(task="app.sync"), NOW, allow_unknown=False)
    assert spec.max_attempts == 1
    # A fresh main reads the same decision back from the store.
    again = Catalog(store)
    await again.load()
    declared = again.declared("app.sync")
    assert declared is not None and declared.max_attempts == 1
    assert [(r.task, r.worker_id) for r in again.records()] == [
        ("app.sync", "w-new"),
        ("app.sync", "w-old"),
    ]


async def test_refresh_sees_what_another_process_recorded() -> None:
    store = MemoryAdapter()
    mine = Catalog(store)
    await mine.load()
    await store.declare_tasks("w9", {"app.sync": {"name": "app.sync", "queue": "q"}}, NOW)
    assert mine.declared("app.sync") is None
    await mine.refresh()
    declared = mine.declared("app.sync")
    assert declared is not None and declared.queue == "q"


def test_a_worker_declares_what_task_says() -> None:
    registry = TaskRegistry()

    def gentle(failures: int) -> float:
        return 5.0 * failures

    @task(
        name="app.pay",
        registry=registry,
        retries=2,
        queue="money",
        mode="inline",
        timeout=9,
        dont_retry_on=(KeyError,),
        backoff=gentle,
    )
    def pay(account: int, amount: int, *, note: str = "") -> None: ...

    @task(name="app.plain", registry=registry, backoff=ExponentialBackoff(base=2, cap=60))
    def plain() -> None: ...

    pay_decl, plain_decl = catalog.declarations(registry)
    assert (pay_decl.name, pay_decl.max_attempts, pay_decl.queue) == ("app.pay", 3, "money")
    assert pay_decl.execution_mode is ExecutionMode.INLINE and pay_decl.timeout == 9
    assert pay_decl.parameters == ["account", "amount"]
    assert (pay_decl.retry_on, pay_decl.dont_retry_on) == (["Exception"], ["KeyError"])
    assert pay_decl.backoff == f"{__name__}.test_a_worker_declares_what_task_says.<locals>.gentle"
    assert plain_decl.retry_on is None and plain_decl.dont_retry_on == []
    assert plain_decl.backoff == "exponential 2s x2 up to 60s, jittered"
    assert catalog.describe_backoff(FixedBackoff(4)) == "fixed 4s"


def test_a_by_name_request_sends_only_what_was_said() -> None:
    spec = JobSpec(task="app.sync", queue="q")
    request = protocol.JobRequest.from_spec(spec, said={"queue": "q"})
    assert request.queue == "q"
    assert (request.priority, request.max_attempts, request.execution_mode) == (None, None, None)
    whole = protocol.JobRequest.from_spec(spec)
    assert (whole.priority, whole.max_attempts) == (0, 11)
