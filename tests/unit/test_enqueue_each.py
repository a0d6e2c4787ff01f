"""``enqueue_each`` through the main: one job template and a list of argument sets,
decoded into columns (:meth:`broker.core.catalog.Catalog.job_template`), never a spec per
job, holding exactly the jobs that one ``enqueue`` request per argument set would hold
(:meth:`Catalog.job_spec`); refused whole where one of those would be refused.

Hypothesis draws the task's declared defaults and signature, the options the template
says, and argument sets of several shapes (some the signature cannot take)."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters.memory import MemoryAdapter
from broker.core import catalog
from broker.core.catalog import Catalog
from broker.exceptions import (
    InvalidArgumentsError,
    InvalidJobError,
    PayloadTooLargeError,
    UnknownTaskError,
)
from broker.jobs import ExecutionMode, JobSpec, SpecColumns
from broker.main.operations import EACH_CHUNK, Operations
from broker.storage import SupportsEnqueueColumns
from broker.tasks.registry import TaskRegistry, task
from broker.wire import codec
from broker.wire import messages as protocol

NOW = datetime(2030, 1, 1, tzinfo=UTC)
TASK = "app.sig"


def _columns(
    found: Catalog,
    template: protocol.JobRequest,
    arg_sets: list[Any],
    kwarg_sets: list[dict[str, Any]] | None = None,
    *,
    allow_unknown: bool = False,
) -> SpecColumns | None:
    """The jobs of an ``enqueue_each``, as the main makes them: its template once, then
    its argument sets' columns."""
    each = found.job_template(template, NOW, allow_unknown=allow_unknown)
    return None if each is None else each.columns(arg_sets, kwarg_sets)


def _signature() -> list[protocol.ParameterDeclaration]:
    registry = TaskRegistry()

    @task(name=TASK, registry=registry)
    def sig(account: int, /, full: bool = False, *, mode: str = "m") -> None: ...

    [declared] = catalog.declarations(registry)
    assert declared.signature is not None
    return declared.signature


SIGNATURE = _signature()
SHAPES: list[tuple[list[Any], dict[str, Any]]] = [
    ([7], {}),
    ([7, True], {"mode": "x"}),
    ([8], {"full": False}),
    ([], {}),  # missing account
    ([1, 2, 3], {}),  # too many
    ([1], {"other": 1}),  # unexpected keyword
]


@st.composite
def declarations(draw: st.DrawFn) -> protocol.TaskDeclaration:
    keyed = draw(st.booleans())
    return protocol.TaskDeclaration(
        name=TASK,
        execution_mode=draw(st.sampled_from(list(ExecutionMode))),
        queue=draw(st.sampled_from(["default", "q2"])),
        priority=draw(st.integers(-3, 3)),
        max_attempts=draw(st.integers(1, 4)),
        timeout=draw(st.none() | st.just(2.5)),
        concurrency_key="one-key" if keyed else None,
        concurrency_limit=2 if keyed else None,
        parameters=["account", "full", "mode"],
        signature=draw(st.none() | st.just(SIGNATURE)),
    )


@st.composite
def templates(draw: st.DrawFn) -> protocol.JobRequest:
    return protocol.JobRequest(
        task=TASK,
        queue=draw(st.none() | st.just("said")),
        priority=draw(st.none() | st.integers(-2, 2)),
        delay=draw(st.none() | st.just(30.0)),
        max_attempts=draw(st.none() | st.just(9)),
        execution_mode=draw(st.none() | st.sampled_from(list(ExecutionMode))),
    )


@given(declarations(), templates(), st.lists(st.sampled_from(SHAPES), max_size=8))
def test_columns_hold_the_jobs_one_request_each_would(
    declared: protocol.TaskDeclaration,
    template: protocol.JobRequest,
    sets: list[tuple[list[Any], dict[str, Any]]],
) -> None:
    found = Catalog()
    found.record("w1", [declared], NOW)
    arg_sets = [args for args, _ in sets]
    kwarg_sets = [kwargs for _, kwargs in sets]
    try:
        each = [
            found.job_spec(
                msgspec.structs.replace(template, args=args, kwargs=kwargs),
                NOW,
                allow_unknown=False,
            )
            for args, kwargs in sets
        ]
    except InvalidArgumentsError as refused:
        with pytest.raises(InvalidArgumentsError) as caught:
            _columns(found, template, arg_sets, kwarg_sets)
        assert str(caught.value).split(": ")[0] == str(refused).split(": ")[0]
        return
    jobs = _columns(found, template, arg_sets, kwarg_sets)
    assert jobs is not None
    assert jobs.specs() == [
        dataclasses.replace(spec, id=job_id) for spec, job_id in zip(each, jobs.ids, strict=True)
    ]
    if not any(kwarg_sets):  # without keyword sets: the same jobs
        plain = _columns(found, template, arg_sets)
        assert plain is not None and [s.args for s in plain.specs()] == [tuple(a) for a in arg_sets]


@pytest.mark.parametrize(
    "declared",
    [
        protocol.TaskDeclaration(
            name=TASK, concurrency_key="acct:{account}", concurrency_limit=1, parameters=["account"]
        ),
        protocol.TaskDeclaration(name=TASK, unique=True),
        protocol.TaskDeclaration(
            name=TASK, rate_limit="10/s", rate_key="{account}", parameters=["account"]
        ),
    ],
    ids=["concurrency key template", "unique", "rate key template"],
)
def test_a_key_made_from_each_jobs_arguments_sends_them_one_request_each(
    declared: protocol.TaskDeclaration,
) -> None:
    found = Catalog()
    found.record("w1", [declared], NOW)
    template = protocol.JobRequest(task=TASK)
    assert _columns(found, template, [[1], [2]]) is None
    constant = protocol.JobRequest(
        task=TASK, concurrency_key="k", concurrency_limit=1, rate_key="r"
    )
    if declared.unique:
        assert _columns(found, constant, [[1]]) is None
    else:  # every key the task would make from the arguments is said: columns
        assert _columns(found, constant, [[1]]) is not None


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        (protocol.JobRequest(task=TASK, args=[1]), "carries no args or kwargs"),
        (protocol.JobRequest(task=TASK, kwargs={"a": 1}), "carries no args or kwargs"),
        (protocol.JobRequest(task=TASK, idempotency_key="i"), "names one job"),
        (protocol.JobRequest(task=TASK, unique_key="u"), "names one job"),
        (protocol.JobRequest(task=TASK, depends_on=(uuid.uuid4(),)), "depends_on"),
    ],
)
@pytest.mark.parametrize("unique", [False, True], ids=["by column", "one request each"])
def test_a_template_of_one_job_is_refused_either_way(
    template: protocol.JobRequest, problem: str, unique: bool
) -> None:
    found = Catalog()
    found.record("w1", [protocol.TaskDeclaration(name=TASK, unique=unique)], NOW)
    with pytest.raises(InvalidJobError, match=problem):
        _columns(found, template, [[1]])


def test_an_unknown_task_is_refused_unless_allowed() -> None:
    found = Catalog()
    found.record("w1", [protocol.TaskDeclaration(name="other")], NOW)
    template = protocol.JobRequest(task=TASK)
    with pytest.raises(UnknownTaskError):
        _columns(found, template, [[1]])
    jobs = _columns(found, template, [[1]], allow_unknown=True)
    assert jobs is not None and jobs.template.task == TASK


# ------------------------------------------------------------------------ the service


class _Limits:
    max_payload_bytes: int | None = 1000
    max_payload_depth: int = 8
    max_payload_containers: int = 100
    max_line_bytes: int = 100_000
    list_page_bytes: int = 100_000


class _ColumnStore(MemoryAdapter):
    """The memory store, as a store that takes columns: what it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.columns: list[SpecColumns] = []

    async def enqueue_columns(self, chunks: Iterator[SpecColumns], count: int) -> list[uuid.UUID]:
        taken = list(chunks)
        assert sum(map(len, taken)) == count
        self.columns += taken
        return [r.job_id for r in await self.enqueue_many([s for c in taken for s in c.specs()])]


@pytest.mark.parametrize("by_column", [False, True], ids=["one spec each", "by column"])
async def test_the_service_stores_all_or_none_with_the_main_limits(by_column: bool) -> None:
    store = _ColumnStore() if by_column else MemoryAdapter()
    assert isinstance(store, SupportsEnqueueColumns) is by_column
    ops = Operations(store, _Limits(), clock=lambda: NOW)
    template = protocol.JobRequest(task="t", priority=4, delay=60.0)
    ids = await ops.enqueue_each(template, [[1], [2], [3]], allow_unknown_tasks=True)
    jobs = [await store.get_job(i) for i in ids]
    assert [(j.args, j.priority, j.run_at) for j in jobs if j is not None] == [
        ((n,), 4, NOW + timedelta(seconds=60)) for n in (1, 2, 3)
    ]
    deep: list[Any] = [1]
    for _ in range(10):
        deep = [deep]
    for bad, refusal in [
        ([[1], ["x" * 2000]], PayloadTooLargeError),  # over the payload limit
        ([[1], deep], InvalidJobError),  # deeper than the main's depth
        ([[1], [float("nan")]], InvalidJobError),  # not JSON
    ]:
        with pytest.raises(refusal):
            await ops.enqueue_each(template, bad, allow_unknown_tasks=True)
    assert len((await store.list_jobs(limit=10)).jobs) == 3, "nothing of a refused request"
    if isinstance(store, _ColumnStore):
        assert [len(c) for c in store.columns] == [3]


async def test_a_unique_task_goes_one_request_each_and_returns_the_active_holder() -> None:
    store = _ColumnStore()
    ops = Operations(store, _Limits(), clock=lambda: NOW)
    ops.catalog.record("w1", [protocol.TaskDeclaration(name="u", unique=True)], NOW)
    # A template's id names no job: each gets its own.
    first = await ops.enqueue_each(protocol.JobRequest(task="u", id=uuid.uuid4()), [[1], [2]])
    assert len(set(first)) == 2
    again = await ops.enqueue_each(protocol.JobRequest(task="u"), [[2], [3]])
    assert again[0] == first[1] and again[1] not in first
    assert store.columns == [], "never by column"


# ------------------------------------------------------------------------ the wire


def test_the_request_and_its_reply_round_trip_and_an_older_welcome_has_no_features() -> None:
    request = protocol.EnqueueEach(
        request_id="r1",
        job=protocol.JobRequest(task="t", priority=2),
        arg_sets=[(1,), ("a", None)],
        kwarg_sets=[{}, {"k": [1]}],
    )
    decoded = codec.decode(codec.encode(request))
    assert decoded == request
    assert isinstance(decoded, protocol.EnqueueEach) and decoded.arg_sets[1] == ("a", None)
    reply = protocol.EnqueuedEach(request_id="r1", job_ids=[uuid.UUID(int=1)])
    assert codec.decode(codec.encode(reply)) == reply
    welcome = protocol.Welcome(
        main_id="m", protocol=3, ping_interval=5.0, adopted=[], max_line_bytes=100
    )
    older = codec.encode(welcome).replace(b',"features":[]', b"")  # as an older main's
    assert b"features" not in older
    decoded_welcome = codec.decode(older)
    assert isinstance(decoded_welcome, protocol.Welcome) and decoded_welcome.features == []


def test_a_template_spec_checks_once_what_many_jobs_cannot_share() -> None:
    with pytest.raises(InvalidJobError, match="names one job"):
        SpecColumns.check_template(JobSpec("t", idempotency_key="k"))
    SpecColumns.check_template(JobSpec("t", concurrency_key="k", concurrency_limit=1))


async def test_a_large_request_is_made_and_checked_a_chunk_at_a_time() -> None:
    """The store takes the jobs :data:`EACH_CHUNK` at a time, each made and checked as it
    is taken; a bad job in the last chunk refuses the whole request."""
    store = _ColumnStore()
    ops = Operations(store, _Limits(), clock=lambda: NOW)
    count = 2 * EACH_CHUNK + 5
    ids = await ops.enqueue_each(
        protocol.JobRequest(task="t"), [[i] for i in range(count)], allow_unknown_tasks=True
    )
    assert [len(c) for c in store.columns] == [EACH_CHUNK, EACH_CHUNK, 5]
    assert ids == [i for c in store.columns for i in c.ids] and len(set(ids)) == count
    bad = [[i] for i in range(count - 1)] + [["x" * 2000]]
    with pytest.raises(PayloadTooLargeError):
        await ops.enqueue_each(protocol.JobRequest(task="t"), bad, allow_unknown_tasks=True)
    assert len((await store.list_jobs(limit=count + 1)).jobs) == count
