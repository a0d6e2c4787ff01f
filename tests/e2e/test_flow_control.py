"""Flow control with real processes, on SQLite files and PostgreSQL: a queue's rate limit
holds across every worker (no one-second window of dispatches over the limit plus its
burst), and a paused queue dispatches nothing while another drains, stays paused across a
main's restart, and resumes at once; both hold across a failover to a standby main."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from broker.jobs import Job, JobSpec, JobStatus
from tests.e2e.test_e2e import (
    Cluster,
    RunLog,
    enqueue,
    eventually,
    final_jobs,
    observe,
    record_spec,
    store_url,
    wait_until_all_terminal,
)
from tests.e2e.test_failover import Mains, pg_url

pytestmark = pytest.mark.slow

__all__ = ["pg_url", "store_url"]  # the fixtures: a store of each kind, a PostgreSQL database

RATE, BURST = 50, 5
CLAIM_LATENCY = 0.1
"""Seconds a claim may take to commit, under load. The limiter admits at the main's
plan time, exactly (``tests/unit/test_flow.py`` proves the window rule there); a job's
recorded ``handed_off_at`` is the store's clock when its claim commits, up to this much
later, so a one-second window of recorded times may also hold the jobs admitted in the
``CLAIM_LATENCY`` before it: ``RATE * CLAIM_LATENCY`` more at most."""
MOST_IN_A_SECOND = RATE + BURST + round(RATE * CLAIM_LATENCY)


def _densest_second(jobs: list[Job]) -> int:
    """The most jobs handed off (claimed by the main's dispatch) within any one second."""
    times = sorted(job.handed_off_at.timestamp() for job in jobs if job.handed_off_at)
    most, first = 0, 0
    for last, at in enumerate(times):
        while at - times[first] >= 1.0:
            first += 1
        most = max(most, last - first + 1)
    return most


async def _limited_run(tmp_path: Path, url: str, total: int) -> list[Job]:
    """``total`` jobs of a queue limited to RATE/s (burst BURST), over four workers; the
    jobs as the store left them."""
    cluster = Cluster(tmp_path, url)
    try:
        await cluster.start_main()
        for i in range(4):
            await cluster.start_worker(f"worker-{i}", concurrency=8)
        async with cluster.client() as client:
            settings = await client.limit_queue("limited", f"{RATE}/s", burst=BURST)
            assert settings["rate_limit"] == f"{RATE}/s" and settings["rate_burst"] == BURST
        specs = [dataclasses.replace(record_spec(), queue="limited") for _ in range(total)]
        await enqueue(cluster, specs)
        async with observe(cluster.url) as store:
            await wait_until_all_terminal(store, total, cluster, timeout=total / RATE * 3 + 30)
    finally:
        await cluster.close()
    jobs = list((await final_jobs(url)).values())
    assert len(jobs) == total
    assert all(job.status is JobStatus.COMPLETED and job.attempts == 0 for job in jobs)
    return jobs


async def test_a_rate_limit_holds_across_four_workers(tmp_path: Path, store_url: str) -> None:
    jobs = await _limited_run(tmp_path, store_url, 100)
    assert _densest_second(jobs) <= MOST_IN_A_SECOND


@pytest.mark.soak
async def test_1000_jobs_at_50_a_second_take_20_seconds(tmp_path: Path, store_url: str) -> None:
    jobs = await _limited_run(tmp_path, store_url, 1000)
    times = sorted(job.handed_off_at.timestamp() for job in jobs if job.handed_off_at)
    span = times[-1] - times[0]
    most = _densest_second(jobs)
    print(f"1000 jobs at {RATE}/s: dispatched over {span:.2f} s, at most {most} in a second")
    assert most <= MOST_IN_A_SECOND
    assert 18.0 <= span <= 22.0, f"1000 jobs at {RATE}/s were dispatched over {span:.2f} s"


async def test_a_paused_queue_waits_across_a_restart_and_resumes_at_once(
    sqlite_cluster: Cluster,
) -> None:
    cluster = sqlite_cluster
    main = await cluster.start_main()
    await cluster.start_worker("worker-1", concurrency=4)
    async with cluster.client() as client:
        assert (await client.pause_queue("held"))["paused"] is True
    held = await enqueue(
        cluster, [dataclasses.replace(record_spec(), queue="held") for _ in range(20)]
    )
    free = await enqueue(
        cluster, [dataclasses.replace(record_spec(), queue="free") for _ in range(20)]
    )

    async def only_free_done() -> bool:
        jobs = await final_jobs(cluster.url)
        assert all(jobs[key].status is JobStatus.QUEUED for key in held), "a paused job ran"
        return all(jobs[key].status is JobStatus.COMPLETED for key in free)

    await eventually(only_free_done, "the free queue to drain", detail=cluster.logs)

    assert await main.terminate() == 0
    main = await cluster.start_main()
    more = await enqueue(
        cluster, [dataclasses.replace(record_spec(), queue="free") for _ in range(5)]
    )

    async def more_done() -> bool:
        jobs = await final_jobs(cluster.url)
        assert all(jobs[key].status is JobStatus.QUEUED for key in held), "paused no more"
        return all(jobs[key].status is JobStatus.COMPLETED for key in more)

    await eventually(more_done, "the free queue to drain after the restart", detail=cluster.logs)
    async with cluster.client() as client:
        status = await client.status()
        assert status["queue_settings"] == [
            {
                "queue": "held",
                "paused": True,
                "rate_limit": None,
                "rate_burst": None,
                "token_wait_seconds": 0.0,
                "held_for_token": 0,
            }
        ]
        assert (await client.resume_queue("held"))["paused"] is False

    async def held_done() -> bool:
        jobs = await final_jobs(cluster.url)
        return all(jobs[key].status is JobStatus.COMPLETED for key in held)

    await eventually(held_done, "the resumed queue to drain", detail=cluster.logs)
    jobs = await final_jobs(cluster.url)
    assert all(jobs[key].attempts == 0 for key in held), "held back is not an attempt"


# make test-slow only: make test proves that a main starting to lead reads the queue settings
# from the store (test_a_paused_queue_waits_across_a_restart_and_resumes_at_once) and that a
# standby takes over (test_failover.py::test_the_leader_killed_a_standby_takes_over).
@pytest.mark.slow_e2e
@pytest.mark.postgres
async def test_settings_hold_across_a_failover_to_a_standby(tmp_path: Path, pg_url: str) -> None:
    """The leader is killed while a limited queue drains and another is paused: the
    standby that takes over reads the settings from the store, so the limit holds across
    the takeover and the paused queue stays paused until resumed."""
    cluster = Mains(tmp_path, pg_url, 2)
    try:
        leader = await cluster.start_mains()
        await cluster.start_worker("worker-0")
        await cluster.start_worker("worker-1")
        async with cluster.client() as client:
            await client.limit_queue("limited", "20/s", burst=2)
            await client.pause_queue("held")
        held = await enqueue(
            cluster, [dataclasses.replace(record_spec(), queue="held") for _ in range(10)]
        )
        limited = await enqueue(
            cluster, [dataclasses.replace(record_spec(), queue="limited") for _ in range(80)]
        )
        await eventually(
            lambda: RunLog.read(cluster.runs).total_ends() >= 20,
            "the limited queue to be under way",
            detail=cluster.logs,
        )
        await leader.kill()
        await cluster.new_leader(leader)

        async def limited_done() -> bool:
            jobs = await final_jobs(pg_url)
            assert all(jobs[key].status is JobStatus.QUEUED for key in held), "a paused job ran"
            return all(jobs[key].status is JobStatus.COMPLETED for key in limited)

        await eventually(
            limited_done, "the limited queue to drain", timeout=60, detail=cluster.logs
        )
        async with cluster.client() as client:
            await client.resume_queue("held")

        async def held_done() -> bool:
            jobs = await final_jobs(pg_url)
            return all(jobs[key].status is JobStatus.COMPLETED for key in held)

        await eventually(held_done, "the resumed queue to drain", detail=cluster.logs)
    finally:
        await cluster.close()
    jobs = await final_jobs(pg_url)
    assert _densest_second([jobs[key] for key in limited]) <= 20 + 2 + round(20 * CLAIM_LATENCY)


async def test_a_tasks_rate_limit_holds_across_two_workers_and_holds_no_other_task_back(
    sqlite_cluster: Cluster,
) -> None:
    """``@task(rate_limit="20/s", rate_burst=2)`` (``tests.e2e_app.record_limited``): the
    workers declare it, and the main holds its jobs to it across both, while the jobs of
    an unlimited task of the same queue, queued behind them, drain at once."""
    cluster = sqlite_cluster
    await cluster.start_main()
    await cluster.start_worker("worker-0")
    await cluster.start_worker("worker-1")
    limited_task = "tests.e2e_app.record_limited"
    limited = await enqueue(
        cluster,
        [dataclasses.replace(record_spec(task=limited_task), priority=5) for _ in range(40)],
    )
    free = await enqueue(cluster, [record_spec() for _ in range(40)])
    async with observe(cluster.url) as store:
        await wait_until_all_terminal(store, 80, cluster, timeout=60)
    jobs = await final_jobs(cluster.url)
    assert all(jobs[key].status is JobStatus.COMPLETED for key in [*limited, *free])
    assert all(jobs[key].attempts == 0 for key in limited), "held back is not an attempt"
    assert _densest_second([jobs[key] for key in limited]) <= 20 + 2 + round(20 * CLAIM_LATENCY)
    # 40 jobs at 20/s with a burst of 2 take 1.9 s at least; the free ones, behind them in
    # the queue, are not held back for them.
    last_free = max(jobs[key].handed_off_at for key in free if jobs[key].handed_off_at)
    last_limited = max(jobs[key].handed_off_at for key in limited if jobs[key].handed_off_at)
    assert last_free < last_limited


def _tenant_spec(tenant: str) -> JobSpec:
    """A job of ``tests.e2e_app.record_per_tenant`` (10/s for each tenant) for ``tenant``,
    its key given as a client that has the task fills it in."""
    spec = record_spec(task="tests.e2e_app.record_per_tenant")
    return dataclasses.replace(spec, args=spec.args[:1], kwargs={"tenant": tenant}, rate_key=tenant)


async def _two_tenants(tmp_path: Path, url: str, flood: int, others: int) -> None:
    """Tenant A floods (``flood`` jobs, queued first and at a higher priority), tenant B
    then enqueues ``others``: B's jobs are not held behind A's backlog (the dispatch
    reads leave A's key out while it has no token) and start at B's own rate, while A's
    are held to A's; none of them counts a held-back attempt."""
    cluster = Cluster(tmp_path, url)
    try:
        await cluster.start_main()
        await cluster.start_worker("worker-0")
        await cluster.start_worker("worker-1")
        burst = [dataclasses.replace(_tenant_spec("A"), priority=5) for _ in range(flood)]
        a = await enqueue(cluster, burst)
        b = await enqueue(cluster, [_tenant_spec("B") for _ in range(others)])
        async with observe(cluster.url) as store:
            await wait_until_all_terminal(
                store, flood + others, cluster, timeout=flood / 10 * 3 + 30
            )
    finally:
        await cluster.close()
    jobs = await final_jobs(url)
    assert all(jobs[key].status is JobStatus.COMPLETED for key in [*a, *b])
    assert all(jobs[key].attempts == 0 for key in [*a, *b]), "held back is not an attempt"
    assert {jobs[key].rate_key for key in a} == {"A"}
    assert {jobs[key].rate_key for key in b} == {"B"}
    most = 10 + 1 + round(10 * CLAIM_LATENCY)
    assert _densest_second([jobs[key] for key in a]) <= most
    assert _densest_second([jobs[key] for key in b]) <= most
    # A's backlog at 10/s takes (flood - 1) / 10 s at least; B's jobs, behind it in the
    # queue, go at B's own rate, long before A's backlog is through.
    last_a = max(jobs[key].handed_off_at for key in a if jobs[key].handed_off_at)
    last_b = max(jobs[key].handed_off_at for key in b if jobs[key].handed_off_at)
    assert last_b < last_a


async def test_a_per_key_limit_isolates_two_tenants(tmp_path: Path, store_url: str) -> None:
    """``@task(rate_limit="10/s", rate_key="{tenant}")``: 20 jobs of A, then 4 of B."""
    await _two_tenants(tmp_path, store_url, 20, 4)


@pytest.mark.soak
async def test_a_per_key_limit_isolates_two_tenants_over_a_long_flood(
    tmp_path: Path, store_url: str
) -> None:
    """The same over 30 s of A's flood (300 jobs) and 50 of B's (5 s at B's rate)."""
    await _two_tenants(tmp_path, store_url, 300, 50)
