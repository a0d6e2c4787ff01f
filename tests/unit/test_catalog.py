"""The task catalog's rules (:mod:`broker.core.catalog`), and its store side
(:mod:`broker.main.catalog`) on the memory adapter: a job by name
gets its task's declared defaults where the request says nothing, the newest declaration
wins (with a warning), and an undeclared name is refused once the catalog is in use."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Collection
from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from adapters.memory import MemoryAdapter
from broker.core import catalog
from broker.core.catalog import Catalog, CatalogLimitError
from broker.exceptions import (
    ConfigurationError,
    InvalidArgumentsError,
    InvalidJobError,
    UnknownTaskError,
)
from broker.jobs import ExecutionMode, JobSpec
from broker.main.catalog import StoredCatalog
from broker.main.operations import Operations
from broker.main.settings import MainSettings
from broker.model.bounds import MAX_CATALOG_ENTRIES, MAX_DECLARED_TASKS
from broker.ops.admin.format import format_tasks
from broker.retry import ExponentialBackoff, FixedBackoff
from broker.storage import TaskRecord
from broker.tasks.registry import TaskRegistry, default_unique_key, task, task_defaults
from broker.tasks.schedule import default_schedules
from broker.wire import messages as protocol

NOW = datetime(2030, 1, 1, tzinfo=UTC)


def _declared(name: str = "app.sync", **kw: object) -> protocol.TaskDeclaration:
    return protocol.TaskDeclaration(name=name, **kw)  # type: ignore[arg-type]


def _catalog(*declared: tuple[str, list[protocol.TaskDeclaration]]) -> Catalog:
    found = Catalog()
    for worker, tasks in declared:
        found.record(worker, tasks, NOW)
    return found


async def test_unsaid_fields_take_the_declared_defaults_and_said_ones_win() -> None:
    found = _catalog(
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
    found = _catalog(("w1", [_declared(concurrency_key="acct:{account}", concurrency_limit=1)]))
    with pytest.raises(InvalidJobError, match="needs the argument 'account'"):
        found.job_spec(protocol.JobRequest(task="app.sync"), NOW, allow_unknown=False)


async def test_unknown_names_are_refused_once_the_catalog_is_in_use() -> None:
    empty = _catalog()
    spec = empty.job_spec(protocol.JobRequest(task="app.any"), NOW, allow_unknown=False)
    assert spec == JobSpec(task="app.any", id=spec.id), "not in use yet: broker defaults"
    found = _catalog(("w1", [_declared()]))
    with pytest.raises(UnknownTaskError, match=r"no worker has declared task 'app\.snyc'"):
        found.job_spec(protocol.JobRequest(task="app.snyc"), NOW, allow_unknown=False)
    allowed = found.job_spec(protocol.JobRequest(task="app.snyc"), NOW, allow_unknown=True)
    assert allowed.max_attempts == 11


async def test_the_newest_declaration_wins_and_a_difference_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryAdapter()
    found = StoredCatalog(store)
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
    again = StoredCatalog(store)
    await again.load()
    declared = again.declared("app.sync")
    assert declared is not None and declared.max_attempts == 1
    assert [(r.task, r.worker_id) for r in again.records()] == [
        ("app.sync", "w-new"),
        ("app.sync", "w-old"),
    ]


async def test_refresh_sees_what_another_process_recorded() -> None:
    store = MemoryAdapter()
    mine = StoredCatalog(store)
    await mine.load()
    await store.declare_tasks("w9", {"app.sync": {"name": "app.sync", "queue": "q"}}, NOW)
    assert mine.declared("app.sync") is None
    await mine.refresh({"app.sync"})
    declared = mine.declared("app.sync")
    assert declared is not None and declared.queue == "q"


class _CountingStore(MemoryAdapter):
    """The memory store, counting the catalog rows each read returns."""

    def __init__(self) -> None:
        super().__init__()
        self.rows_read: list[int] = []

    async def task_catalog(
        self, *, tasks: Collection[str] | None = None, limit: int | None = None
    ) -> list[TaskRecord]:
        found = await super().task_catalog(tasks=tasks, limit=limit)
        self.rows_read.append(len(found))
        return found


async def test_an_unknown_name_reads_its_own_rows_never_the_whole_catalog() -> None:
    store = _CountingStore()
    many = {f"app.t{i}": {"name": f"app.t{i}"} for i in range(MAX_DECLARED_TASKS)}
    for worker in range(5):
        await store.declare_tasks(f"w{worker}", many, NOW)
    ops = Operations(store, MainSettings(), clock=lambda: NOW)
    await ops.catalog.load()
    assert store.rows_read == [5 * MAX_DECLARED_TASKS]
    for _ in range(20):
        with pytest.raises(UnknownTaskError):
            await ops.enqueue([protocol.JobRequest(task="app.typo")])
    assert store.rows_read[1:] == [0] * 20, "each unknown name read only its own (no) rows"
    await store.declare_tasks("w9", {"app.new": {"name": "app.new"}}, NOW)
    [result] = await ops.enqueue([protocol.JobRequest(task="app.new")])
    assert result.job.task == "app.new" and store.rows_read[-1] == 1


async def test_a_restarted_catalog_reads_at_most_its_bound_the_most_recent() -> None:
    store = _CountingStore()
    for worker in range(MAX_CATALOG_ENTRIES // MAX_DECLARED_TASKS + 2):
        tasks = {f"app.t{i}": {"name": f"app.t{i}"} for i in range(MAX_DECLARED_TASKS)}
        await store.declare_tasks(f"w{worker:02d}", tasks, NOW + timedelta(seconds=worker))
    found = StoredCatalog(store)
    await found.load()
    assert store.rows_read == [MAX_CATALOG_ENTRIES]
    workers = {r.worker_id for r in found.records()}
    assert "w00" not in workers and "w01" not in workers, "the two oldest workers are left out"


@pytest.mark.parametrize(
    ("tasks", "message"),
    [
        ([_declared(f"app.t{i}") for i in range(MAX_DECLARED_TASKS + 1)], "at most 1000 tasks"),
        ([_declared(parameters=["p" * 100] * 50)], "bytes, over the limit of 4096"),
        (
            [_declared(concurrency_key="{a:>400000000}", concurrency_limit=1, parameters=["a"])],
            "conversion or format spec",
        ),
        ([_declared(concurrency_key="{a!r}", concurrency_limit=1)], "conversion or format spec"),
    ],
)
async def test_a_declaration_over_a_bound_is_refused_whole(
    tasks: list[protocol.TaskDeclaration], message: str
) -> None:
    found = _catalog(("w1", [_declared("app.kept")]))
    with pytest.raises(CatalogLimitError, match=message):
        found.record("w1", tasks, NOW)
    assert [r.task for r in found.records()] == ["app.kept"], "nothing changed"


async def test_the_whole_catalog_is_bounded_and_a_worker_replaces_its_own_share() -> None:
    found = _catalog()
    per_worker = [_declared(f"app.t{i}") for i in range(MAX_DECLARED_TASKS)]
    workers = MAX_CATALOG_ENTRIES // MAX_DECLARED_TASKS
    for worker in range(workers):
        found.record(f"w{worker}", per_worker, NOW)
    with pytest.raises(CatalogLimitError, match="at most 10000 declarations"):
        found.record("one-more", [_declared("app.x")], NOW)
    found.record("w0", [_declared("app.only")], NOW)  # replaces its 1000: room again
    assert {r.task for r in found.records() if r.worker_id == "w0"} == {"app.only"}
    found.record("one-more", [_declared("app.x")], NOW)
    assert len(found.records()) == (workers - 1) * MAX_DECLARED_TASKS + 2


async def test_a_stored_template_with_a_width_is_never_formatted() -> None:
    store = MemoryAdapter()  # as a release before the bound could have stored it
    await store.declare_tasks(
        "w1",
        {
            "app.sync": {
                "name": "app.sync",
                "concurrency_key": "{a:>400000000}",
                "concurrency_limit": 1,
                "parameters": ["a"],
            }
        },
        NOW,
    )
    found = StoredCatalog(store)
    await found.load()
    with pytest.raises(InvalidJobError, match="conversion or format spec"):
        found.job_spec(protocol.JobRequest(task="app.sync", args=[1]), NOW, allow_unknown=False)


async def test_gone_workers_are_forgotten_after_the_grace_connected_ones_never() -> None:
    store = MemoryAdapter()
    found = StoredCatalog(store)
    await found.load()
    found.record("gone", [_declared("app.a"), _declared("app.b")], NOW)
    found.record("live", [_declared("app.a")], NOW)
    for worker in ("gone", "live"):
        await found.save(worker, {"app.a": {"name": "app.a"}}, NOW)
    grace = timedelta(hours=1)
    assert await found.forget({"live"}, NOW + timedelta(minutes=59), grace) == 0
    assert await found.forget({"live"}, NOW + timedelta(hours=2), grace) == 2
    assert [(r.task, r.worker_id) for r in found.records()] == [("app.a", "live")]
    assert found.declared("app.b") is None
    assert [(r.task, r.worker_id) for r in await store.task_catalog()] == [("app.a", "live")]
    # The live worker was seen at each pass: once it goes, the grace runs from then.
    assert await found.forget(set(), NOW + timedelta(hours=2, minutes=59), grace) == 0
    assert await found.forget(set(), NOW + timedelta(hours=3, minutes=1), grace) == 1
    assert not found.in_use and await store.task_catalog() == []


class _SlowForgetting(MemoryAdapter):
    """The memory store, whose ``forget_tasks`` waits until told: the window in which a
    pass of the grace is under way in the store."""

    def __init__(self) -> None:
        super().__init__()
        self.forgetting = asyncio.Event()
        self.go_on = asyncio.Event()

    async def forget_tasks(
        self, live_workers: Collection[str], seen_at: datetime, gone_before: datetime
    ) -> int:
        self.forgetting.set()
        await self.go_on.wait()
        return await super().forget_tasks(live_workers, seen_at, gone_before)


async def test_a_name_dropped_by_a_pass_is_not_read_back_while_the_store_forgets() -> None:
    """An enqueue of a gone worker's name while the pass is deleting its rows reads them
    from the store (:meth:`Catalog.refresh`); the name must still be gone once the pass
    ends, not alive again until the next one (seen under load by the e2e test)."""
    store = _SlowForgetting()
    found = StoredCatalog(store)
    await found.load()
    found.record("gone", [_declared("app.gone")], NOW)
    await found.save("gone", {"app.gone": {"name": "app.gone"}}, NOW)
    passing = asyncio.create_task(found.forget(set(), NOW + timedelta(hours=2), timedelta(hours=1)))
    await store.forgetting.wait()
    await found.refresh({"app.gone"})
    store.go_on.set()
    assert await passing == 1
    assert found.declared("app.gone") is None and not found.in_use
    assert await store.task_catalog() == []


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


def test_a_task_declares_and_schedules_the_defaults_a_job_by_name_takes() -> None:
    """One list of a task's job defaults (``task_defaults``) feeds both its declaration
    and its schedule's ticks, and it is every field the catalog fills in but the unique
    key (each job's own)."""
    registry = TaskRegistry()

    @task(name="app.tick", registry=registry, queue="q", priority=4, every=timedelta(minutes=1))
    def tick() -> None: ...

    defaults = task_defaults(registry.get("app.tick"))
    assert set(defaults) == set(protocol.TASK_DEFAULTS) - {"unique_key", "rate_key"}
    declared = msgspec.to_builtins(catalog.declaration(registry.get("app.tick")))
    assert {name: declared[name] for name in defaults} == msgspec.to_builtins(defaults)
    schedule = default_schedules.get("app.tick")
    default_schedules.discard("app.tick")
    assert {name: getattr(schedule, name) for name in defaults} == defaults


def test_a_by_name_request_sends_only_what_was_said() -> None:
    spec = JobSpec(task="app.sync", queue="q")
    request = protocol.JobRequest.from_spec(spec, said={"queue": "q"})
    assert request.queue == "q"
    assert (request.priority, request.max_attempts, request.execution_mode) == (None, None, None)
    whole = protocol.JobRequest.from_spec(spec)
    assert (whole.priority, whole.max_attempts) == (0, 11)


def test_the_newest_declaration_still_wins_after_a_pass_marks_workers_seen() -> None:
    found = Catalog()
    found.record("w-old", [_declared(queue="old")], NOW)
    found.record("w-new", [_declared(queue="new")], NOW + timedelta(seconds=2))
    found.record("w-gone", [_declared(queue="gone")], NOW + timedelta(seconds=1))
    # Both live workers are seen at the same moment; dropping the gone one decides again.
    found.mark_seen({"w-old", "w-new"}, NOW + timedelta(hours=2))
    assert found.drop_gone({"w-old", "w-new"}, NOW + timedelta(hours=1)) == 1
    declared = found.declared("app.sync")
    assert declared is not None and declared.queue == "new"
    assert {r.seen_at for r in found.records()} == {NOW + timedelta(hours=2)}


@pytest.mark.parametrize(("grace", "rule"), [(0, "positive"), (1e12, "at most a hundred years")])
def test_the_task_grace_is_a_positive_span_a_date_can_hold(grace: float, rule: str) -> None:
    with pytest.raises(ConfigurationError, match=f"task_grace must be {rule}"):
        MainSettings(task_grace=grace).validate()


async def test_by_name_arguments_are_checked_against_the_declared_signature() -> None:
    """A worker declares every parameter of its task's function; the main refuses a job
    whose arguments cannot bind (``invalid_arguments``), and takes the others. A task
    declared without a signature (an earlier release) is not checked."""

    registry = TaskRegistry()

    @task(name="app.sig", registry=registry)
    def sig(account: int, /, full: bool = False, *, mode: str) -> None: ...

    [declared] = catalog.declarations(registry)
    assert declared.signature is not None
    assert [(p.name, p.kind, p.required) for p in declared.signature] == [
        ("account", "positional_only", True),
        ("full", "positional_or_keyword", False),
        ("mode", "keyword_only", True),
    ]
    found = _catalog(("w1", [declared]), ("w0", [_declared("app.old")]))
    fits = protocol.JobRequest(task="app.sig", args=[7, True], kwargs={"mode": "m"})
    assert found.job_spec(fits, NOW, allow_unknown=False).args == (7, True)
    for args, kwargs, problem in [
        ([], {"mode": "m"}, "missing a required argument: 'account'"),
        ([7], {}, "missing a required argument: 'mode'"),
        ([7, True, 3], {"mode": "m"}, "too many positional arguments"),
        ([7], {"mode": "m", "other": 1}, "unexpected keyword argument 'other'"),
    ]:
        bad = protocol.JobRequest(task="app.sig", args=args, kwargs=kwargs)
        for _ in range(2):  # the second time from the shapes kept
            with pytest.raises(InvalidArgumentsError, match=problem) as raised:
                found.job_spec(bad, NOW, allow_unknown=False)
            assert raised.value.code == "invalid_arguments"
            assert "app.sig(account, /, full=None, *, mode)" in str(raised.value)
    anything = protocol.JobRequest(task="app.old", args=[1, 2, 3], kwargs={"x": 1})
    assert found.job_spec(anything, NOW, allow_unknown=False).args == (1, 2, 3)
    cold = protocol.JobRequest(task="app.new", args=[1])
    assert found.job_spec(cold, NOW, allow_unknown=True).args == (1,), "nothing to check"
    odd = _declared(
        "app.odd",
        signature=[
            protocol.ParameterDeclaration("a", "keyword_only", required=False),
            protocol.ParameterDeclaration("a", "keyword_only", required=False),
        ],
    )
    unchecked = _catalog(("w1", [odd]))
    request = protocol.JobRequest(task="app.odd", args=[1])
    assert unchecked.job_spec(request, NOW, allow_unknown=False).args == (1,), (
        "a signature Python could not have made is not checked"
    )


def test_a_workflow_steps_arguments_are_checked_with_its_parents_results_in_front() -> None:
    """A chain's step or a fan-in is enqueued without the argument its parents' results
    will fill in when it becomes due: the check binds that shape, not the bare one."""
    registry = TaskRegistry()

    @task(name="app.step", registry=registry)
    def step(value: int, key: str) -> None: ...

    found = _catalog(("w1", catalog.declarations(registry)))
    parent = uuid.uuid4()
    for mode in ("first_arg", "list_arg"):
        waits = protocol.JobRequest(
            task="app.step", args=["k"], depends_on=[parent], parent_results=mode
        )
        assert found.job_spec(waits, NOW, allow_unknown=False).args == ("k",)
        too_many = protocol.JobRequest(
            task="app.step", args=["k", 1], depends_on=[parent], parent_results=mode
        )
        with pytest.raises(InvalidArgumentsError, match="too many positional arguments"):
            found.job_spec(too_many, NOW, allow_unknown=False)
    plain = protocol.JobRequest(task="app.step", args=["k"], depends_on=[parent])
    with pytest.raises(InvalidArgumentsError, match="missing a required argument: 'key'"):
        found.job_spec(plain, NOW, allow_unknown=False)


def test_a_tasks_rate_limit_is_declared_and_a_bad_one_refused() -> None:
    registry = TaskRegistry()

    @task(name="app.mail", registry=registry, rate_limit="100/s", rate_burst=10)
    def mail() -> None: ...

    @task(name="app.free", registry=registry)
    def free() -> None: ...

    declared = {d.name: d for d in catalog.declarations(registry)}
    assert (declared["app.mail"].rate_limit, declared["app.mail"].rate_burst) == ("100/s", 10)
    assert str(declared["app.mail"].limit()) == "100/s" and declared["app.free"].limit() is None
    wire = msgspec.json.encode(declared["app.mail"])
    assert msgspec.json.decode(wire, type=protocol.TaskDeclaration) == declared["app.mail"]
    for bad in ({"rate_limit": "100/d"}, {"rate_limit": "1/s", "rate_burst": 0}, {"rate_burst": 3}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({"name": "x", **bad}, protocol.TaskDeclaration)
    with pytest.raises(ConfigurationError, match="rate_limit"):
        task(name="app.bad", registry=TaskRegistry(), rate_limit="fast")(mail.func)


def test_broker_tasks_shows_a_rate_limit_column_only_when_some_task_has_one() -> None:
    def entry(**declared: object) -> dict[str, object]:
        return {
            "task": "app.mail",
            "worker_id": "w1",
            "seen_at": "2026-05-01T12:00:00+00:00",
            "connected": True,
            "declaration": {"name": "app.mail", "max_attempts": 1, **declared},
        }

    assert "rate limit" not in format_tasks([entry()])
    shown = format_tasks([entry(rate_limit="100/s", rate_burst=10), entry()])
    assert "RATE LIMIT" in shown.upper() and "100/s (burst 10)" in shown


def test_a_per_key_limit_fills_each_jobs_key_at_enqueue_and_refuses_a_missing_field() -> None:
    """``rate_key`` is filled from the job's arguments once, at enqueue, by a client that
    has the task and by the main for an enqueue by name alike; a job whose arguments
    leave a field unfilled is refused there, naming the field."""
    registry = TaskRegistry()

    @task(name="app.notify", registry=registry, rate_limit="10/s", rate_key="t:{tenant}")
    def notify(message: str, tenant: str = "") -> None: ...

    @task(name="app.open", registry=registry, rate_limit="10/s", rate_key="{tenant}")
    def open_ended(**kwargs: str) -> None: ...

    assert notify.spec(["hi"], {"tenant": "acme"}).rate_key == "t:acme"
    assert notify.spec(["hi", "globex"]).rate_key == "t:globex", "by position too"
    with pytest.raises(InvalidJobError, match=r"rate_key .* needs the argument 'tenant'"):
        open_ended.spec([], {"other": "x"})
    declared = {d.name: d for d in catalog.declarations(registry)}
    assert declared["app.notify"].rate_key == "t:{tenant}"
    found = catalog.Catalog()
    found.record("w1", list(declared.values()), NOW)
    by_name = protocol.JobRequest(task="app.notify", args=["hi"], kwargs={"tenant": "acme"})
    assert found.job_spec(by_name, NOW, allow_unknown=False).rate_key == "t:acme"
    said = protocol.JobRequest(task="app.notify", kwargs={"message": "x"}, rate_key="mine")
    assert found.job_spec(said, NOW, allow_unknown=False).rate_key == "mine", "what a caller says"
    with pytest.raises(InvalidJobError, match="rate_key"):
        found.job_spec(protocol.JobRequest(task="app.open"), NOW, allow_unknown=False)
    with pytest.raises(InvalidJobError, match="at most 200 bytes"):
        notify.spec(["hi"], {"tenant": "x" * 300})
    with pytest.raises(ConfigurationError, match="rate_key needs a rate_limit"):
        task(name="app.bad", registry=TaskRegistry(), rate_key="{tenant}")(notify.func)
    with pytest.raises(ConfigurationError, match=r"rate_key .* names 'who'"):
        task(name="app.bad", registry=TaskRegistry(), rate_limit="1/s", rate_key="{who}")(
            notify.func
        )
    with pytest.raises(msgspec.ValidationError, match="rate_key needs a rate_limit"):
        msgspec.convert({"name": "x", "rate_key": "{t}"}, protocol.TaskDeclaration)
