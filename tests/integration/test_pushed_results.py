"""Pushed results over real TCP: ``Client.wait`` is answered by the main when the job's
end is settled, by every path that ends a job (a report, a cancel, a lost attempt past
its recovery limit), keeps waiting through a retry, times out, and is bounded per
connection."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import pytest

from adapters.memory import MemoryAdapter
from broker.client.client import Client
from broker.exceptions import OverLimitError
from broker.jobs import Job, JobSpec
from broker.main.main import Main
from broker.wire import messages as protocol
from tests.support import FAST, FakeWorker, running_main, until


def _waiting(main: Main, job_id: uuid.UUID) -> bool:
    return bool(main.waits.waiters.waited_on([job_id]))


async def _enqueue(client: Client, **options: object) -> uuid.UUID:
    enqueued = await client.enqueue_spec(JobSpec(task="t.noop", **options))  # type: ignore[arg-type]
    return enqueued.job_id


async def test_a_wait_is_answered_when_the_report_settles_not_by_polling() -> None:
    store = MemoryAdapter()
    async with running_main(store) as main, Client("127.0.0.1", main.port) as client:
        worker = FakeWorker(main.port)
        await worker.connect()
        job_id = await _enqueue(client)
        waiting = asyncio.create_task(client.wait(job_id, timeout=30))
        await until(lambda: _waiting(main, job_id))
        counted: list[uuid.UUID] = []

        async def counting(job: uuid.UUID) -> Job | None:
            counted.append(job)
            return await store.get_job(job)

        main.waits._read = counting  # the main's reads for waiters, counted from now
        await worker.ready(pooled=1)
        handed = await worker.next_job()
        assert not waiting.done()
        await worker.complete(handed, result={"ok": 1})
        job = await waiting
        assert job["status"] == "completed" and job["result"] == {"ok": 1}
        assert counted == [job_id], "one read, by the notice; the client did not poll"
        assert not _waiting(main, job_id)
        await worker.close()


async def test_a_job_that_ended_before_the_wait_is_answered_at_once() -> None:
    async with running_main(MemoryAdapter()) as main, Client("127.0.0.1", main.port) as client:
        job_id = await _enqueue(client)
        async with Client("127.0.0.1", main.port, role=protocol.Role.OPERATOR) as operator:
            await operator.cancel(job_id)
        assert (await client.wait(job_id, timeout=30))["status"] == "cancelled"
        assert not _waiting(main, job_id)


async def test_a_cancel_wakes_the_waiter() -> None:
    async with running_main(MemoryAdapter()) as main, Client("127.0.0.1", main.port) as client:
        job_id = await _enqueue(client)
        waiting = asyncio.create_task(client.wait(job_id, timeout=30))
        await until(lambda: _waiting(main, job_id))
        async with Client("127.0.0.1", main.port, role=protocol.Role.OPERATOR) as operator:
            await operator.cancel(job_id)
        assert (await waiting)["status"] == "cancelled"


async def test_a_retried_job_keeps_its_waiter_until_it_ends() -> None:
    async with running_main(MemoryAdapter()) as main, Client("127.0.0.1", main.port) as client:
        worker = FakeWorker(main.port)
        await worker.connect()
        job_id = await _enqueue(client, max_attempts=2)
        waiting = asyncio.create_task(client.wait(job_id, timeout=30))
        await until(lambda: _waiting(main, job_id))
        await worker.ready(pooled=1)
        first = await worker.next_job()
        await worker.report(
            protocol.FailedReport(
                job_id=first.job_id, handoff_id=first.handoff_id, error="boom", retry_delay=0.0
            )
        )
        await worker.ready(pooled=1)
        second = await worker.next_job()
        assert second.job_id == job_id and not waiting.done()
        assert _waiting(main, job_id), "the retry did not end the job: still waited for"
        await worker.complete(second)
        assert (await waiting)["status"] == "completed"
        await worker.close()


async def test_a_lost_attempt_past_the_recovery_limit_wakes_the_waiter() -> None:
    settings = dataclasses.replace(FAST, max_recoveries=0)
    async with (
        running_main(MemoryAdapter(), settings) as main,
        Client("127.0.0.1", main.port) as client,
    ):
        worker = FakeWorker(main.port)
        await worker.connect()
        job_id = await _enqueue(client)
        waiting = asyncio.create_task(client.wait(job_id, timeout=30))
        await until(lambda: _waiting(main, job_id))
        await worker.ready(pooled=1)
        await worker.next_job()
        await worker.close()  # the attempt is lost; no recovery is allowed: dead
        job = await waiting
        assert job["status"] == "failed"


async def test_a_wait_times_out_and_leaves_nothing_at_the_main() -> None:
    async with running_main(MemoryAdapter()) as main, Client("127.0.0.1", main.port) as client:
        job_id = await _enqueue(client)
        with pytest.raises(TimeoutError, match="has not ended"):
            await client.wait(job_id, timeout=0.2)
        assert not _waiting(main, job_id)


async def test_waits_over_the_bound_of_one_connection_are_refused() -> None:
    async with running_main(MemoryAdapter()) as main, Client("127.0.0.1", main.port) as client:
        main.waits.waiters.per_connection = 2
        jobs = [await _enqueue(client) for _ in range(3)]
        waiting = [asyncio.create_task(client.wait(j, timeout=30)) for j in jobs[:2]]
        await until(lambda: all(_waiting(main, j) for j in jobs[:2]))
        with pytest.raises(OverLimitError, match="waiters per connection"):
            await client.wait(jobs[2], timeout=30)
        async with Client("127.0.0.1", main.port) as other:  # another connection's own bound
            other_wait = asyncio.create_task(other.wait(jobs[2], timeout=30))
            await until(lambda: _waiting(main, jobs[2]))
            async with Client("127.0.0.1", main.port, role=protocol.Role.OPERATOR) as operator:
                for job in jobs:
                    await operator.cancel(job)
            assert [(await w)["status"] for w in [*waiting, other_wait]] == ["cancelled"] * 3


async def test_a_closed_connection_drops_its_waiters() -> None:
    async with running_main(MemoryAdapter()) as main:
        client = Client("127.0.0.1", main.port)
        job_id = await _enqueue(client)
        waiting = asyncio.create_task(client.wait(job_id, timeout=30))
        await until(lambda: _waiting(main, job_id))
        waiting.cancel()
        await client.close()
        await until(lambda: not _waiting(main, job_id))


async def test_an_end_no_notice_carried_is_answered_when_the_wait_is_up() -> None:
    """A job ended behind the main's back (here the store cancels it directly, as a
    dependent is cancelled inside its parent's settle): its waiter gets no notice, but
    the main reads the job once more when the wait's time is up, and answers the end
    rather than a timeout."""
    store = MemoryAdapter()
    async with running_main(store) as main, Client("127.0.0.1", main.port) as client:
        job_id = await _enqueue(client)
        waiting = asyncio.create_task(client.wait(job_id, timeout=0.5))
        await until(lambda: _waiting(main, job_id))
        await store.cancel(job_id)
        assert (await waiting)["status"] == "cancelled"
        assert not _waiting(main, job_id)
