"""Recovery attempts and affinity, end to end: real ``broker-main`` and ``broker-worker``
processes, real ``kill -9`` of a worker and of a pooled child, a real SQLite store.

A lost attempt (its worker, child or connection died) is a *recovery*: counted apart from
the failures the task raised, run again at once, and capped. A ``local_state`` job's
recovery waits for the worker that holds its state, within the affinity grace.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest

from broker.jobs import ExecutionMode, JobSpec, JobStatus
from broker.retry import retry_delay
from tests.e2e.test_e2e import (
    APP,
    Cluster,
    RunLog,
    enqueue,
    eventually,
    final_jobs,
    hold_spec,
    observe,
    wait_until_all_terminal,
)

pytestmark = pytest.mark.slow

KILL_OWN_CHILD = f"{APP}.kill_own_child"
HOLD_STATE = f"{APP}.hold_state"


def hold_state_spec(gate: Path) -> JobSpec:
    job_id = uuid.uuid4()
    return JobSpec(
        task=HOLD_STATE,
        args=[str(job_id), str(gate)],
        id=job_id,
        execution_mode=ExecutionMode.INLINE,
        local_state=True,
    )


async def test_a_job_that_kills_its_child_every_attempt_ends_dead_at_its_recovery_cap(
    sqlite_cluster: Cluster,
) -> None:
    cluster = sqlite_cluster
    main = await cluster.start_main()
    await cluster.start_worker("worker-a", "--pooled-runner-count", "1")
    job_id = uuid.uuid4()
    spec = JobSpec(
        task=KILL_OWN_CHILD,
        args=[str(job_id), str(cluster.runs)],
        id=job_id,
        max_recoveries=2,
        max_attempts=6,
    )
    await enqueue(cluster, [spec])
    async with observe(cluster.url) as store:

        async def dead() -> bool:
            job = await store.get_job(job_id)
            return job is not None and job.status is JobStatus.FAILED

        await eventually(dead, "the job to end dead", timeout=60, detail=cluster.logs)
    assert await main.terminate() == 0
    job = (await final_jobs(cluster.url))[str(job_id)]
    assert job.status is JobStatus.FAILED
    assert job.recoveries == 3, "every lost attempt counted as a recovery"
    assert job.attempts == 0, "the failure retries are untouched"
    assert job.last_error is not None
    assert job.last_error.startswith("recovery limit reached: 3 attempts ended by a lost")
    assert "max_recoveries=2" in job.last_error and "SIGKILL" in job.last_error
    assert len(RunLog.read(cluster.runs).starts[str(job_id)]) == 3, "ran 3 times, no more"


async def test_a_job_whose_worker_is_killed_recovers_at_once_without_failure_backoff(
    sqlite_cluster: Cluster,
) -> None:
    cluster = sqlite_cluster
    main = await cluster.start_main()
    a = await cluster.start_worker("worker-a")
    gate = cluster.dir / "gate"
    [key] = await enqueue(cluster, [hold_spec(gate)])
    await eventually(lambda: RunLog.read(cluster.runs).started_by(a.pid), "A to start the job")
    killed_at = datetime.now(UTC)
    await a.kill()
    async with observe(cluster.url) as store:

        async def requeued() -> bool:
            job = await store.get_job(uuid.UUID(key))
            return job is not None and job.status is JobStatus.QUEUED

        await eventually(requeued, "the main to take the lease back", detail=cluster.logs)
        job = await store.get_job(uuid.UUID(key))
        assert job is not None and job.recoveries == 1 and job.attempts == 0
        # A failure would wait its backoff (10 s for the first): a recovery is due at once.
        assert job.run_at < killed_at + retry_delay(1), (job.run_at, killed_at)
        assert job.last_error is not None and "worker connection ended" in job.last_error
        gate.touch()
        b = await cluster.start_worker("worker-b")
        await wait_until_all_terminal(store, 1, cluster)
    assert await main.terminate() == 0
    job = (await final_jobs(cluster.url))[key]
    assert job.status is JobStatus.COMPLETED and job.result == b.pid
    assert job.recoveries == 1 and job.attempts == 0


@pytest.mark.soak
async def test_affinity_the_recovery_waits_for_its_state_holder_to_come_back(
    sqlite_cluster: Cluster,
) -> None:
    cluster = sqlite_cluster
    main = await cluster.start_main("--affinity-grace", "60")
    holder = await cluster.start_worker("holder")
    gate = cluster.dir / "gate"
    [key] = await enqueue(cluster, [hold_state_spec(gate)])
    await eventually(lambda: RunLog.read(cluster.runs).started_by(holder.pid), "holder to start")
    other = await cluster.start_worker("other")  # idle and connected all along
    await holder.kill()
    async with observe(cluster.url) as store:

        async def waiting_for_holder() -> bool:
            job = await store.get_job(uuid.UUID(key))
            return job is not None and job.status is JobStatus.QUEUED

        await eventually(waiting_for_holder, "the lost attempt to be taken back")
        job = await store.get_job(uuid.UUID(key))
        assert job is not None and job.state_holder == "holder" and job.recoveries == 1
        back = await cluster.start_worker("holder")
        await eventually(lambda: RunLog.read(cluster.runs).started_by(back.pid), "holder again")
        gate.touch()
        await wait_until_all_terminal(store, 1, cluster)
    assert await main.terminate() == 0
    job = (await final_jobs(cluster.url))[key]
    assert job.status is JobStatus.COMPLETED
    assert job.result == {"pid": back.pid, "recoveries": 1, "state_lost": False}
    assert not RunLog.read(cluster.runs).started_by(other.pid), "the idle worker never ran it"


async def test_affinity_past_the_grace_another_worker_runs_it_told_the_state_is_gone(
    sqlite_cluster: Cluster,
) -> None:
    cluster = sqlite_cluster
    main = await cluster.start_main("--affinity-grace", "1")
    holder = await cluster.start_worker("holder")
    gate = cluster.dir / "gate"
    [key] = await enqueue(cluster, [hold_state_spec(gate)])
    await eventually(lambda: RunLog.read(cluster.runs).started_by(holder.pid), "holder to start")
    other = await cluster.start_worker("other")
    await holder.kill()
    await eventually(lambda: RunLog.read(cluster.runs).started_by(other.pid), "other to take it")
    gate.touch()
    async with observe(cluster.url) as store:
        await wait_until_all_terminal(store, 1, cluster)
    assert await main.terminate() == 0
    job = (await final_jobs(cluster.url))[key]
    assert job.status is JobStatus.COMPLETED
    assert job.result == {"pid": other.pid, "recoveries": 1, "state_lost": True}


@pytest.mark.soak
async def test_affinity_a_holder_back_without_its_state_dir_releases_the_recovery_at_once(
    sqlite_cluster: Cluster,
) -> None:
    cluster = sqlite_cluster
    main = await cluster.start_main("--affinity-grace", "600")  # longer than any wait here
    holder = await cluster.start_worker("holder", "--state-dir", str(cluster.dir / "state-1"))
    gate = cluster.dir / "gate"
    [key] = await enqueue(cluster, [hold_state_spec(gate)])
    await eventually(lambda: RunLog.read(cluster.runs).started_by(holder.pid), "holder to start")
    await holder.kill()
    # The same id on the same machine, but a new state directory: the state is gone.
    back = await cluster.start_worker("holder", "--state-dir", str(cluster.dir / "state-2"))
    await eventually(lambda: RunLog.read(cluster.runs).started_by(back.pid), "holder again")
    gate.touch()
    async with observe(cluster.url) as store:
        await wait_until_all_terminal(store, 1, cluster)
    assert await main.terminate() == 0
    job = (await final_jobs(cluster.url))[key]
    assert job.result == {"pid": back.pid, "recoveries": 1, "state_lost": True}


async def test_affinity_a_connected_holder_that_never_frees_a_slot_is_passed_over_at_the_cap(
    sqlite_cluster: Cluster,
) -> None:
    """The cap on a recovery's wait (``--affinity-max-wait``): the holder comes back and
    stays connected, but its one slot runs a job that never ends. At each deadline the
    wait is extended (the main logs why: the holder is connected), and at the maximum
    another worker runs the recovery, told its state is lost."""
    cluster = sqlite_cluster
    main = await cluster.start_main("--affinity-grace", "0.5", "--affinity-max-wait", "3")
    holder = await cluster.start_worker("holder", concurrency=1)
    gate = cluster.dir / "gate"
    [key] = await enqueue(cluster, [hold_state_spec(gate)])
    await eventually(lambda: RunLog.read(cluster.runs).started_by(holder.pid), "holder to start")
    await holder.kill()
    async with observe(cluster.url) as store:

        async def taken_back() -> bool:
            job = await store.get_job(uuid.UUID(key))
            return job is not None and job.status is JobStatus.QUEUED

        await eventually(taken_back, "the lost attempt to be taken back", detail=cluster.logs)
        # Ahead of the recovery (a higher priority), a job that holds the holder's only slot.
        blocker = replace(hold_spec(cluster.dir / "never"), priority=10)
        [blocking] = await enqueue(cluster, [blocker])
        # No prefetch: the holder takes in no job beyond its one slot.
        back = await cluster.start_worker("holder", "--prefetch", "0", concurrency=1)
        await eventually(
            lambda: blocking in RunLog.read(cluster.runs).started_by(back.pid),
            "the blocker to take the holder's slot",
            detail=cluster.logs,
        )
        other = await cluster.start_worker("other")
        await eventually(
            lambda: key in RunLog.read(cluster.runs).started_by(other.pid),
            "another worker to run the recovery at the cap",
            detail=cluster.logs,
        )
        gate.touch()

        async def finished() -> bool:
            job = await store.get_job(uuid.UUID(key))
            return job is not None and job.status is JobStatus.COMPLETED

        await eventually(finished, "the recovery to complete", detail=cluster.logs)
        job = await store.get_job(uuid.UUID(key))
        assert job is not None
        assert job.result == {"pid": other.pid, "recoveries": 1, "state_lost": True}
    log = main.output()
    extended = [line for line in log.splitlines() if "recovery wait extended" in line]
    assert extended and all("holder connected" in line for line in extended), log[-3000:]
    assert log.count("recovery released at the affinity's maximum wait") == 1, log[-3000:]
