"""Workflows end to end: real ``broker-main`` and ``broker-worker`` processes on a SQLite
file and on PostgreSQL, a worker killed with ``kill -9`` while a group's members run. The
fan-in is made due once, runs once, and receives every result in the group's order; a
chain of 20 steps finishes with the right value. What ran where comes from the run log
the tasks write (``tests/e2e_app.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker import chain, group
from broker.jobs import JobStatus
from broker.tasks.registry import TaskRegistry, task
from tests.e2e.test_e2e import APP, Cluster, RunLog, final_jobs
from tests.e2e.test_e2e import store_url as store_url  # the fixture: SQLite, PostgreSQL
from tests.support import until

pytestmark = pytest.mark.slow

_names = TaskRegistry()
"""Stand-ins with the worker's task names and signatures: this process runs none of them."""


@task(name=f"{APP}.wf_member", mode="inline", registry=_names)
async def wf_member(key: str, value: int, seconds: float = 0.0) -> int:
    raise NotImplementedError


@task(name=f"{APP}.wf_collect", mode="inline", registry=_names)
async def wf_collect(results: list[int], key: str) -> int:
    raise NotImplementedError


@task(name=f"{APP}.wf_step", mode="inline", registry=_names)
async def wf_step(value: int, key: str) -> int:
    raise NotImplementedError


MEMBERS = 200


async def test_a_fan_in_of_200_is_made_due_once_though_a_worker_is_killed(
    tmp_path: Path, store_url: str
) -> None:
    await _fan_in_with_a_worker_killed(tmp_path, store_url, MEMBERS)


@pytest.mark.soak
@pytest.mark.timeout(600)
async def test_a_fan_in_of_1000_is_made_due_once_though_a_worker_is_killed(
    tmp_path: Path, store_url: str
) -> None:
    """The issue's full size (``make test-slow``); the main is not killed here."""
    await _fan_in_with_a_worker_killed(tmp_path, store_url, 1000)


async def _fan_in_with_a_worker_killed(tmp_path: Path, store_url: str, size: int) -> None:
    cluster = Cluster(tmp_path, store_url)
    try:
        main = await cluster.start_main()
        doomed = await cluster.start_worker("worker-1", concurrency=8)
        await cluster.start_worker("worker-2", concurrency=8)
        members = group(wf_member.bind(f"m{i}", i, 0.02) for i in range(size))
        async with cluster.client() as client:
            flow = await client.enqueue_workflow(members.then(wf_collect.bind("fan-in")))
            assert flow.final_job_id is not None
            await until(lambda: len(RunLog.read(cluster.runs).ends) >= size // 4, 60)
            await doomed.kill()
            final = await client.wait(flow.final_job_id, timeout=180)
        assert final["status"] == JobStatus.COMPLETED.value, cluster.logs()
        assert final["args"] == [[i * i for i in range(size)], "fan-in"]
        assert final["result"] == sum(i * i for i in range(size))
        runs = RunLog.read(cluster.runs)
        assert len(runs.starts["fan-in"]) == 1, "the continuation ran more than once"
        assert all(runs.ends.get(f"m{i}") for i in range(size))
        await main.terminate()
        jobs = await final_jobs(store_url)
        assert len(jobs) == size + 1, "exactly one continuation was made"
        assert {j.status for j in jobs.values()} == {JobStatus.COMPLETED}
    finally:
        await cluster.close()


async def test_a_chain_of_20_steps_finishes_with_the_right_value(
    tmp_path: Path, store_url: str
) -> None:
    cluster = Cluster(tmp_path, store_url)
    try:
        await cluster.start_main()
        await cluster.start_worker("worker-1", concurrency=4)
        steps = [wf_member.bind("s0", 3), *(wf_step.bind(f"s{i}") for i in range(1, 20))]
        async with cluster.client() as client:
            flow = await client.enqueue_workflow(chain(*steps))
            assert flow.final_job_id is not None
            final = await client.wait(flow.final_job_id, timeout=120)
        assert (final["status"], final["result"]) == (JobStatus.COMPLETED.value, 9 + 19)
        runs = RunLog.read(cluster.runs)
        assert [len(runs.starts[f"s{i}"]) for i in range(20)] == [1] * 20
    finally:
        await cluster.close()
