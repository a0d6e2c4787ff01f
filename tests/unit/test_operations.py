"""The request service on the memory adapter: its rules without a main or a socket.

Every job of an enqueue is checked before any is stored; a listing is paged by bytes
as well as by count and loses nothing between pages; a prune is validated before the
store is touched; the status snapshot reads the store and takes the rest from a main.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from adapters.memory import MemoryAdapter
from broker.exceptions import InvalidJobError, PayloadTooLargeError
from broker.jobs import Claim, Job, JobSpec, JobStatus
from broker.main.metrics import MainMetrics
from broker.main.operations import LiveState, Operations
from broker.storage import JobFilter, JobPage
from broker.wire import messages as protocol
from tests.unit.test_metrics import samples

START = datetime(2030, 1, 1, tzinfo=UTC)


class _Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> datetime:
        return self.now


@dataclass(frozen=True)
class _Limits:
    max_payload_bytes: int | None = 1000
    max_payload_depth: int = 8
    max_payload_containers: int = 100
    max_line_bytes: int = 100_000
    list_page_bytes: int = 100_000


class _CountingStore(MemoryAdapter):
    """Records the ``limit`` of every ``list_jobs`` read."""

    def __init__(self, clock: _Clock) -> None:
        super().__init__(clock=clock)
        self.reads: list[int] = []

    async def list_jobs(
        self,
        job_filter: JobFilter | None = None,
        *,
        limit: int = 50,
        cursor: str | None = None,
        include_payload: bool = True,
    ) -> JobPage:
        self.reads.append(limit)
        return await super().list_jobs(
            job_filter, limit=limit, cursor=cursor, include_payload=include_payload
        )


def _service(limits: _Limits | None = None) -> tuple[Operations, _CountingStore, _Clock]:
    clock = _Clock()
    store = _CountingStore(clock)
    return Operations(store, limits or _Limits(), clock=clock), store, clock


def _request(task: str = "t", *args: Any, **options: Any) -> protocol.JobRequest:
    return protocol.JobRequest(task=task, args=list(args), **options)


async def _all_jobs(store: MemoryAdapter) -> list[Job]:
    return (await store.list_jobs(limit=1000)).jobs


async def _finished(store: MemoryAdapter, n: int, *, dead: bool = False) -> list[Job]:
    results = await store.enqueue_many(
        [JobSpec(task="t", args=[i], max_attempts=1) for i in range(n)]
    )
    claims = [Claim(r.job.id, uuid.uuid4(), "w") for r in results]
    await store.mark_handed_off_many(claims)
    for claim in claims:
        if dead:
            assert await store.fail(claim.job_id, claim.handoff_id, "broke", None)
        else:
            assert await store.complete(claim.job_id, claim.handoff_id, None)
    finished = {claim.job_id for claim in claims}
    return [job for job in await _all_jobs(store) if job.id in finished]


# ------------------------------------------------------------------------ enqueue


async def test_enqueue_stores_the_batch_in_order_with_delays_from_its_own_clock() -> None:
    ops, store, clock = _service()
    clock.now = START + timedelta(hours=1)
    results = await ops.enqueue([_request("a"), _request("b", delay=60.0)])
    assert [r.job.task for r in results] == ["a", "b"]
    assert results[1].job.run_at == clock.now + timedelta(seconds=60)
    assert len(await _all_jobs(store)) == 2


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (_request("big", "x" * 2000), PayloadTooLargeError, "over the payload limit of 1000"),
        (_request("deep", [[[[[[[[[[1]]]]]]]]]]), InvalidJobError, "more than 8 levels deep"),
        (_request("t" * 100_000), InvalidJobError, "at most 1024 bytes"),
        (_request("wide", [[]] * 100), PayloadTooLargeError, "more than 100 lists and objects"),
    ],
    ids=["too large", "too deep", "task name too long", "too many containers"],
)
async def test_one_bad_job_refuses_its_whole_batch_before_the_store_sees_it(
    bad: protocol.JobRequest, error: type[Exception], match: str
) -> None:
    ops, store, _ = _service()
    with pytest.raises(error, match=match):
        await ops.enqueue([_request("fine", 1), bad, _request("fine", 2)])
    assert await _all_jobs(store) == []


async def test_without_a_payload_limit_size_is_free_but_depth_is_not() -> None:
    ops, store, _ = _service(_Limits(max_payload_bytes=None))
    await ops.enqueue([_request("big", "x" * 200_000)])
    with pytest.raises(InvalidJobError, match="levels deep"):
        await ops.enqueue([_request("deep", [[[[[[[[[[1]]]]]]]]]])])
    assert [j.task for j in await _all_jobs(store)] == ["big"]


# ------------------------------------------------------------------------ listing


async def _pages(ops: Operations, **options: Any) -> list[tuple[list[dict[str, Any]], str | None]]:
    pages = []
    cursor = None
    while True:
        page = await ops.list_jobs(JobFilter(), cursor=cursor, **options)
        pages.append((page.jobs, page.next_cursor))
        if (cursor := page.next_cursor) is None:
            return pages


def _size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":")))


async def test_summary_pages_end_at_the_byte_budget_and_lose_nothing() -> None:
    ops, store, _ = _service(_Limits(list_page_bytes=3000))
    await store.enqueue_many([JobSpec(task="t", args=[i]) for i in range(25)])
    pages = await _pages(ops, limit=1000, include_payload=False)

    assert len(pages) > 2, "the byte budget, not the count, ended the pages"
    for jobs, cursor in pages:
        assert len(jobs) > 1 or cursor is None, "a page holds as many jobs as fit"
        assert _size(jobs) + _size(cursor) <= 3000
        assert all("args" not in job for job in jobs), "summaries unless asked"
    listed = [job["id"] for jobs, _ in pages for job in jobs]
    assert listed == [str(job.id) for job in await _all_jobs(store)], "every job once, in order"


async def test_the_count_limit_still_applies() -> None:
    ops, store, _ = _service()
    await store.enqueue_many([JobSpec(task="t", args=[i]) for i in range(5)])
    page = await ops.list_jobs(JobFilter(), limit=2, cursor=None, include_payload=False)
    assert len(page.jobs) == 2 and page.next_cursor is not None


async def test_a_payload_listing_reads_a_few_rows_at_a_time() -> None:
    ops, store, _ = _service(_Limits(max_payload_bytes=1000, list_page_bytes=5000))
    await store.enqueue_many([JobSpec(task="t", args=[i]) for i in range(7)])
    store.reads.clear()
    page = await ops.list_jobs(JobFilter(), limit=7, cursor=None, include_payload=True)
    assert len(page.jobs) == 7 and all("args" in job for job in page.jobs)
    assert max(store.reads) == 2, "page budget / (2 x payload limit) rows per read"


async def test_a_job_too_big_for_a_line_even_alone_is_listed_without_its_payload() -> None:
    ops, store, _ = _service(
        _Limits(max_payload_bytes=None, max_line_bytes=5000, list_page_bytes=5000)
    )
    await store.enqueue_many([JobSpec(task="small"), JobSpec(task="huge", args=["x" * 6000])])
    pages = await _pages(ops, limit=10, include_payload=True)
    jobs = {str(job["task"]): job for page, _ in pages for job in page}
    assert sorted(jobs) == ["huge", "small"]
    assert jobs["huge"]["payload_omitted"] is True and "args" not in jobs["huge"]
    assert "payload_omitted" not in jobs["small"] and jobs["small"]["args"] == []


async def test_the_reply_around_the_jobs_counts_against_the_line() -> None:
    ops, store, _ = _service(_Limits(max_line_bytes=5000, list_page_bytes=5000))
    await store.enqueue_many([JobSpec(task="t", args=["x" * 900])])
    roomy = await ops.list_jobs(JobFilter(), limit=5, cursor=None, include_payload=True)
    assert "args" in roomy.jobs[0]
    tight = await ops.list_jobs(
        JobFilter(), limit=5, cursor=None, include_payload=True, reply_bytes=4500
    )
    assert tight.jobs[0]["payload_omitted"] is True


async def test_a_cursor_the_store_did_not_write_is_a_value_error() -> None:
    ops, _, _ = _service()
    with pytest.raises(ValueError):
        await ops.list_jobs(JobFilter(), limit=5, cursor="garbage", include_payload=False)


# ------------------------------------------------------------------------ prune


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({}, "older_than_seconds or keep_latest"),
        ({"older_than_seconds": 1e300}, "a hundred years"),
        ({"older_than_seconds": float("nan")}, "a hundred years"),
        ({"older_than_seconds": -1.0}, "a hundred years"),
        ({"keep_latest": -1}, "must not be negative"),
        ({"keep_latest": 0, "statuses": [JobStatus.QUEUED]}, "terminal"),
    ],
)
async def test_a_bad_prune_is_refused_before_the_store_is_touched(
    options: dict[str, Any], match: str
) -> None:
    ops, store, _ = _service()
    await _finished(store, 2)
    arguments: dict[str, Any] = {"older_than_seconds": None, "keep_latest": None, "statuses": None}
    with pytest.raises(ValueError, match=match):
        await ops.prune(**{**arguments, **options})
    assert len(await _all_jobs(store)) == 2


async def test_prune_ages_are_measured_on_the_service_clock() -> None:
    ops, store, clock = _service()
    await _finished(store, 3)
    clock.now = START + timedelta(seconds=100)
    assert await ops.prune(older_than_seconds=200, keep_latest=None, statuses=None) == 0
    assert await ops.prune(older_than_seconds=50, keep_latest=None, statuses=None) == 3


async def test_prune_by_count_and_status() -> None:
    ops, store, _ = _service()
    await _finished(store, 2, dead=True)
    await _finished(store, 3)
    done = [JobStatus.COMPLETED]
    assert await ops.prune(older_than_seconds=None, keep_latest=1, statuses=done) == 2
    left = sorted(job.status for job in await _all_jobs(store))
    assert left == [JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.FAILED]


# ------------------------------------------------------------------------ the rest


async def test_status_reads_the_store_and_takes_the_rest_from_a_main() -> None:
    ops, store, clock = _service()
    await store.enqueue_many([JobSpec(task="t", queue="mail")])
    await _finished(store, 1)
    clock.now = START + timedelta(seconds=30)

    alone = await ops.status()
    assert {k: v for k, v in alone.items() if k != "queues"} == {
        "main_id": None,
        "role": None,
        "leader": None,
        "dispatched": None,
        "orphans": None,
        "workers": None,
        "pending_recoveries": None,
        "waiting": None,
        "queue_settings": None,
    }
    queues = {q["queue"]: q for q in alone["queues"]}
    assert queues["mail"]["counts"]["queued"] == 1
    assert queues["mail"]["oldest_queued_age_seconds"] == 30.0
    assert queues["default"]["counts"]["completed"] == 1
    assert queues["default"]["oldest_queued_run_at"] is None

    live = LiveState("main-1", "leader", "m:7390", 7, 2, [{"worker_id": "w"}], [{"job_id": "j"}])
    with_main = await ops.status(live)
    assert with_main["main_id"] == "main-1" and with_main["dispatched"] == 7
    assert with_main["role"] == "leader" and with_main["leader"] == "m:7390"
    assert with_main["orphans"] == 2 and with_main["workers"] == [{"worker_id": "w"}]
    assert with_main["pending_recoveries"] == [{"job_id": "j"}]
    assert with_main["queues"] == alone["queues"]
    assert with_main["waiting"] == []


async def test_status_names_the_tasks_whose_queued_jobs_no_connected_worker_declares() -> None:
    """Routing by task: a task no connected worker declares is named with why, when it
    has queued jobs (one without is not news)."""
    ops, store, _ = _service()
    await store.enqueue_many([JobSpec(task="new.task", queue="mail")])
    live = LiveState(
        "main-1", "leader", "m:7390", 0, 0, [], [], unserved_tasks=["gone.task", "new.task"]
    )
    status = await ops.status(live)
    assert status["waiting"] == [
        {"task": "new.task", "reason": "no connected worker declares task 'new.task'"}
    ]


async def test_get_cancel_and_retry_return_the_job_as_the_store_left_it() -> None:
    ops, store, _ = _service()
    [queued] = await ops.enqueue([_request()])
    [dead] = await _finished(store, 1, dead=True)
    assert await ops.get(uuid.uuid4()) is None
    got = await ops.get(queued.job.id)
    assert got is not None and got.status is JobStatus.QUEUED
    cancelled = await ops.cancel(queued.job.id)
    assert cancelled is not None and cancelled.status is JobStatus.CANCELLED
    retried = await ops.retry(dead.id)
    assert retried is not None and retried.status is JobStatus.QUEUED
    again = await ops.retry(queued.job.id)
    assert again is not None and again.status is JobStatus.CANCELLED, "only a dead job"


async def test_enqueued_jobs_are_counted_by_queue_and_task_and_duplicates_are_not() -> None:
    clock = _Clock()
    metrics = MainMetrics()
    ops = Operations(_CountingStore(clock), _Limits(), clock=clock, metrics=metrics)
    await ops.enqueue([_request("a"), _request("a", idempotency_key="k"), _request("b")])
    await ops.enqueue([_request("a", idempotency_key="k"), _request("a", queue="q2")])
    got = samples(metrics.exposition())

    def enqueued(queue: str, task: str) -> float:
        labels = frozenset({("queue", queue), ("task", task)})
        return got[("broker_jobs_enqueued_total", labels)]

    assert enqueued("default", "a") == 2  # the repeat of key "k" returned its job
    assert enqueued("default", "b") == 1
    assert enqueued("q2", "a") == 1
