"""End to end: checkpoints survive ``kill -9`` of a worker and of its pooled child, and a
frozen-then-thawed worker's late checkpoint is fenced (real processes, TCP, SQLite).

What each run saw and did comes from the log ``tests/checkpoint_app.py`` writes inside
the runs (see there); the rule checked is the guarantee in ``docs/guarantees.md``: every
attempt after the first begins from the newest checkpoint acknowledged before it began,
or a newer one that was asked for, never an older one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from broker.jobs import ExecutionMode, JobSpec
from tests.checkpoint_app import blob
from tests.e2e.test_e2e import Cluster, eventually, sqlite_url
from tests.e2e.test_e2e import store_url as store_url  # the fixture: SQLite, PostgreSQL
from tests.integration.test_operator import _cli

pytestmark = pytest.mark.slow

APP = "tests.checkpoint_app"
MAIN = ("--retry-backoff", "fixed:0.1")
STEADY = ("--ping-interval", "1", "--liveness-timeout", "10")
"""For the tests that count runs exactly: a loaded machine must not make the main judge
a live worker gone (the freeze test keeps the one-second timeout it relies on)."""
WAIT = 120.0
"""A generous bound on every wait: two test processes share the machine with others."""


@dataclass(frozen=True)
class Event:
    kind: str
    at: float
    pid: int
    value: str


def events(directory: Path) -> list[Event]:
    """Every run's events, across processes, in time order."""
    found = []
    for path in directory.glob("ckpt-*.log"):
        pid = int(path.stem.split("-")[1])
        for line in path.read_text().split("\n")[:-1]:
            kind, at, *rest = line.split()
            found.append(Event(kind, float(at), pid, " ".join(rest)))
    return sorted(found, key=lambda e: e.at)


def check_resumes(log: list[Event]) -> list[int]:
    """Every start after the first resumes from a step asked for, at or after the newest
    step acknowledged before it; returns the step each start resumed from."""
    acked, asked, resumed = 0, {0}, []
    starts = [e for e in log if e.kind == "start"]
    assert starts and starts[0].value.split()[1] == "-", "the first run starts afresh"
    for event in log:
        if event.kind == "asked":
            asked.add(int(event.value))
        elif event.kind == "acked":
            acked = max(acked, int(event.value))
        elif event.kind == "start" and event is not starts[0]:
            attempt, origin, _ = event.value.split()
            step = 0 if origin == "-" else int(origin)
            assert step >= acked, f"attempt {attempt} resumed from {step}, older than {acked}"
            assert step in asked, f"attempt {attempt} resumed from {step}, never saved"
            resumed.append(step)
    return resumed


class Checkpointing(Cluster):
    def _env(self) -> dict[str, str]:
        return {**super()._env(), "CHECKPOINT_TEST_LOG_DIR": str(self.runs)}

    async def worker(self, worker_id: str, *extra: str) -> object:
        argv = ["worker", "--main", f"127.0.0.1:{self.port}", "--app", APP]
        argv += ["--worker-id", worker_id]
        proc = await self.spawn(worker_id, *argv, *extra)
        await proc.wait_for_output("connected to main", timeout=WAIT)
        return proc


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Checkpointing]:
    cluster = Checkpointing(tmp_path, sqlite_url(tmp_path))
    try:
        yield cluster
    finally:
        await cluster.close()


def child_pids(parent: int) -> list[int]:
    out = subprocess.run(
        ["pgrep", "-P", str(parent)], capture_output=True, text=True, check=False
    ).stdout
    return [int(pid) for pid in out.split()]


def gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie waiting to be reaped has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


async def broker(cluster: Cluster, *argv: str) -> str:
    """``broker ARGV`` as an operator runs it, through the main: its entry point in this
    process, on a thread (this test's own client keeps answering the main's pings
    meanwhile), its output captured; a process of it would cost half a second of CPU."""
    code, out, err = await _cli("--main", f"127.0.0.1:{cluster.port}", *argv)
    assert code == 0, f"broker {argv} exited with {code}: {err}"
    return out


async def test_kill_9_of_child_and_worker_resumes_from_the_last_acknowledged_checkpoint(
    cluster: Checkpointing,
) -> None:
    total = 150
    main = await cluster.start_main(*MAIN)
    workers = [await cluster.worker("a", "--pooled-runner-count", "1")]
    async with cluster.client() as client:
        # Five kills are five lost attempts: more recoveries than the main's default.
        spec = JobSpec(task=f"{APP}.count_up", args=[total], max_recoveries=10)
        [ref] = await client.enqueue_many([spec])
        job_id = ref.job_id

        async def reached(step: int) -> None:
            def done() -> bool:
                acked = [int(e.value) for e in events(cluster.runs) if e.kind == "acked"]
                return bool(acked) and max(acked) >= step

            await eventually(done, f"step {step} acknowledged", timeout=WAIT, detail=cluster.logs)

        kills = 0
        for step in (20, 40, 60):  # the child, three times
            await reached(step)
            [child] = child_pids(workers[0].pid)  # type: ignore[attr-defined]
            os.kill(child, signal.SIGKILL)
            kills += 1
        orphans: list[int] = []
        for step, name in ((80, "b"), (100, "c")):  # then the worker, twice
            await reached(step)
            orphans += child_pids(workers[-1].pid)  # type: ignore[attr-defined]
            await workers[-1].kill()  # type: ignore[attr-defined]
            workers.append(await cluster.worker(name, "--pooled-runner-count", "1"))
            kills += 1
        # A child whose worker died mid-job, its job waiting for a checkpoint answer
        # that can never come, exits instead of living on for ever.
        await eventually(
            lambda: all(gone(pid) for pid in orphans),
            "the dead workers' children to exit",
            timeout=WAIT,
            detail=cluster.logs,
        )

        async def shows_progress() -> bool:
            shown = json.loads(await broker(cluster, "job", str(job_id), "--json"))
            return shown["status"] == "completed" or (
                shown["progress"] is not None and shown["progress_message"].startswith("step")
            )

        # While it runs, the operator sees how far it is (the last value, not acked).
        await eventually(
            shows_progress, "broker job to show progress", timeout=WAIT, detail=cluster.logs
        )
        running = await broker(cluster, "job", str(job_id))
        if re.search(r"^status +handed_off$", running, re.MULTILINE):  # still running
            assert re.search(r"progress +0\.\d+", running), running
            assert re.search(r"progress_message +step \d+ of", running), running

        async def finished() -> bool:
            job = await client.get_job(job_id)
            return job is not None and job["status"] == "completed"

        await eventually(finished, "the job to complete", timeout=WAIT, detail=cluster.logs)
        job = await client.get_job(job_id)
    assert job is not None and job["result"] == total
    log = events(cluster.runs)
    resumed = check_resumes(log)
    assert len(resumed) >= kills, f"every kill cost an attempt: {resumed}"
    assert all(step > 0 for step in resumed), "each attempt continued"
    assert (job["recoveries"], job["attempts"]) == (kills, 0), "kills are recoveries"
    assert job["checkpoint"] == {"n": total} and job["checkpoint_seq"] >= total
    human = await broker(cluster, "job", str(job_id))
    assert re.search(r"checkpoint_at +\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", human), human
    # Completed is done: the progress is 1.0 whatever the run last reported, and the
    # last message stays.
    assert job["progress"] == 1.0 and str(job["progress_message"]).startswith("step")
    assert re.search(r"progress +1\.0\b", human), human
    assert re.search(r"100% step \d+ of", await broker(cluster, "jobs")), "broker jobs shows it"
    await main.terminate()


async def _stored(url: str) -> tuple[int, int]:
    """The longest checkpoint in a job row, and the checkpoint payloads' total size."""
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            in_rows = await conn.scalar(sa.text("SELECT max(length(checkpoint)) FROM broker_jobs"))
            apart = await conn.scalar(
                sa.text("SELECT sum(length(body)) FROM broker_payloads WHERE kind = 'checkpoint'")
            )
    finally:
        await engine.dispose()
    return int(in_rows or 0), int(apart or 0)


async def test_a_1_mib_checkpoint_survives_kill_9_of_its_worker(
    tmp_path: Path, store_url: str
) -> None:
    """The checkpoint lives outside the job row, comes back whole to the next attempt on
    another worker, and is deleted once a small checkpoint replaces it."""
    size = 1 << 20
    cluster = Checkpointing(tmp_path, store_url)
    try:
        await cluster.start_main(*MAIN, *STEADY)
        first = await cluster.worker("a", "--pooled-runner-count", "1")
        async with cluster.client() as client:
            [ref] = await client.enqueue_many([JobSpec(task=f"{APP}.hold_big", args=[size])])
            await eventually(
                lambda: any(e.kind == "acked" for e in events(cluster.runs)),
                "the 1 MiB checkpoint acknowledged",
                timeout=WAIT,
                detail=cluster.logs,
            )
            in_rows, apart = await _stored(store_url)
            assert in_rows < 100 and apart > size, "the store keeps it apart from the row"
            shown = json.loads(await broker(cluster, "job", str(ref.job_id), "--json"))
            assert shown["checkpoint"] == {"blob": blob(size)}, "broker job loads it"
            [orphan] = child_pids(first.pid)  # type: ignore[attr-defined]
            await first.kill()  # type: ignore[attr-defined]
            await cluster.worker("b", "--pooled-runner-count", "1")
            # Its run waits for an event that never comes: the child stops it and exits
            # once its worker is gone, instead of running on beside the recovery.
            await eventually(lambda: gone(orphan), "the dead worker's child to exit", timeout=WAIT)

            async def finished() -> bool:
                job = await client.get_job(ref.job_id)
                return job is not None and job["status"] == "completed"

            await eventually(finished, "the job to complete", timeout=WAIT, detail=cluster.logs)
            job = await client.get_job(ref.job_id)
        assert job is not None and job["recoveries"] == 1, "the kill cost one attempt"
        expected = hashlib.sha256(blob(size).encode()).hexdigest()
        assert job["result"] == {"size": size, "sha256": expected}, "the next attempt got it"
        assert (job["checkpoint"], job["checkpoint_seq"]) == ({"done": True}, 2)
        assert await _stored(store_url) == (len('{"done":true}'), 0), "no payload left behind"
        starts = [e.value.split()[:2] for e in events(cluster.runs) if e.kind == "start"]
        assert starts == [["1", "-"], ["1", "1"]], "a recovery, resumed from the checkpoint"
    finally:
        await cluster.close()


async def test_a_frozen_workers_late_checkpoint_is_fenced(cluster: Checkpointing) -> None:
    # The freeze comes once about 10 steps are saved, so the other run has some 50 steps
    # (2.5 s and more) left when the thawed run's next save, 0.05 s after the thaw, meets
    # the fence (it was 120 steps, the rest of which only made the test 3 s longer).
    total = 60
    await cluster.start_main(*MAIN)
    frozen = await cluster.worker("frozen")
    async with cluster.client() as client:
        spec = JobSpec(
            task=f"{APP}.count_up", args=[total, 0.05], execution_mode=ExecutionMode.INLINE
        )
        [ref] = await client.enqueue_many([spec])

        def on(pid: int, kind: str) -> list[Event]:
            return [e for e in events(cluster.runs) if e.pid == pid and e.kind == kind]

        await eventually(
            lambda: len(on(frozen.pid, "acked")) >= 10, "the first run to save", timeout=WAIT
        )  # type: ignore[attr-defined]
        os.kill(frozen.pid, signal.SIGSTOP)  # type: ignore[attr-defined]
        try:
            other = await cluster.worker("other")
            await eventually(lambda: on(other.pid, "acked"), "the job to move on", timeout=WAIT)  # type: ignore[attr-defined]
        finally:
            os.kill(frozen.pid, signal.SIGCONT)  # type: ignore[attr-defined]
        await eventually(
            lambda: on(frozen.pid, "rejected"), "the thawed run's save to fail", timeout=WAIT
        )  # type: ignore[attr-defined]

        async def finished() -> bool:
            job = await client.get_job(ref.job_id)
            return job is not None and job["status"] == "completed"

        await eventually(finished, "the job to complete", timeout=WAIT, detail=cluster.logs)
        job = await client.get_job(ref.job_id)
    assert job is not None and job["checkpoint"] == {"n": total}
    log = events(cluster.runs)
    check_resumes(log)
    [late] = on(frozen.pid, "rejected")  # type: ignore[attr-defined]
    late_acked = [e for e in on(frozen.pid, "acked") if e.at > late.at]  # type: ignore[attr-defined]
    assert not late_acked, "nothing the frozen run saved after its lease went was stored"
    # The store's checkpoint never went back: each of the other run's saves was taken in
    # order, and the last one stands.
    acked = [int(e.value) for e in on(other.pid, "acked")]  # type: ignore[attr-defined]
    assert acked == sorted(acked) and acked[-1] == total


@pytest.mark.soak
async def test_every_mode_and_flavour_resumes_a_failed_run_from_its_checkpoint(
    cluster: Checkpointing,
) -> None:
    """A failure retry continues from the checkpoint, for async and sync tasks, inline,
    pooled and forked."""
    await cluster.start_main(*MAIN, *STEADY)
    await cluster.worker("w", "--pooled-runner-count", "1", "--forked-concurrency", "2")
    specs = [
        JobSpec(task=f"{APP}.{name}", args=[12, 0.01, 5], execution_mode=mode)
        for name in ("count_up", "count_up_sync")
        for mode in ExecutionMode
    ]
    async with cluster.client() as client:
        refs = await client.enqueue_many(specs)

        async def all_done() -> bool:
            jobs = [await client.get_job(ref.job_id) for ref in refs]
            return all(job is not None and job["status"] == "completed" for job in jobs)

        await eventually(all_done, "every job to complete", timeout=WAIT, detail=cluster.logs)
        jobs = [await client.get_job(ref.job_id) for ref in refs]
    log = events(cluster.runs)
    for ref, job in zip(refs, jobs, strict=True):
        assert job is not None and job["attempts"] == 1 and job["checkpoint"] == {"n": 12}
        mine = [e for e in log if e.kind != "start" or e.value.endswith(str(ref.job_id))]
        starts = [e.value.split()[:2] for e in mine if e.kind == "start"]
        assert starts == [["1", "-"], ["2", "4"]], f"{job['task']} {job['execution_mode']}"


@pytest.mark.soak
async def test_a_main_restart_keeps_the_run_and_its_checkpoints(cluster: Checkpointing) -> None:
    """``kill -9`` of the main mid-run: the run waits for its checkpoint's answer, the
    worker sends it again to the next main, which adopts the lease; one run finishes."""
    total = 120
    main = await cluster.start_main(*MAIN, *STEADY, "--orphan-grace", "30")
    await cluster.worker("w", "--pooled-runner-count", "1")
    async with cluster.client() as client:
        # Five kills are five lost attempts: more recoveries than the main's default.
        spec = JobSpec(task=f"{APP}.count_up", args=[total], max_recoveries=10)
        [ref] = await client.enqueue_many([spec])

    def acked() -> list[int]:
        return [int(e.value) for e in events(cluster.runs) if e.kind == "acked"]

    await eventually(
        lambda: len(acked()) >= 30, "30 steps acknowledged", timeout=WAIT, detail=cluster.logs
    )
    await main.kill()
    await cluster.start_main(*MAIN, *STEADY, "--orphan-grace", "30")
    async with cluster.client() as client:

        async def finished() -> bool:
            job = await client.get_job(ref.job_id)
            return job is not None and job["status"] == "completed"

        await eventually(finished, "the job to complete", timeout=WAIT, detail=cluster.logs)
        job = await client.get_job(ref.job_id)
    assert job is not None and job["checkpoint"] == {"n": total} and job["attempts"] == 0
    log = events(cluster.runs)
    assert [e.kind for e in log].count("start") == 1, "the run was adopted, not repeated"
    assert acked() == list(range(1, total + 1)), "every save answered once, in order"
