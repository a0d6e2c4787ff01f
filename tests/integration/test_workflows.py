"""Chains, groups and fan-in through a real main over real TCP, on the memory store and a
SQLite file: the client enqueues a workflow in one request, the main hands each step out
only once its parents completed, with their results first in its arguments, and a step
whose arguments could never bind is refused before anything is stored."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from adapters.memory import MemoryAdapter
from broker import (
    ConfigurationError,
    EnqueuedWorkflow,
    InvalidJobError,
    JobFailedError,
    chain,
    group,
)
from broker.client.client import Client
from broker.client.sync import SyncClient
from broker.jobs import JobSpec, JobStatus, Outcome, Settlement
from broker.storage import JobFilter, StorageAdapter
from broker.tasks.registry import TaskRegistry, task
from broker.tasks.workflow import workflow_specs
from broker.wire import messages as protocol
from broker.wire.credentials import role_needed
from tests.conftest import POSTGRES_URL
from tests.integration.test_operator import _cli, _cli_json, _closed_port
from tests.support import FAST, FakeWorker, running_main, until

registry = TaskRegistry()


@task(name="wf.add", registry=registry)
def add(a: int, b: int) -> int:
    return a + b


@task(name="wf.total", registry=registry)
def total(values: list[int], offset: int = 0) -> int:
    return sum(values) + offset


def _sqlite(tmp_path: Path) -> StorageAdapter:
    from adapters.sql import SQLAlchemyAdapter

    return SQLAlchemyAdapter(f"sqlite:///{tmp_path / 'wf.db'}")


STORES: dict[str, Callable[[Path], StorageAdapter]] = {
    "memory": lambda _: MemoryAdapter(),
    "sqlite": _sqlite,
}


@pytest.fixture(params=["memory", "sqlite", "postgres"])
async def any_store(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[StorageAdapter]:
    """The workflow reads and notices on every adapter, PostgreSQL in an empty schema."""
    if request.param != "postgres":
        yield STORES[request.param](tmp_path)
        return
    from adapters.sql import SQLAlchemyAdapter

    yield SQLAlchemyAdapter(POSTGRES_URL, schema=request.getfixturevalue("pg_schema"))


def _run(job: Any) -> Any:
    """What the test's worker computes for a job: the task called on its arguments."""
    tasks: dict[str, Callable[..., int]] = {"wf.add": add, "wf.total": total}
    return tasks[job.task](*job.args, **job.kwargs)


async def _drain(worker: FakeWorker, jobs: int) -> list[str]:
    """Run ``jobs`` jobs, one at a time; the tasks in the order they were handed out."""
    order = []
    for _ in range(jobs):
        await worker.ready(pooled=1)
        job = await worker.next_job()
        order.append(job.task)
        ack = await worker.complete(job, _run(job))
        assert ack.status == "applied", ack
    return order


@pytest.mark.parametrize("store_kind", list(STORES))
async def test_a_chain_runs_step_by_step_with_each_result(store_kind: str, tmp_path: Path) -> None:
    """A step is handed out once the settle of its parent made it due, not at the next
    poll: the main polls once an hour here, so on SQLite (no notifications) only the
    store's due notice (``SupportsDueNotice``) moves the chain on."""
    store = STORES[store_kind](tmp_path)
    hourly = dataclasses.replace(FAST, poll_interval=3600.0)
    async with running_main(store, hourly) as main, Client("127.0.0.1", main.port) as client:
        worker = FakeWorker(main.port)
        await worker.connect()
        try:
            steps = [add.bind(1, 2), *(add.bind(10) for _ in range(19))]
            flow = await client.enqueue_workflow(chain(*steps))
            assert isinstance(flow, EnqueuedWorkflow) and len(flow.job_ids) == 20
            assert flow.final_job_id == flow.job_ids[-1]
            later = await store.get_job(flow.job_ids[1])
            assert later is not None and later.status is JobStatus.WAITING
            await _drain(worker, 20)
            assert flow.final_job_id is not None
            final = await client.wait(flow.final_job_id)
            assert (final["status"], final["result"]) == ("completed", 3 + 19 * 10)
        finally:
            await worker.close()


@pytest.mark.parametrize("store_kind", list(STORES))
async def test_a_fan_in_runs_once_over_every_result_in_group_order(
    store_kind: str, tmp_path: Path
) -> None:
    store = STORES[store_kind](tmp_path)
    async with running_main(store) as main, Client("127.0.0.1", main.port) as client:
        worker = FakeWorker(main.port)
        await worker.connect()
        try:
            members = group(add.bind(i, 1000) for i in range(12))
            flow = await client.enqueue_workflow(members.then(total.bind(offset=5)))
            order = await _drain(worker, 13)
            assert order[-1] == "wf.total" and order.count("wf.total") == 1
            assert flow.final_job_id is not None
            final = await client.wait(flow.final_job_id)
            assert final["args"] == [[1000 + i for i in range(12)]]
            assert final["result"] == sum(1000 + i for i in range(12)) + 5
            jobs = (await store.list_jobs(JobFilter(), limit=100)).jobs
            assert len(jobs) == 13
        finally:
            await worker.close()


async def test_a_step_that_cannot_bind_is_refused_before_anything_is_stored() -> None:
    store = MemoryAdapter()
    async with running_main(store) as main, Client("127.0.0.1", main.port) as client:
        with pytest.raises(TypeError, match=r"wf\.add"):
            await client.enqueue_workflow(chain(add.bind(1, 2), add.bind(1, 2)))
        with pytest.raises(InvalidJobError, match="at most 100 steps"):
            chain(*(add.bind(1) for _ in range(101)))
        assert (await store.list_jobs(JobFilter())).jobs == []


async def test_an_unknown_parent_is_refused_and_the_main_serves_on() -> None:
    store = MemoryAdapter()
    async with running_main(store) as main, Client("127.0.0.1", main.port) as client:
        with pytest.raises(InvalidJobError, match="not in the store"):
            await client.enqueue_spec(JobSpec("wf.add", args=[1, 2], depends_on=(uuid.uuid4(),)))
        parent = await client.enqueue_spec(JobSpec("wf.add", args=[1, 2]))
        child = await client.enqueue_spec(JobSpec("wf.add", args=[1], depends_on=(parent.job_id,)))
        stored = await store.get_job(child.job_id)
        assert stored is not None and stored.status is JobStatus.WAITING


async def test_cancelling_a_workflow_cancels_every_job_not_finished() -> None:
    store = MemoryAdapter()
    async with running_main(store) as main, Client("127.0.0.1", main.port) as client:
        worker = FakeWorker(main.port)
        await worker.connect()
        try:
            members = group([add.bind(1, 2), add.bind(3, 4)])
            flow = await client.enqueue_workflow(members.then(total.bind().run_anyway()))
            await worker.ready(pooled=1)
            first = await worker.next_job()
            assert (await worker.complete(first, _run(first))).status == "applied"
            jobs = await client.cancel_workflow(flow)
            statuses = [j["status"] for j in jobs]
            assert statuses.count("completed") == 1 and statuses.count("cancelled") == 2
            final = await store.get_job(flow.job_ids[-1])
            assert final is not None and final.status is JobStatus.CANCELLED
        finally:
            await worker.close()


async def _fail(worker: FakeWorker, job: Any, error: str = "ValueError: no\nTraceback...") -> None:
    """Fail ``job`` for good (no retry)."""
    report = protocol.FailedReport(
        job_id=job.job_id, handoff_id=job.handoff_id, error=error, retry=False
    )
    assert (await worker.report(report)).status == "applied"


async def test_a_workflow_is_read_and_its_failed_member_retried_once(
    any_store: StorageAdapter, tmp_path: Path
) -> None:
    """``get_workflow`` shows members (parents first), edges and a derived status; a
    failed member's fan-in is cancelled naming it; ``retry_workflow`` runs the member
    again and its fan-in waits for it again, then runs once with every result."""
    store = any_store
    async with (
        running_main(store) as main,
        Client("127.0.0.1", main.port) as client,
        Client("127.0.0.1", main.port, role=protocol.Role.OPERATOR) as operator,
    ):
        worker = FakeWorker(main.port)
        await worker.connect()
        try:
            flow = await client.enqueue_workflow(
                group(add.bind(i, 10) for i in range(3)).then(total.bind())
            )
            view = await client.get_workflow(flow)
            assert view is not None and view.status == "running"
            assert [m.job_id for m in view.members] == list(flow.job_ids)
            assert [m.task for m in view.members] == ["wf.add"] * 3 + ["wf.total"]
            assert view.parents(flow.job_ids[-1]) == list(flow.job_ids[:3])
            assert await client.get_workflow(uuid.uuid4()) is None
            failed = None
            for _ in range(3):
                await worker.ready(pooled=1)
                job = await worker.next_job()
                if job.job_id == flow.job_ids[1]:
                    failed = job
                    await _fail(worker, job)
                else:
                    assert (await worker.complete(job, _run(job))).status == "applied"
            assert failed is not None
            view = await client.get_workflow(flow.workflow_id)
            assert view is not None and view.status == "failed"
            member = view.member(flow.job_ids[1])
            assert member is not None and member.error == "ValueError: no"
            final = view.member(flow.job_ids[-1])
            assert final is not None and final.status is JobStatus.CANCELLED
            assert (
                role_needed(protocol.RetryWorkflow(request_id="r", workflow_id=flow.workflow_id))
                is protocol.Role.OPERATOR
            )
            view = await operator.retry_workflow(flow)
            assert view is not None and view.status == "running"
            statuses = {m.job_id: m.status for m in view.members}
            assert statuses[flow.job_ids[1]] is JobStatus.QUEUED
            assert statuses[flow.job_ids[-1]] is JobStatus.WAITING
            order = await _drain(worker, 2)
            assert order == ["wf.add", "wf.total"]
            assert await flow.result(timeout=15) == sum(i + 10 for i in range(3))
            view = await client.get_workflow(flow)
            assert view is not None and view.status == "completed"
        finally:
            await worker.close()


async def test_a_handle_result_is_decoded_or_raises_for_a_job_that_failed() -> None:
    """``result()`` on a checked enqueue's handle waits for the pushed end and returns the
    result; a dead job raises ``JobFailedError`` naming its status and error."""
    store = MemoryAdapter()
    async with running_main(store) as main, Client("127.0.0.1", main.port) as client:
        worker = FakeWorker(main.port)
        await worker.connect()
        try:
            handle = await add.options(client=client).enqueue(2, 3)
            assert handle.task is add and handle.client is client
            waiting = asyncio.create_task(handle.result(timeout=15))
            await worker.ready(pooled=1)
            job = await worker.next_job()
            assert (await worker.complete(job, _run(job))).status == "applied"
            assert await waiting == 5
            doomed = await client.enqueue(add, [1, 1])
            await worker.ready(pooled=1)
            await _fail(worker, await worker.next_job(), "boom")
            with pytest.raises(JobFailedError, match="ended failed: boom") as raised:
                await doomed.result(timeout=15)
            assert raised.value.status == "failed" and raised.value.job_id == doomed.job_id
            with pytest.raises(ConfigurationError, match="result_sync"):
                await dataclasses.replace(doomed, client=None).result()
        finally:
            await worker.close()


async def test_a_waiter_on_a_dependent_is_answered_when_its_parent_fails(
    any_store: StorageAdapter,
) -> None:
    """The dependents a parent's failure cancels, inside its settle, are notified to the
    main's waiters at once (``SupportsEndNotice``), not at the wait's expiry: the wait
    here would last an hour."""
    store = any_store
    async with running_main(store) as main, Client("127.0.0.1", main.port) as client:
        worker = FakeWorker(main.port)
        await worker.connect()
        try:
            flow = await client.enqueue_workflow(chain(add.bind(1, 2), add.bind(1), add.bind(1)))
            assert flow.final is not None
            waiting = asyncio.create_task(flow.result(timeout=3600))
            await until(lambda: main.waits.waiters.waited_on([flow.job_ids[-1]]))
            await worker.ready(pooled=1)
            await _fail(worker, await worker.next_job(), "down")
            with pytest.raises(JobFailedError, match="ended cancelled: parent job") as raised:
                await asyncio.wait_for(waiting, 15)
            assert raised.value.status == "cancelled"
            # A cancel of the first step reaches the last step's waiter the same way.
            flow = await client.enqueue_workflow(chain(add.bind(1, 2), add.bind(1), add.bind(1)))
            waiting = asyncio.create_task(flow.result(timeout=3600))
            await until(lambda: main.waits.waiters.waited_on([flow.job_ids[-1]]))
            await client.cancel(flow.job_ids[0])
            with pytest.raises(JobFailedError, match="ended cancelled: parent job"):
                await asyncio.wait_for(waiting, 15)
        finally:
            await worker.close()


async def test_the_operator_command_shows_and_retries_a_workflow_on_the_store(
    tmp_path: Path,
) -> None:
    """``broker workflow ID`` (a table, or ``--json``) and ``broker workflow retry ID``
    with the main down, on the store itself (``--database-url``)."""
    url = f"sqlite:///{tmp_path / 'ops.db'}"
    store = STORES["sqlite"](tmp_path)
    store = type(store)(url)
    await store.setup()
    try:
        specs = workflow_specs(chain(add.bind(1, 2), add.bind(1)))
        await store.enqueue_many(specs)
        lease = uuid.uuid4()
        assert await store.mark_handed_off(specs[0].id, lease, "w") is not None
        [ok] = await store.settle_many(
            [Settlement(specs[0].id, lease, Outcome.FAIL, error="KeyError: 'x'\nTraceback")]
        )
        assert ok
    finally:
        await store.close()
    workflow_id = str(specs[0].workflow_id)
    base = ("--main", f"127.0.0.1:{_closed_port()}", "--database-url", url)
    code, out, err = await _cli(*base, "workflow", workflow_id)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"workflow {workflow_id}  failed  2 jobs"
    assert lines[1].split() == ["JOB", "TASK", "STATUS", "ATTEMPTS", "PARENTS", "ERROR"]
    assert lines[2].split()[:5] == [str(specs[0].id), "wf.add", "failed", "1", "-"]
    assert "KeyError: 'x'" in lines[2] and "Traceback" not in out
    assert lines[3].split()[:5] == [
        str(specs[1].id),
        "wf.add",
        "cancelled",
        "0",
        str(specs[0].id)[:8],
    ]
    view = await _cli_json(*base, "workflow", str(specs[1].id))  # a member's id names it too
    assert view["workflow_id"] == workflow_id and view["status"] == "failed"
    assert view["edges"] == [{"parent": str(specs[0].id), "child": str(specs[1].id), "done": True}]
    view = await _cli_json(*base, "workflow", "retry", workflow_id)
    assert [m["status"] for m in view["members"]] == ["queued", "waiting"]
    code, _, err = await _cli(*base, "workflow", str(uuid.uuid4()))
    assert (code, err.strip().splitlines()[-1]) == (1, "no such workflow")


async def test_a_sync_handle_waits_through_its_sync_client() -> None:
    """A ``SyncClient``'s handles (a task's, a workflow's final one) wait with
    ``result_sync``; a cancelled workflow's result raises ``JobFailedError``, and an
    async ``result()`` on a sync handle says which to call."""
    async with running_main(MemoryAdapter()) as main:

        def talk() -> None:
            with SyncClient("127.0.0.1", main.port) as client:
                handle = add.options(client=client).enqueue_sync(1, 2)
                assert handle.client is client and handle.task is add
                flow = client.enqueue_workflow(chain(add.bind(1, 2), add.bind(1)))
                assert flow.final is not None and flow.final.client is client
                view = client.get_workflow(flow)
                assert view is not None and [m.status for m in view.members] == [
                    JobStatus.QUEUED,
                    JobStatus.WAITING,
                ]
                client.cancel_workflow(flow)
                with pytest.raises(JobFailedError, match="ended cancelled") as raised:
                    flow.result_sync(timeout=15)
                assert raised.value.status == "cancelled"
                with pytest.raises(ConfigurationError, match="result_sync"):
                    asyncio.run(handle.result(timeout=1))

        await asyncio.to_thread(talk)
