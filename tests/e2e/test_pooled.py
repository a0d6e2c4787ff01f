"""Pooled and forked runners with real child processes, behind a real worker and main."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import tests.flaky_app
import tests.pool_app  # noqa: F401
from adapters.memory import MemoryAdapter
from broker.jobs import ExecutionMode, Job, JobSpec, JobStatus
from broker.main.main import Main
from broker.main.settings import MainSettings
from broker.ops.composition import RunnerOptions, build_runners
from broker.storage import StorageAdapter
from broker.tasks.registry import default_registry
from broker.worker.worker import Worker
from runners.pooled import PooledRunner
from tests.support import until

pytestmark = pytest.mark.slow

APP = "tests.pool_app"
POOLED = ExecutionMode.POOLED


@dataclass
class Cluster:
    main: Main
    store: StorageAdapter
    worker: Worker
    runners: dict[ExecutionMode, Any]

    @property
    def pool(self) -> PooledRunner:
        runner = self.runners[POOLED]
        assert isinstance(runner, PooledRunner)
        return runner

    async def enqueue(self, task: str, *args: Any, n: int = 1, **kw: Any) -> list[Job]:
        specs = [JobSpec(task=f"{APP}.{task}", args=list(args), **kw) for _ in range(n)]
        jobs = [r.job for r in await self.store.enqueue_many(specs)]
        self.main.wake()
        return jobs

    async def settled(self, jobs: list[Job], timeout: float = 30.0) -> list[Job]:
        async def done() -> list[Job] | None:
            now = [await self.store.get_job(j.id) for j in jobs]
            if all(j is not None and j.status.is_terminal for j in now):
                return [j for j in now if j is not None]
            return None

        return await until(done, timeout)

    def credit(self, mode: ExecutionMode = POOLED) -> int:
        sessions = [s for s in self.main.sessions.values() if s.worker_id == "pool-worker"]
        return sessions[0].state.credits.available(mode) if sessions else -1


@contextlib.asynccontextmanager
async def cluster(
    store: StorageAdapter | None = None,
    queues: list[str] | None = None,
    prefetch: int = 0,  # credit equals free slots exactly unless a test asks for a window
    **options: Any,
) -> AsyncIterator[Cluster]:
    store = store or MemoryAdapter()
    main = Main(
        store,
        MainSettings(port=0, ping_interval=0.5, liveness_timeout=5, error_retry_interval=0.05),
        retry_delay_fn=lambda n: timedelta(0),
    )
    await main.start()
    defaults: dict[str, Any] = {
        "apps": (APP, "tests.flaky_app"),
        "inline_concurrency": 2,
        "pooled_runner_count": 2,
        "forked_concurrency": 2,
        "kill_grace": 0.5,
        "startup_timeout": 20.0,
    }
    runners = build_runners(RunnerOptions(**{**defaults, **options}), default_registry)
    worker = Worker(
        "127.0.0.1",
        main.port,
        worker_id="pool-worker",
        runners=runners,
        registry=default_registry,
        ping_interval=0.5,
        liveness_timeout=5,
        queues=queues,
        prefetch=prefetch,
    )
    running = asyncio.create_task(worker.run())
    try:
        yield Cluster(main, store, worker, dict(runners))
    finally:
        worker.request_stop(fast=True)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(running, 20)
        await main.stop()


async def test_credits_equal_free_capacity_and_one_ready_fills_the_pool() -> None:
    async with cluster(pooled_runner_count=2, pooled_runner_concurrency=2) as c:
        assert await until(lambda: _eq(c.credit, 4)), "advertises count x concurrency"
        jobs = await c.enqueue("nap", 1.0, n=6)
        await until(lambda: _eq(lambda: len(c.pool.status().details["children"]), 2))
        running = await until(lambda: _running(c, 4))
        assert running == 4, "one readiness message filled all four slots"
        assert c.credit() == 0
        done = await c.settled(jobs)
        assert all(j.status is JobStatus.COMPLETED for j in done)
        pids = [j.result for j in done]
        assert len(set(pids)) == 2, "both warm children served"
        assert await until(lambda: _eq(c.credit, 4))


async def _eq(get: Callable[[], Any], want: Any) -> bool:
    return bool(get() == want)


async def _running(c: Cluster, want: int) -> int | None:
    busy = c.pool.status().busy
    return busy if busy == want else None


async def test_jobs_in_flight_never_exceed_capacity_under_a_storm() -> None:
    async with cluster(pooled_runner_count=2, pooled_runner_concurrency=2) as c:
        jobs = await c.enqueue("nap", 0.01, n=120)
        peak = 0
        leases_peak = 0
        while True:
            peak = max(peak, c.pool.status().busy)
            # Leases the main holds may briefly include finished jobs whose reports are
            # still committing; what must never exceed capacity is work on the worker.
            leases_peak = max(leases_peak, c.worker.status()["running"])
            states = [await c.store.get_job(j.id) for j in jobs]
            if all(s is not None and s.status.is_terminal for s in states):
                break
            await asyncio.sleep(0.002)
        assert peak <= 4 and leases_peak <= 4, (peak, leases_peak)
        assert peak == 4, "the pool was actually filled"
        assert all(s is not None and s.status is JobStatus.COMPLETED for s in states)


async def test_kill_9_of_a_child_recovers_its_job_and_spares_the_others() -> None:
    async with cluster(pooled_runner_count=2) as c:
        victim_job, other_job = await c.enqueue("nap", 1.5, n=2)

        async def both_ready_and_busy() -> list[dict[str, Any]] | None:
            kids = c.pool.status().details["children"]
            return kids if len(kids) == 2 and all(k["ready"] and k["busy"] for k in kids) else None

        children = await until(both_ready_and_busy)
        await asyncio.sleep(0.3)  # the job lines reach the children
        victim = next(ch for ch in children if ch["busy"])
        os.kill(victim["pid"], signal.SIGKILL)
        # Capacity is back at once: the dead child's slot is free before any job ends.
        assert await until(lambda: _eq(c.pool.free_slots, 1), timeout=2)
        done = await c.settled([victim_job, other_job])
        assert all(j.status is JobStatus.COMPLETED for j in done)
        by_recoveries = sorted(done, key=lambda j: j.recoveries)
        assert by_recoveries[0].recoveries == 0, "the other child's job was untouched"
        assert by_recoveries[1].recoveries == 1, "the killed job recovered"
        assert all(j.attempts == 0 for j in done), "a lost attempt is no failure"
        assert "SIGKILL" in (by_recoveries[1].last_error or "")
        assert by_recoveries[1].result != victim["pid"]


async def test_a_child_that_crashes_at_import_revokes_pooled_credit_until_fixed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    marker = tmp_path / "fail-import"
    marker.write_text("fail")
    monkeypatch.setenv("FLAKY_APP_FAIL_IMPORT", str(marker))
    caplog.set_level(logging.INFO, logger="broker.runner")
    async with cluster(pooled_runner_count=1, apps=("tests.flaky_app",)) as c:
        await until(lambda: _eq(lambda: c.pool.status().startup_error is not None, True))
        assert "simulated start-up failure" in str(c.pool.status().startup_error)
        # A ready has come once the inline credit shows (the worker connects once its pool
        # has failed to start, so before it there is no credit of any mode).
        assert await until(lambda: _eq(lambda: c.credit(ExecutionMode.INLINE), 2)), (
            "other modes keep their credit"
        )
        assert c.credit() == 0, "pooled credit revoked"
        [job] = [r.job for r in await c.store.enqueue_many([JobSpec(task="tests.flaky_app.ok")])]
        c.main.wake()
        await asyncio.sleep(1.5)
        stored = await c.store.get_job(job.id)
        assert stored is not None and stored.status is JobStatus.QUEUED, "nothing dispatched"
        failures = caplog.text.count("failed to start; slots revoked")
        assert failures <= 4, f"{failures} start attempts in 1.5 s: that is a crash loop"
        monkeypatch.setenv("FLAKY_APP_FAIL_ONCE", "1")  # children inherit it: next one heals
        os.environ["FLAKY_APP_FAIL_ONCE"] = "1"
        marker.unlink()
        [done] = await c.settled([job], timeout=40)
        assert done.status is JobStatus.COMPLETED and done.attempts == 0
        assert c.pool.status().startup_error is None


async def test_a_child_that_fails_its_first_import_only_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "fail-once"
    marker.write_text("fail")
    monkeypatch.setenv("FLAKY_APP_FAIL_IMPORT", str(marker))
    monkeypatch.setenv("FLAKY_APP_FAIL_ONCE", "1")
    async with cluster(pooled_runner_count=1, apps=("tests.flaky_app",)) as c:
        [job] = [r.job for r in await c.store.enqueue_many([JobSpec(task="tests.flaky_app.ok")])]
        c.main.wake()
        [done] = await c.settled([job], timeout=40)
        assert done.status is JobStatus.COMPLETED
        assert not marker.exists(), "the first child did fail its import"


async def test_a_job_past_its_timeout_is_stopped_even_if_it_ignores_sigterm() -> None:
    async with cluster(pooled_runner_count=1) as c:
        [job] = await c.enqueue("stubborn", 60, timeout=0.5, max_attempts=1)
        await until(lambda: _running(c, 1))
        pid = c.pool.status().details["children"][0]["pid"]
        [done] = await c.settled([job], timeout=15)
        assert done.status is JobStatus.FAILED
        assert "timed out after 0.5 s" in (done.last_error or "")
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        [after] = await c.settled(await c.enqueue("whoami"))
        assert after.status is JobStatus.COMPLETED and after.result != pid


async def _serving_pid(c: Cluster, other_than: int) -> int | None:
    """The pid of the one ready child in the pool's place once it is not ``other_than``."""
    kids = c.pool.status().details["children"]
    serving = [k for k in kids if k["ready"] and not k["retiring"] and not k["successor"]]
    return serving[0]["pid"] if len(serving) == 1 and serving[0]["pid"] != other_than else None


async def test_recycling_by_job_count_happens_between_jobs() -> None:
    async with cluster(pooled_runner_count=1, pooled_max_jobs=3) as c:
        pids = []
        for _ in range(3):
            [done] = await c.settled(await c.enqueue("whoami"))
            pids.append(done.result)
        assert pids[0] == pids[1] == pids[2]
        successor = await until(lambda: _serving_pid(c, pids[0]))
        [after] = await c.settled(await c.enqueue("whoami"))
        assert after.result == successor != pids[0]


async def test_recycling_by_memory_and_by_age_never_interrupts_a_job() -> None:
    async with cluster(pooled_runner_count=1, pooled_max_rss_bytes=80 << 20) as c:
        [small] = await c.settled(await c.enqueue("whoami"))
        [big] = await c.settled(await c.enqueue("hog", 120))
        assert big.status is JobStatus.COMPLETED and small.result == big.result
        successor = await until(lambda: _serving_pid(c, big.result))
        [after] = await c.settled(await c.enqueue("whoami"))
        assert after.result == successor, "recycled after the job that grew it"
    async with cluster(pooled_runner_count=1, pooled_max_lifetime=0.3) as c:
        [long] = await c.settled(await c.enqueue("nap", 1.0))
        assert long.status is JobStatus.COMPLETED, "a child past its lifetime finishes its job"
        await until(lambda: _serving_pid(c, long.result))
        [after] = await c.settled(await c.enqueue("whoami"))
        assert after.result != long.result  # (0.3 s later its successor may be replaced too)


async def test_print_in_a_task_breaks_nothing_and_is_logged_with_the_job_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="broker.runner")
    async with cluster(pooled_runner_count=1) as c:
        [done] = await c.settled(await c.enqueue("noisy", "hello from the task"))
        assert done.status is JobStatus.COMPLETED and done.result == "hello from the task"
        assert f"[job {done.id}] hello from the task" in caplog.text
        [again] = await c.settled(await c.enqueue("whoami"))
        assert again.status is JobStatus.COMPLETED


async def test_inline_pooled_and_forked_jobs_run_side_by_side() -> None:
    async with cluster(pooled_runner_count=1, forked_concurrency=2) as c:
        specs = [
            JobSpec(task=f"{APP}.inline_pid", execution_mode=ExecutionMode.INLINE),
            JobSpec(task=f"{APP}.whoami"),
            JobSpec(task=f"{APP}.forked_pid", execution_mode=ExecutionMode.FORKED),
            JobSpec(task=f"{APP}.forked_pid", execution_mode=ExecutionMode.FORKED),
        ]
        jobs = [r.job for r in await c.store.enqueue_many(specs)]
        c.main.wake()
        inline, pooled, forked1, forked2 = await c.settled(jobs)
        assert all(j.status is JobStatus.COMPLETED for j in (inline, pooled, forked1, forked2))
        assert inline.result == os.getpid()
        assert len({os.getpid(), pooled.result, forked1.result, forked2.result}) == 4


async def test_invalid_runner_options_are_refused_before_anything_starts() -> None:
    from broker.exceptions import ConfigurationError

    for bad in (
        {"pooled_runner_concurrency": 0},
        {"pooled_max_jobs": -1},
        {"pooled_max_lifetime": 0},
        {"forked_concurrency": -2},
        {"kill_grace": float("nan")},
    ):
        with pytest.raises(ConfigurationError):
            build_runners(RunnerOptions(apps=(APP,), **bad), default_registry)


async def test_an_idle_child_that_stops_answering_pings_is_replaced() -> None:
    pool = PooledRunner(
        [APP], registry=default_registry, count=1, ping_interval=0.2, kill_grace=0.2
    )
    await pool.start()
    try:

        async def ready_pid() -> int | None:
            kids = pool.status().details["children"]
            return kids[0]["pid"] if kids and kids[0]["ready"] else None

        frozen = await until(ready_pid)
        os.kill(frozen, signal.SIGSTOP)

        async def gone() -> bool:
            try:
                os.kill(frozen, 0)
            except ProcessLookupError:
                return True
            return False

        assert await until(gone, timeout=10), "the wedged child was killed"
        assert pool.free_slots() == 1, "its slot is free for a replacement"
    finally:
        await pool.stop(grace=1)


async def test_the_pool_is_warm_when_start_returns_and_a_child_that_fails_does_not_hold_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = PooledRunner([APP], registry=default_registry, count=2)
    await pool.start()
    try:
        children = pool.status().details["children"]
        assert [c["ready"] for c in children] == [True, True], "the worker connects warm"
    finally:
        await pool.stop(grace=1)
    marker = tmp_path / "fail-import"
    marker.write_text("fail")
    monkeypatch.setenv("FLAKY_APP_FAIL_IMPORT", str(marker))
    broken = PooledRunner(["tests.flaky_app"], registry=default_registry, count=1)
    await broken.start()
    try:
        assert "simulated start-up failure" in str(broken.status().startup_error)
        assert broken.free_slots() == 0, "no credit for a pool that cannot start"
    finally:
        await broken.stop(grace=1)


def _assignment(task: str, *args: Any, timeout: float | None = None) -> Any:
    from broker.tasks.runner import Assignment

    return Assignment(
        uuid.uuid4(),
        uuid.uuid4(),
        f"{APP}.{task}",
        args,
        {},
        ExecutionMode.FORKED,
        1,
        1,
        timeout,
        "default",
    )


async def test_forked_jobs_follow_the_same_timeout_and_crash_rules() -> None:
    from broker.tasks.runner import Completed, Failed
    from runners.forked import ForkedRunner

    forked = ForkedRunner([APP], registry=default_registry, concurrency=2, kill_grace=0.3)
    await forked.start()
    try:
        first, second = await asyncio.gather(
            forked.run(_assignment("whoami")), forked.run(_assignment("whoami"))
        )
        assert isinstance(first, Completed) and isinstance(second, Completed)
        assert first.result != second.result != os.getpid(), "a fresh process per job"
        stuck = await forked.run(_assignment("stubborn", 60, timeout=0.4))
        assert isinstance(stuck, Failed) and "timed out after 0.4 s" in stuck.error
        crashed = await forked.run(_assignment("die"))
        assert isinstance(crashed, Failed) and "SIGKILL" in crashed.error and crashed.retry
        assert forked.free_slots() == 2, "every slot came back"
    finally:
        await forked.stop(grace=1)


# Issue 30, finding 9: a job's time limit counts from its start, not from its child's
# spawn, and a job whose children keep failing to start ends instead of going back for
# ever. tests.slow_import_app takes 0.6 s to import (in each child, and once here).

SLOW_APP = "tests.slow_import_app"
FORKED = ExecutionMode.FORKED


async def test_a_forked_job_with_a_limit_shorter_than_its_childs_import_completes() -> None:
    import tests.slow_import_app  # noqa: F401 - registers the tasks; 0.6 s, so only here

    async with cluster(apps=(SLOW_APP,), pooled_runner_count=0, forked_concurrency=1) as c:
        specs = [
            JobSpec(task=f"{SLOW_APP}.quick", execution_mode=FORKED, timeout=0.3, max_attempts=1),
            JobSpec(
                task=f"{SLOW_APP}.sleepy",
                args=[30],
                execution_mode=FORKED,
                timeout=0.3,
                max_attempts=2,
            ),
        ]
        jobs = [r.job for r in await c.store.enqueue_many(specs)]
        c.main.wake()
        quick, sleepy = await c.settled(jobs, timeout=60)
        assert quick.status is JobStatus.COMPLETED and quick.attempts == 0, quick.last_error
        assert sleepy.status is JobStatus.FAILED and sleepy.attempts == 2, "its body is too long"
        assert "timed out after 0.3 s" in str(sleepy.last_error)
        forked = c.runners[FORKED].status()
        assert forked.startup_error is None, "the mode was never flagged broken"
        assert forked.details["child_starts"] == 3, "one process per run, none killed unready"


async def test_a_pooled_job_waiting_for_a_starting_child_is_not_charged_its_start_up() -> None:
    import tests.slow_import_app  # noqa: F401 - registers the tasks; 0.6 s, so only here
    from broker.tasks.runner import Assignment, Completed

    pool = PooledRunner([SLOW_APP], registry=default_registry, count=1, kill_grace=0.3)
    await pool.start()
    try:
        [first] = pool.status().details["children"]
        os.kill(first["pid"], signal.SIGKILL)

        def replacement_starting() -> bool:
            kids = pool.status().details["children"]
            return len(kids) == 1 and kids[0]["pid"] != first["pid"] and not kids[0]["ready"]

        await until(replacement_starting)
        job = Assignment(
            uuid.uuid4(), uuid.uuid4(), f"{SLOW_APP}.quick", (), {}, POOLED, 1, 1, 0.3, "default"
        )
        outcome = await pool.run(job)  # taken by the child still importing the app
        assert isinstance(outcome, Completed), outcome
        assert pool.status().startup_error is None
    finally:
        await pool.stop(grace=1)


async def test_a_child_slower_than_the_start_up_bound_is_a_start_up_failure() -> None:
    import tests.slow_import_app  # noqa: F401 - registers the tasks; 0.6 s, so only here
    from broker.tasks.runner import Assignment, Released
    from runners.forked import ForkedRunner

    forked = ForkedRunner([SLOW_APP], registry=default_registry, concurrency=1, startup_timeout=0.2)
    await forked.start()
    try:
        job = Assignment(
            uuid.uuid4(), uuid.uuid4(), f"{SLOW_APP}.quick", (), {}, FORKED, 1, 1, 60.0, "default"
        )
        outcome = await forked.run(job)
        assert isinstance(outcome, Released), outcome
        assert "no ready handshake within 0.2 s" in outcome.reason
        assert forked.free_slots() == 0, "the mode is flagged broken: no credit"
        assert "no ready handshake" in str(forked.status().startup_error)
    finally:
        await forked.stop(grace=1)


async def test_a_job_whose_children_keep_failing_to_start_ends_and_the_mode_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from broker.model.bounds import RUNNER_START_FAILURES_FORGIVEN

    imports = tmp_path / "imports"
    monkeypatch.setenv("FLAKY_APP_ALTERNATE", str(imports))  # every job's process fails
    async with cluster(apps=("tests.flaky_app",), pooled_runner_count=0, forked_concurrency=1) as c:
        spec = JobSpec(task="tests.flaky_app.ok", execution_mode=FORKED, max_attempts=2)
        [job] = [r.job for r in await c.store.enqueue_many([spec])]
        c.main.wake()
        [dead] = await c.settled([job], timeout=90)
        tries = RUNNER_START_FAILURES_FORGIVEN + 2  # two forgiven, then its two attempts
        assert dead.status is JobStatus.FAILED and dead.attempts == 2, dead.last_error
        assert f"failed to start {tries} times for this job" in str(dead.last_error)
        assert "simulated start-up failure" in str(dead.last_error), "the cause is shown"
        assert imports.stat().st_size <= 2 * tries, "one probe between two tries, no loop"
        # The probe after its last try starts: the mode recovers and advertises credit.
        assert await until(lambda: _eq(lambda: c.credit(FORKED), 1), timeout=30)
        assert c.runners[FORKED].status().startup_error is None
        monkeypatch.delenv("FLAKY_APP_ALTERNATE")
        fresh_spec = JobSpec(task="tests.flaky_app.ok", execution_mode=FORKED)
        [fresh] = [r.job for r in await c.store.enqueue_many([fresh_spec])]
        c.main.wake()
        [again] = await c.settled([fresh], timeout=30)
        assert again.status is JobStatus.COMPLETED and again.attempts == 0, again.last_error


async def test_a_recycling_child_with_jobs_left_never_pushes_the_pool_past_capacity() -> None:
    async with cluster(pooled_runner_count=1, pooled_runner_concurrency=2, pooled_max_jobs=2) as c:
        peak = 0
        pids: set[int] = set()
        # The old child serves until its successor is ready, so how many jobs one round
        # takes before a successor starts depends on the machine's load (a loaded run once
        # ran a whole round on the first child): rounds go on until a successor has taken
        # a job, with the pool's peak watched through all of them.
        while len(pids) < 2:
            jobs = []
            for _ in range(10):  # a long job keeps each retiring child busy past its last short one
                jobs += await c.enqueue("nap", 0.4)
                jobs += await c.enqueue("nap", 0.01, n=2)
            while True:
                peak = max(peak, c.pool.status().busy)
                states = [await c.store.get_job(j.id) for j in jobs]
                if all(s is not None and s.status.is_terminal for s in states):
                    break
                await asyncio.sleep(0.002)
            assert all(s is not None and s.status is JobStatus.COMPLETED for s in states)
            pids |= {s.result for s in states if s is not None}
            assert peak <= 2, f"{peak} jobs at once on a pool of capacity 2"
        assert c.pool.status().details["child_recycles"] >= 1, "children were recycled"
