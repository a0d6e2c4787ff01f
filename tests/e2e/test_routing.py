"""Routing by the task catalog with real processes, on SQLite and PostgreSQL: a rolling
deploy where an old worker lacks a new task. Its jobs never go to the old worker: with
only the old worker connected they wait, and ``broker status`` says why; once a new
worker connects they all complete there, none dead. By name, arguments the declared
signature cannot take are refused at enqueue."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from broker import InvalidArgumentsError
from broker.client.client import Client
from broker.jobs import JobStatus
from tests.e2e.test_e2e import Cluster, RunLog, eventually, fresh_database, sqlite_url
from tests.integration.test_operator import _cli

pytestmark = pytest.mark.slow

NEW_TASK = "tests.rolling_app.new_report"
JOBS = 100


# The catalog routing is the main's, whatever the store: make test runs the deploy on
# SQLite, make test-slow on PostgreSQL too.
@pytest.fixture(
    params=["sqlite", pytest.param("postgres", marks=[pytest.mark.postgres, pytest.mark.slow_e2e])]
)
async def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Cluster]:
    if request.param == "sqlite":
        cluster = Cluster(tmp_path, sqlite_url(tmp_path))
        try:
            yield cluster
        finally:
            await cluster.close()
        return
    async with fresh_database("broker_routing") as url:
        cluster = Cluster(tmp_path, url)
        try:
            yield cluster
        finally:
            await cluster.close()


async def _status(cluster: Cluster) -> str:
    """``broker status``, its entry point in this process with its output captured (a
    process of it costs half a second of CPU; ``test_cli_process`` runs it as one)."""
    code, out, err = await _cli("--main", f"127.0.0.1:{cluster.port}", "status")
    assert code == 0, err
    return out


async def test_a_rolling_deploy_loses_no_job_of_a_new_task(cluster: Cluster) -> None:
    await cluster.start_main()
    # The new release declares the task once, then goes (its declaration outlives it for
    # the task grace), so the catalog knows the name while only the old worker is up.
    first = await cluster.start_worker("new-0", "--app", "tests.rolling_app")
    async with Client("127.0.0.1", cluster.port) as client:

        async def declared() -> bool:
            return any(t["task"] == NEW_TASK for t in await client.list_tasks())

        await eventually(declared, "the new task in the catalog", detail=cluster.logs)
        # By name, arguments the declared function cannot take are refused at enqueue.
        with pytest.raises(InvalidArgumentsError, match="missing a required argument: 'key'"):
            await client.enqueue(NEW_TASK, [], {"other": 1})
        await first.terminate()
        old = await cluster.start_worker("old")

        ids = [(await client.enqueue(NEW_TASK, [f"k{i}"])).job_id for i in range(JOBS)]
        # The old worker is idle with free slots and never receives one of them: an
        # ordinary job enqueued after them runs there, past the whole backlog.
        behind = await client.enqueue("tests.e2e_app.record", ["behind"])

        async def ran_behind() -> bool:
            job = await client.get_job(behind.job_id)
            return job is not None and job["status"] == JobStatus.COMPLETED

        await eventually(ran_behind, "the job behind the backlog to run", detail=cluster.logs)
        status = await _status(cluster)
        assert f"waiting: no connected worker declares task {NEW_TASK!r}" in status, status
        for job_id in ids[:5]:
            job = await client.get_job(job_id)
            assert job is not None and job["status"] == JobStatus.QUEUED
            assert job["attempts"] == 0, "a job no worker can run is not an attempt"
            # get_job says why, as broker job and the dashboard's job page show it.
            assert job["wait_reason"] == f"no connected worker declares task {NEW_TASK!r}"

        new = await cluster.start_worker("new-1", "--app", "tests.rolling_app")

        async def all_done() -> bool:
            for job_id in ids:
                job = await client.get_job(job_id)
                if job is None or job["status"] != JobStatus.COMPLETED:
                    return False
            return True

        await eventually(all_done, f"the {JOBS} jobs to complete", detail=cluster.logs)
        for job_id in ids:
            job = await client.get_job(job_id)
            assert job is not None and job["worker_id"] == "new-1"
            assert "wait_reason" not in job, "a job that ran waits for nothing"
        runs = RunLog.read(cluster.runs)
        assert all(runs.starts[f"k{i}"] == [new.pid] for i in range(JOBS))
        assert runs.starts["behind"] == [old.pid]
        assert "waiting:" not in await _status(cluster)
