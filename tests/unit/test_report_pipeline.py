"""The report settler's pipelining, on the memory adapter with a settle that can be held
open: reports that arrive while a batch commits start a second batch at once, the
batches in flight are capped (what waits goes into one batch), every report is
acknowledged once it is durable, and ``wait_idle`` waits for every batch in flight; the
main keeps more than one in flight only on a store whose writes run side by side."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Sequence

from adapters.memory import MemoryAdapter
from broker import protocol
from broker.config import MainSettings
from broker.handoff import Handoff
from broker.jobs import Claim, JobSpec, JobStatus, Settlement, utcnow
from broker.main import Main
from broker.reports import ReportSettler
from broker.retry import retry_delay
from broker.storage import Capabilities


class HeldSettles(MemoryAdapter):
    """Settles wait for the test to let them through, one ``release`` per call."""

    def __init__(self) -> None:
        super().__init__()
        self.started: asyncio.Queue[list[Settlement]] = asyncio.Queue()
        self.release = asyncio.Semaphore(0)

    async def settle_many(self, settlements: Sequence[Settlement]) -> list[bool]:
        self.started.put_nowait(list(settlements))
        await self.release.acquire()
        return await super().settle_many(settlements)


async def running_jobs(store: MemoryAdapter, n: int) -> list[protocol.CompletedReport]:
    """``n`` jobs handed off to a worker, and the report that completes each."""
    results = await store.enqueue_many([JobSpec(task="t") for _ in range(n)])
    claims = [Claim(r.job_id, uuid.uuid4(), "w1") for r in results]
    assert len(await store.mark_handed_off_many(claims)) == n
    return [protocol.CompletedReport(job_id=c.job_id, handoff_id=c.handoff_id) for c in claims]


async def let_the_settler_run() -> None:
    """Turns of the loop enough for the settler to start a batch if it may (it takes
    three: its wake-up, the batch's task, the store call)."""
    for _ in range(10):
        await asyncio.sleep(0)


def settler(
    store: MemoryAdapter, acks: list[tuple[uuid.UUID, protocol.AckStatus]], max_in_flight: int
) -> ReportSettler:
    def acknowledged(
        batch: list[tuple[int, protocol.Report]], statuses: list[protocol.AckStatus]
    ) -> None:
        acks.extend((msg.job_id, status) for (_, msg), status in zip(batch, statuses, strict=True))

    return ReportSettler(
        store,
        Handoff(),
        acknowledged=acknowledged,
        stopping=lambda: False,
        clock=utcnow,
        retry_delay=retry_delay,
        max_recoveries=3,
        batch=512,
        retry_interval=0.01,
        max_payload_bytes=None,
        max_payload_depth=64,
        max_in_flight=max_in_flight,
    )


async def test_reports_arriving_during_a_commit_start_a_second_batch_and_the_rest_wait() -> None:
    store = HeldSettles()
    reports = await running_jobs(store, 5)
    acks: list[tuple[uuid.UUID, protocol.AckStatus]] = []
    s = settler(store, acks, max_in_flight=2)
    run = asyncio.create_task(s.run())
    s.add(1, reports[0])
    first = await store.started.get()
    s.add(1, reports[1])
    second = await store.started.get()  # at once: the first is still committing
    for report in reports[2:]:
        s.add(1, report)
    idle = asyncio.create_task(s.wait_idle())
    await let_the_settler_run()
    assert store.started.empty() and len(s.queued) == 3  # two in flight: three wait
    store.release.release()
    third = await store.started.get()  # the first commit's end lets the waiting ones go
    assert [[x.job_id for x in b] for b in (first, second)] == [[r.job_id] for r in reports[:2]]
    assert [x.job_id for x in third] == [r.job_id for r in reports[2:]]  # in one batch
    store.release.release()
    store.release.release()
    await idle  # only once every batch in flight is done
    assert sorted(acks) == sorted((r.job_id, protocol.AckStatus.APPLIED) for r in reports)
    for report in reports:
        job = await store.get_job(report.job_id)
        assert job is not None and job.status is JobStatus.COMPLETED
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)


async def test_with_one_batch_in_flight_reports_wait_for_the_commit() -> None:
    store = HeldSettles()
    reports = await running_jobs(store, 3)
    acks: list[tuple[uuid.UUID, protocol.AckStatus]] = []
    s = settler(store, acks, max_in_flight=1)
    run = asyncio.create_task(s.run())
    s.add(1, reports[0])
    await store.started.get()
    s.add(1, reports[1])
    s.add(1, reports[2])
    await let_the_settler_run()
    assert store.started.empty() and len(s.queued) == 2
    store.release.release()
    assert [x.job_id for x in await store.started.get()] == [r.job_id for r in reports[1:]]
    store.release.release()
    await s.wait_idle()
    assert len(acks) == 3
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)


async def test_stopping_the_settler_cancels_its_batches_in_flight() -> None:
    store = HeldSettles()
    reports = await running_jobs(store, 2)
    s = settler(store, [], max_in_flight=2)
    run = asyncio.create_task(s.run())
    for report in reports:
        s.add(1, report)
        await store.started.get()
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    assert not s._batches  # none left running after its loop
    for report in reports:  # nothing was applied
        job = await store.get_job(report.job_id)
        assert job is not None and job.status is JobStatus.HANDED_OFF


class ConcurrentWrites(MemoryAdapter):
    @property
    def capabilities(self) -> Capabilities:
        return dataclasses.replace(super().capabilities, concurrent_writes=True)


def test_the_main_keeps_two_batches_in_flight_only_where_writes_run_side_by_side() -> None:
    settings = MainSettings(max_settles_in_flight=3)
    assert Main(ConcurrentWrites(), settings).settler._max_in_flight == 3
    assert Main(MemoryAdapter(), settings).settler._max_in_flight == 1  # one writer
