"""Everyday features end to end on both real stores: SQLite files and PostgreSQL."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from adapters.sql import SQLAlchemyAdapter
from broker.client import Client
from broker.exceptions import InvalidArgumentsError, PayloadTooLargeError
from broker.jobs import ExecutionMode, Job, JobSpec, JobStatus, utcnow
from broker.model.bounds import MESSAGE_CONTAINERS
from broker.storage import StorageAdapter
from broker.testing.faults import FaultyAdapter
from tests.conftest import POSTGRES_URL
from tests.e2e.test_pooled import APP, Cluster, cluster
from tests.support import until

pytestmark = pytest.mark.slow


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StorageAdapter]:
    if request.param == "sqlite":
        adapter = SQLAlchemyAdapter(f"sqlite+aiosqlite:///{tmp_path / 'features.db'}")
        yield adapter
        return
    yield SQLAlchemyAdapter(POSTGRES_URL, schema=request.getfixturevalue("pg_schema"))


class _CountingSelects(FaultyAdapter):
    def __init__(self, inner: StorageAdapter) -> None:
        super().__init__(inner)
        self.selects = 0

    async def select_eligible(self, **kw: Any) -> Any:
        self.selects += 1
        return await self.inner.select_eligible(**kw)


async def _one_free_slot(c: Cluster) -> bool:
    """The worker is connected and ready for one pooled job, as ``broker status`` shows it."""
    workers = (await c.main.status())["workers"]
    return len(workers) == 1 and workers[0]["credits"].get(ExecutionMode.POOLED.value) == 1


async def _status(store: StorageAdapter, job_id: Any) -> JobStatus:
    job = await store.get_job(job_id)
    assert job is not None
    return job.status


async def test_a_scheduled_job_waits_for_its_time_then_runs(store: StorageAdapter) -> None:
    async with cluster(store=store, pooled_runner_count=1, forked_concurrency=0) as c:
        await until(lambda: _one_free_slot(c))
        [job] = await c.enqueue("whoami", run_at=utcnow() + timedelta(seconds=1.0))
        [done] = await c.settled([job], timeout=10)
        assert done.status is JobStatus.COMPLETED
        # Not started before its time: handed off at or after run_at (the main keeps
        # the real clock, which set run_at).
        assert done.handed_off_at is not None and done.handed_off_at >= done.run_at


async def test_a_job_an_hour_ahead_does_not_wake_the_main(store: StorageAdapter) -> None:
    counting = _CountingSelects(store)
    async with cluster(store=counting, pooled_runner_count=1, forked_concurrency=0) as c:  # type: ignore[arg-type]
        await until(lambda: _one_free_slot(c))
        [job] = await c.enqueue("whoami", run_at=utcnow() + timedelta(hours=1))
        await asyncio.sleep(0.3)
        before = counting.selects
        await asyncio.sleep(2.0)
        woke = counting.selects - before
        assert await _status(store, job.id) is JobStatus.QUEUED
        if store.capabilities.listen_notify:
            assert woke == 0, f"the main woke {woke} times for a job an hour away"
        else:
            # SQLite cannot notify, so the main polls for other processes' inserts at its
            # poll interval: a few cheap reads, never a busy loop and never an early start.
            assert woke <= 2.0 / c.main.settings.poll_interval + 2, woke


async def test_cancelling_a_running_pooled_job_stops_it_on_both_stores(
    store: StorageAdapter,
) -> None:
    async with cluster(store=store, pooled_runner_count=1, forked_concurrency=0) as c:
        [job] = await c.enqueue("nap", 60.0)

        async def busy_pid() -> int | None:
            kids = c.pool.status().details["children"]
            return next((k["pid"] for k in kids if k["ready"] and k["busy"]), None)

        pid = await until(busy_pid)
        async with Client("127.0.0.1", c.main.port) as client:
            cancelled = await client.cancel(job.id)
        assert cancelled is not None and cancelled["status"] == JobStatus.CANCELLED

        async def gone() -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            return False

        await until(gone, timeout=10)
        await until(lambda: _async(c.worker.status()["outbox"] == 0), timeout=10)
        after = await store.get_job(job.id)
        assert after is not None and after.status is JobStatus.CANCELLED
        assert after.result is None and after.attempts == 0, "the late report changed nothing"


async def test_an_oversized_job_is_refused_and_nothing_is_written(store: StorageAdapter) -> None:
    async with cluster(store=store, pooled_runner_count=1, forked_concurrency=0) as c:
        from broker.wire import messages as protocol

        big = "x" * (c.main.settings.max_payload_bytes + 10)
        async with Client("127.0.0.1", c.main.port) as client:
            with pytest.raises(Exception) as caught:
                await client.enqueue_requests(
                    [
                        protocol.JobRequest(task=f"{APP}.noop"),
                        protocol.JobRequest(task=f"{APP}.noisy", args=[big]),
                    ]
                )
        assert "over the payload limit" in str(caught.value)
        page = await store.list_jobs(limit=10)
        assert page.jobs == [], "the whole batch was refused"


async def test_a_worker_serves_only_its_queues_and_takes_higher_priority_first(
    store: StorageAdapter,
) -> None:
    async with cluster(
        store=store, queues=["reports"], pooled_runner_count=1, forked_concurrency=0
    ) as c:
        await until(lambda: _one_free_slot(c))
        # One batch, so the dispatcher sees all three at once and must choose.
        other, low, high = [
            r.job
            for r in await store.enqueue_many(
                [
                    JobSpec(task=f"{APP}.whoami", queue="mail"),
                    JobSpec(task=f"{APP}.whoami", queue="reports", priority=0),
                    JobSpec(task=f"{APP}.whoami", queue="reports", priority=9),
                ]
            )
        ]
        c.main.wake()
        done = await c.settled([low, high], timeout=15)
        assert all(j.status is JobStatus.COMPLETED for j in done)
        low_done, high_done = done
        assert high_done.handed_off_at is not None and low_done.handed_off_at is not None
        assert high_done.handed_off_at <= low_done.handed_off_at, "priority 9 went first"
        assert await _status(store, other.id) is JobStatus.QUEUED, "mail is not served here"


async def _async(value: Any) -> Any:
    return value


async def test_enqueue_each_stores_every_job_by_column_and_runs_them(
    store: StorageAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One task and its options once, twenty argument sets: every job stored with the
    task's declared defaults (its mode) and the options given, in order, and run; to a
    main whose welcome does not list the request, the same jobs go as one ``enqueue``."""
    async with cluster(store=store, pooled_runner_count=1, forked_concurrency=0) as c:
        await until(lambda: _one_free_slot(c))
        texts = [f"line {i}" for i in range(20)]
        async with Client("127.0.0.1", c.main.port) as client:
            ids = await client.enqueue_each(f"{APP}.noisy", [[t] for t in texts[:10]], priority=3)
            client._features = frozenset()  # as an older main's welcome leaves them

            async def unknown(*args: Any, **kw: Any) -> Any:
                raise AssertionError("enqueue_each sent to a main that does not list it")

            monkeypatch.setattr(c.main.operations, "enqueue_each", unknown)
            ids += await client.enqueue_each(f"{APP}.noisy", [[t] for t in texts[10:]], priority=3)
        assert len(set(ids)) == 20
        done = await c.settled([await _stored(store, i) for i in ids], timeout=30)
        assert [j.result for j in done] == texts
        assert {(j.status, j.priority, j.execution_mode) for j in done} == {
            (JobStatus.COMPLETED, 3, ExecutionMode.POOLED)
        }, "the options given, and the task's declared mode for the rest"


async def test_enqueue_each_refuses_the_whole_request_and_stores_nothing(
    store: StorageAdapter,
) -> None:
    """An argument set the declared signature cannot take, a job over the payload
    limit, and a request over the main's container bound (sent by a client that does
    not check it first) are each refused with their own error; nothing is stored."""
    async with cluster(store=store, pooled_runner_count=1, forked_concurrency=0) as c:
        await until(lambda: _one_free_slot(c))
        big = "x" * (c.main.settings.max_payload_bytes + 10)
        over = c.main.settings.max_payload_containers + MESSAGE_CONTAINERS + 1
        async with Client("127.0.0.1", c.main.port) as client:
            with pytest.raises(InvalidArgumentsError):
                await client.enqueue_each(f"{APP}.noisy", [["a"], ["b", "extra"]])
            with pytest.raises(PayloadTooLargeError, match="over the payload limit"):
                await client.enqueue_each(f"{APP}.noisy", [["a"], [big]])
            with pytest.raises(PayloadTooLargeError, match="lists and objects"):
                await client.enqueue_each(f"{APP}.noisy", [["a"]] * over)
            client._max_containers = None  # as a client that does not check would send
            with pytest.raises(PayloadTooLargeError, match="lists and objects"):
                await client.enqueue_each(f"{APP}.noisy", [["a"]] * over)
            assert await client.enqueue_each(f"{APP}.noisy", [["fine"]]), "still connected"
        page = await store.list_jobs(limit=10)
        assert len(page.jobs) == 1, "only the last request's one job"


async def _stored(store: StorageAdapter, job_id: Any) -> Job:
    job = await store.get_job(job_id)
    assert job is not None
    return job


async def test_an_enqueue_after_enqueue_each_is_not_handed_off_ahead_of_its_jobs(
    store: StorageAdapter,
) -> None:
    """The bulk jobs pass by the hand-off at enqueue, and the main tells its dispatcher
    before it replies: a lower-priority job enqueued right after, while a slot is free,
    is not handed off at once ahead of them (the dispatcher's read-ahead, which knew
    nothing of them, is dropped), but dispatched in priority order after them."""
    async with cluster(store=store, pooled_runner_count=1, forked_concurrency=0) as c:
        await until(lambda: _one_free_slot(c))
        async with Client("127.0.0.1", c.main.port) as client:
            bulk = await client.enqueue_each(f"{APP}.noisy", [["a"], ["b"], ["c"]], priority=5)
            later = await client.enqueue(f"{APP}.noisy", ["later"], priority=0)
        done = await c.settled([await _stored(store, i) for i in [*bulk, later.job_id]])
        started = [j.handed_off_at for j in done]
        assert all(t is not None for t in started)
        assert max(started[:3]) <= started[3], "the later, lower-priority job ran last"  # type: ignore[type-var]


async def test_enqueue_each_of_many_chunks_with_a_payload_to_offload_stores_every_job(
    store: StorageAdapter,
) -> None:
    """1,500 jobs (two chunks, one transaction on PostgreSQL), the last one's argument
    large enough to move out of its row there: the chunk insert gives way to the careful
    one, one spec each, and every job is stored as given."""
    async with cluster(store=store, pooled_runner_count=0, forked_concurrency=0) as c:
        arg_sets: list[list[Any]] = [[f"t{i}"] for i in range(1499)] + [["x" * 70_000]]
        async with Client("127.0.0.1", c.main.port) as client:
            ids = await client.enqueue_each(f"{APP}.noisy", arg_sets)
        assert len(set(ids)) == 1500
        for at in (0, 1000, 1499):
            assert (await _stored(store, ids[at])).args == tuple(arg_sets[at])
