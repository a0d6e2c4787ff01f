"""End to end: real ``broker-main`` and ``broker-worker`` processes, real TCP, real stores.

The faults are real as well: ``kill -9`` (``Process.kill``) of a worker and of the main,
SIGTERM drains, raw TCP peers that misbehave. What ran where comes from the run log that
``tests/e2e_app.py`` writes from inside the worker processes (a line per start and per
end, with the pid), and the final state comes from the store itself once the main has
stopped. Timeouts only bound waits on conditions; nothing here asserts on speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

import adapters
from broker.client.client import Client
from broker.jobs import ExecutionMode, Job, JobSpec, JobStatus
from broker.storage import JobFilter, StorageAdapter
from broker.wire import messages as protocol
from tests.conftest import require_postgres

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
APP = "tests.e2e_app"
RECORD = f"{APP}.record"
HOLD = f"{APP}.hold"
LOG_DIR_ENV = "BROKER_E2E_LOG_DIR"
"""Same as ``tests.e2e_app.LOG_DIR_ENV``; not imported, so this process registers no tasks."""

FAST_MAIN = ("--ping-interval", "0.2", "--liveness-timeout", "1", "--orphan-grace", "2")
LIVENESS_TIMEOUT = 1.0
ORPHAN_GRACE = 2.0
NO_POOL = ("--pooled-runner-count", "0")
"""A worker's default pool is a warm child per CPU, each a fresh interpreter importing the
app before the worker connects; the jobs of these clusters run inline, so their workers
start none unless a test asks (a later ``--pooled-runner-count`` in ``extra`` wins)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'broker.db'}"


_SQLITE_TEMPLATE: list[bytes] = []


async def put_migrated_sqlite(path: Path) -> None:
    """Write at ``path`` a SQLite store at the current schema version: the bytes of one the
    broker's own ``setup`` migrated once in this test process. A main that migrates a new
    file spends about 0.12 s of CPU (a fifth of its start) and a dozen fsyncs on it; the
    clusters of the end-to-end tests start about a hundred (``migrated_database`` does
    the same for PostgreSQL). The file is its owner's alone, as the broker makes it."""
    if not _SQLITE_TEMPLATE:
        with tempfile.TemporaryDirectory(prefix="broker-sqlite-template-") as directory:
            store = adapters.open_store(sqlite_url(Path(directory)))
            try:
                await store.setup()
            finally:
                await store.close()
            _SQLITE_TEMPLATE.append((Path(directory) / "broker.db").read_bytes())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(_SQLITE_TEMPLATE[0])


async def eventually(
    check: Callable[[], Any],
    what: str,
    *,
    timeout: float = 20.0,
    detail: Callable[[], str] | None = None,
) -> None:
    """Wait until ``check()`` (sync or async) is truthy; fail naming ``what`` if it is not.

    A check that raises fails at once, with ``detail()`` too: a client refused by a main
    that exited says nothing of why, and the processes' logs do."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
            if inspect.isawaitable(result):
                result = await result
        except Exception as exc:
            if detail is None:
                raise
            raised = f"waiting for {what}, the check raised {exc!r}"
            raise AssertionError(f"{raised}\n{detail()}") from exc
        if result:
            return
        if time.monotonic() > deadline:
            extra = f"\n{detail()}" if detail is not None else ""
            raise AssertionError(f"timed out after {timeout} s waiting for {what}{extra}")
        await asyncio.sleep(0.05)


# ------------------------------------------------------------------ processes


async def spawn_cli(log: Path, argv: list[str], env: dict[str, str]) -> asyncio.subprocess.Process:
    """``python -m broker.ops.cli ARGV`` as a real process in the checkout, its output (both
    streams) written to ``log``: how every end-to-end test starts a main, a worker or
    the operator command."""
    with log.open("wb") as out:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "broker.ops.cli",
            *argv,
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


@dataclass(eq=False)
class Proc:
    name: str
    process: asyncio.subprocess.Process
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, lines: int = 60) -> str:
        return f"--- {self.name} (pid {self.pid}) log tail ---\n" + "\n".join(
            self.output().splitlines()[-lines:]
        )

    async def wait_for_output(self, needle: str, count: int = 1, timeout: float = 20.0) -> None:
        def seen() -> bool:
            if self.output().count(needle) >= count:
                return True
            if self.process.returncode is not None:
                raise AssertionError(
                    f"{self.name} exited with {self.process.returncode} before logging "
                    f"{needle!r}\n{self.tail()}"
                )
            return False

        what = f"{self.name} to log {needle!r} x{count}"
        await eventually(seen, what, timeout=timeout, detail=self.tail)

    async def exit_code(self, timeout: float = 20.0) -> int:
        try:
            return await asyncio.wait_for(self.process.wait(), timeout)
        except TimeoutError:
            raise AssertionError(
                f"{self.name} still running after {timeout} s\n{self.tail()}"
            ) from None

    async def terminate(self, timeout: float = 20.0) -> int:
        """SIGTERM (a graceful stop for both the main and a worker) and the exit code."""
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
        return await self.exit_code(timeout)

    async def kill(self) -> None:
        """``kill -9``: no handler runs, no report goes out, sockets just vanish."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        await self.process.wait()


class SharedMain:
    """A ``broker-main`` process that several tests of a module share (a module-scoped
    fixture starts it, :class:`Cluster` takes it as ``main=``), each test with workers of
    its own on queues of its own: a main's start costs about 0.8 s of CPU, mostly imports,
    so a module whose tests check workers, not the main, pays it once. A test that kills,
    restarts or configures the main keeps a main of its own.

    A plain ``subprocess.Popen`` (not asyncio's): it outlives each test's event loop."""

    def __init__(self, directory: Path, url: str, *extra: str) -> None:
        self.port = free_port()
        self.log = directory / "shared-main.log"
        argv = ["main", "--database-url", url, "--port", str(self.port), *FAST_MAIN, *extra]
        env = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_")}
        env["PYTHONUNBUFFERED"] = "1"
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "broker.ops.cli", *argv],
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + 20.0
            while "broker-main listening on" not in self.output():
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"the shared main did not start\n{self.tail()}")
                time.sleep(0.05)  # a wait on a condition (the log line), polled
        except BaseException:
            self.close()
            raise

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, lines: int = 60) -> str:
        return f"--- shared main (pid {self.process.pid}) log tail ---\n" + "\n".join(
            self.output().splitlines()[-lines:]
        )

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


class Cluster:
    """One main (restartable on the same port and store) and its workers, as processes;
    or, given ``main``, workers of a :class:`SharedMain` that the cluster never stops."""

    def __init__(
        self, tmp_path: Path, url: str, *, token: str | None = None, main: SharedMain | None = None
    ) -> None:
        self.dir = tmp_path
        self.url = url
        self.token = token
        self.shared_main = main
        self.port = free_port() if main is None else main.port
        self.runs = tmp_path / "runs"
        self.runs.mkdir()
        self.procs: list[Proc] = []

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_")}
        env[LOG_DIR_ENV] = str(self.runs)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    async def spawn(self, name: str, *argv: str) -> Proc:
        log = self.dir / f"{len(self.procs):02d}-{name}.log"
        proc = Proc(name, await spawn_cli(log, list(argv), self._env()), log)
        self.procs.append(proc)
        return proc

    def _token_args(self) -> list[str]:
        return ["--token", self.token] if self.token else []

    async def start_main(self, *extra: str) -> Proc:
        """A main, once it listens; on this cluster's own SQLite file, the first finds the
        store already migrated (:func:`put_migrated_sqlite`) unless the test wrote it."""
        store = self.dir / "broker.db"
        if self.url == sqlite_url(self.dir) and not store.exists():
            await put_migrated_sqlite(store)
        argv = ["main", "--database-url", self.url, "--port", str(self.port)]
        argv += [*FAST_MAIN, *self._token_args(), *extra]
        proc = await self.spawn("main", *argv)
        await proc.wait_for_output("broker-main listening on")
        return proc

    async def start_worker(self, worker_id: str, *extra: str, concurrency: int = 8) -> Proc:
        """A worker, once connected and once the main has taken its task declarations.

        The declarations (its ``tasks`` message) follow ``welcome`` on their own, so a
        client may reach the main between the two. On a new store a job enqueued by name
        then gets the broker's defaults, not its task's (``pooled`` for a task declared
        ``forked``), and waits for ever at a worker serving only the declared mode: a
        test enqueues by name only after the main logged the declaration."""
        mains: list[Proc | SharedMain] = [
            p for p in self.procs if p.name == "main" and p.process.returncode is None
        ]
        if self.shared_main is not None:
            mains.append(self.shared_main)
        declared = f"tasks declared worker_id={worker_id} "
        before = [main.output().count(declared) for main in mains]
        argv = ["worker", "--main", f"127.0.0.1:{self.port}", "--app", APP]
        argv += ["--worker-id", worker_id, "--inline-concurrency", str(concurrency)]
        proc = await self.spawn(worker_id, *argv, *NO_POOL, *extra, *self._token_args())
        await proc.wait_for_output("connected to main")
        if mains:
            await eventually(
                lambda: any(
                    m.output().count(declared) > n for m, n in zip(mains, before, strict=True)
                ),
                f"the main to log {declared!r}",
                detail=self.logs,
            )
        return proc

    def client(self) -> Client:
        return Client("127.0.0.1", self.port, token=self.token)

    def logs(self) -> str:
        shared = [self.shared_main.tail()] if self.shared_main is not None else []
        return "\n".join([*shared, *(proc.tail() for proc in self.procs)])

    async def close(self) -> None:
        for proc in self.procs:
            await proc.kill()


# ------------------------------------------------------------------ the run log


@dataclass
class RunLog:
    """Who ran what, as the task itself recorded it: job key -> pids, per event."""

    starts: dict[str, list[int]]
    ends: dict[str, list[int]]

    @classmethod
    def read(cls, directory: Path) -> RunLog:
        starts: dict[str, list[int]] = defaultdict(list)
        ends: dict[str, list[int]] = defaultdict(list)
        for path in sorted(directory.glob("runs-*.log")):
            # The last piece is "" or a line still being written: ignore it.
            for line in path.read_text().split("\n")[:-1]:
                event, key, pid = line.split()
                (starts if event == "start" else ends)[key].append(int(pid))
        return cls(dict(starts), dict(ends))

    def started_by(self, pid: int) -> set[str]:
        return {key for key, pids in self.starts.items() if pid in pids}

    def ended_by(self, pid: int) -> set[str]:
        return {key for key, pids in self.ends.items() if pid in pids}

    def running_on(self, pid: int) -> set[str]:
        return self.started_by(pid) - self.ended_by(pid)

    def total_ends(self) -> int:
        return sum(len(pids) for pids in self.ends.values())


def returned_at_disconnect(main_log: str) -> set[str]:
    """Jobs whose lease the main gave back because a worker's connection ended."""
    pattern = r"lease queued for return job_id=(\S+) handoff_id=\S+ reason=worker connection ended"
    return set(re.findall(pattern, main_log))


def check_kill_reruns(
    jobs: dict[str, Job],
    runs: RunLog,
    *,
    killed: int,
    survivors: set[int],
    completed_before_kill: set[str],
    held_at_kill: set[str],
) -> set[str]:
    """Every job completed; a job ran twice only if the killed worker held it at the kill.

    ``held_at_kill`` is what the main gave back when the killed worker's connection
    ended. Returns the keys that ran twice.
    """
    rerun: set[str] = set()
    for key, job in jobs.items():
        starts = runs.starts.get(key, [])
        ends = runs.ends.get(key, [])
        assert job.status is JobStatus.COMPLETED, (key, job.status, job.last_error)
        assert starts, f"job {key} is completed but never ran"
        assert set(starts) <= {killed} | survivors, (key, starts)
        assert all(n == 1 for n in Counter(starts).values()), f"{key} ran twice on one pid"
        assert job.result in ends, f"{key}: result {job.result} is not from a run that finished"
        if killed in starts and killed not in ends:
            assert len(starts) == 2, f"{key} was cut short by the kill but ran {starts}"
        if len(starts) > 1:
            assert len(starts) == 2 and killed in starts, f"{key} ran {starts}"
            assert key not in completed_before_kill, f"{key} was completed, yet ran again"
            assert key in held_at_kill, f"{key} ran again but was not in flight at the kill"
            assert job.result != killed, f"{key}: the re-run, not the killed run, completed it"
            rerun.add(key)
    return rerun


# ------------------------------------------------------------------ the store


@contextlib.asynccontextmanager
async def observe(url: str) -> AsyncIterator[StorageAdapter]:
    """A read-only view of the main's store from this process (the main created it)."""
    store = adapters.open_store(url)
    try:
        yield store
    finally:
        await store.close()


async def jobs_in(store: StorageAdapter, statuses: Sequence[JobStatus] | None = None) -> list[Job]:
    found: list[Job] = []
    cursor: str | None = None
    job_filter = None if statuses is None else JobFilter(statuses=statuses)
    while True:
        page = await store.list_jobs(job_filter, limit=1000, cursor=cursor)
        found.extend(page.jobs)
        if page.next_cursor is None:
            return found
        cursor = page.next_cursor


async def status_counts(store: StorageAdapter) -> Counter[JobStatus]:
    counts: Counter[JobStatus] = Counter()
    for row in await store.count_jobs():
        counts[row.status] += row.count
    return counts


async def wait_until_all_terminal(
    store: StorageAdapter, total: int, cluster: Cluster, timeout: float = 30.0
) -> None:
    last: list[Counter[JobStatus]] = [Counter()]

    async def done() -> bool:
        last[0] = await status_counts(store)
        return sum(n for s, n in last[0].items() if s.is_terminal) >= total

    await eventually(
        done,
        f"all {total} jobs to finish",
        timeout=timeout,
        detail=lambda: f"counts: {dict(last[0])}\n{cluster.logs()}",
    )


async def final_jobs(url: str) -> dict[str, Job]:
    """Every job in the store, by id, read after the main has stopped."""
    async with observe(url) as store:
        return {str(job.id): job for job in await jobs_in(store)}


def record_spec(seconds: float = 0.0, task: str = RECORD) -> JobSpec:
    job_id = uuid.uuid4()
    return JobSpec(
        task=task, args=[str(job_id), seconds], id=job_id, execution_mode=ExecutionMode.INLINE
    )


def hold_spec(gate: Path) -> JobSpec:
    """A job that runs until the test creates ``gate``."""
    job_id = uuid.uuid4()
    return JobSpec(
        task=HOLD, args=[str(job_id), str(gate)], id=job_id, execution_mode=ExecutionMode.INLINE
    )


async def enqueue(cluster: Cluster, specs: Sequence[JobSpec], batch: int = 200) -> list[str]:
    async with cluster.client() as client:
        for start in range(0, len(specs), batch):
            results = await client.enqueue_many(specs[start : start + batch])
            assert [r.job_id for r in results] == [s.id for s in specs[start : start + batch]]
            assert not any(r.duplicate for r in results)
    return [str(s.id) for s in specs]


# ------------------------------------------------------------------ 1. kill -9 of a worker


async def test_kill_9_of_a_worker_reruns_only_the_jobs_it_held(sqlite_cluster: Cluster) -> None:
    cluster = sqlite_cluster
    main = await cluster.start_main()
    keys = await enqueue(cluster, [record_spec(0.1) for _ in range(16)])
    a = await cluster.start_worker("worker-a", concurrency=8)
    async with observe(cluster.url) as store:
        # Kill A while some of its jobs are done and acknowledged and others are running.
        # Arrange the running ones rather than race for them: jobs that run until the gate
        # opens come once A has finished 8 jobs. (Waiting for A to start one more job after
        # a snapshot failed under load: A had run all of its jobs before the test looked.)
        await eventually(
            lambda: len(RunLog.read(cluster.runs).ended_by(a.pid)) >= 8, "A to finish 8 jobs"
        )
        gate = cluster.dir / "gate"
        holds = [replace(hold_spec(gate), priority=10) for _ in range(8)]
        keys += await enqueue(cluster, holds)
        hold_keys = {str(spec.id) for spec in holds}
        await eventually(
            lambda: RunLog.read(cluster.runs).running_on(a.pid) & hold_keys,
            "A to be running a gated job",
        )
        completed_before_kill = {str(j.id) for j in await jobs_in(store, [JobStatus.COMPLETED])}
        await a.kill()
        cut_short = RunLog.read(cluster.runs).running_on(a.pid)
        assert cut_short & hold_keys, "the kill must catch jobs in flight"
        gate.touch()

        b = await cluster.start_worker("worker-b", concurrency=8)
        await wait_until_all_terminal(store, len(keys), cluster)
    assert await b.terminate() == 0
    assert await main.terminate() == 0
    held_at_kill = returned_at_disconnect(main.output())

    jobs = await final_jobs(cluster.url)
    assert set(jobs) == set(keys), "no job lost, none invented"
    runs = RunLog.read(cluster.runs)
    rerun = check_kill_reruns(
        jobs,
        runs,
        killed=a.pid,
        survivors={b.pid},
        completed_before_kill=completed_before_kill,
        held_at_kill=held_at_kill,
    )
    assert cut_short <= held_at_kill, "the main gave back every lease A was running"
    assert cut_short <= rerun, "every job the kill cut short ran again on B"
    assert all(runs.starts[key] == [a.pid] for key in completed_before_kill)


# ------------------------------------------------------------------ 2. kill -9 of the main


async def test_kill_9_of_the_main_workers_reconnect_and_nothing_runs_twice(
    sqlite_cluster: Cluster,
) -> None:
    cluster = sqlite_cluster
    # The workers retry at least every 0.5 s, so they are back well within the grace even
    # on a loaded machine (with the default backoff, which doubles up to 10 s, 4 s was
    # not enough at load 10 and more: the test used 8 s then).
    grace = 4.0
    main = await cluster.start_main("--orphan-grace", str(grace))
    fast_retry = ("--reconnect-max-delay", "0.5")
    w1 = await cluster.start_worker("worker-1", *fast_retry, concurrency=4)
    w2 = await cluster.start_worker("worker-2", *fast_retry, concurrency=4)
    gate = cluster.dir / "gate"
    held = await enqueue(cluster, [hold_spec(gate) for _ in range(4)])
    quick = await enqueue(cluster, [record_spec(0.3) for _ in range(16)])

    async with observe(cluster.url) as store:
        await eventually(
            lambda: all(k in RunLog.read(cluster.runs).starts for k in held),
            "every held job to start",
        )
        leases_at_kill = {str(j.id): j.handoff_id for j in await jobs_in(store)}
        await main.kill()
        main = await cluster.start_main("--orphan-grace", str(grace))
        for w in (w1, w2):
            await w.wait_for_output("connected to main", count=2)
        # Outwait the orphan grace: adopted leases must not be reaped when it ends. The
        # main logs the end of the grace after queueing (and logging) every return it
        # makes then, so none of the held jobs may be among them.
        await main.wait_for_output("orphan grace over")
        returned = re.findall(r"lease queued for return job_id=(\S+)", main.output())
        assert not set(held) & set(returned), "an adopted lease was returned at the grace"
        for key in held:
            job = await store.get_job(uuid.UUID(key))
            assert job is not None and job.status is JobStatus.HANDED_OFF, (key, job)
            assert job.handoff_id == leases_at_kill[key], "the lease survived the restart"
        gate.touch()
        await wait_until_all_terminal(store, len(held) + len(quick), cluster)

    for w in (w1, w2):
        assert await w.terminate() == 0
    main_log = main.output()
    assert await main.terminate() == 0

    jobs = await final_jobs(cluster.url)
    assert set(jobs) == set(held) | set(quick)
    runs = RunLog.read(cluster.runs)
    for key, job in jobs.items():
        assert job.status is JobStatus.COMPLETED, (key, job.status, job.last_error)
        assert len(runs.starts.get(key, [])) == 1, f"{key} ran {runs.starts.get(key)}"
        assert runs.ends[key] == runs.starts[key] == [job.result]
    adopted = set(re.findall(r"lease adopted job_id=(\S+)", main_log))
    assert set(held) <= adopted, "the restarted main adopted every lease still running"
    reconnects = [re.findall(r"\(held (\d+) leases, (\d+) adopted\)", w.output()) for w in (w1, w2)]
    assert all(len(r) == 2 for r in reconnects), reconnects
    assert sum(int(r[1][1]) for r in reconnects) >= len(held), reconnects


# ------------------------------------------------------------------ 3. slow drain


async def test_a_slow_drain_keeps_its_lease_past_liveness_and_orphan_grace(
    sqlite_cluster: Cluster,
) -> None:
    cluster = sqlite_cluster
    main = await cluster.start_main()
    a = await cluster.start_worker("worker-a", concurrency=2)
    gate = cluster.dir / "gate"
    [slow] = await enqueue(cluster, [hold_spec(gate)])
    slow_id = uuid.UUID(slow)
    async with observe(cluster.url) as store:
        await eventually(lambda: slow in RunLog.read(cluster.runs).started_by(a.pid), "slow start")
        job = await store.get_job(slow_id)
        assert job is not None and job.status is JobStatus.HANDED_OFF
        lease = job.handoff_id

        a.process.send_signal(signal.SIGTERM)
        await a.wait_for_output("draining")
        b = await cluster.start_worker("worker-b", concurrency=2)
        quick = await enqueue(cluster, [record_spec() for _ in range(6)])
        await wait_until_all_terminal(store, len(quick), cluster)

        # Keep the drain going past the main's liveness timeout and orphan grace,
        # checking all the while that the job stays with A under the same lease.
        until = time.monotonic() + LIVENESS_TIMEOUT + ORPHAN_GRACE + 1.0
        while time.monotonic() < until:
            job = await store.get_job(slow_id)
            assert job is not None and job.status is JobStatus.HANDED_OFF, job
            assert job.handoff_id == lease and job.worker_id == "worker-a", job
            assert a.process.returncode is None, "A left before its job finished"
            await asyncio.sleep(0.1)
        gate.touch()
        assert await a.exit_code() == 0, a.tail()

    assert await b.terminate() == 0
    assert await main.terminate() == 0
    jobs = await final_jobs(cluster.url)
    runs = RunLog.read(cluster.runs)
    assert jobs[slow].status is JobStatus.COMPLETED and jobs[slow].result == a.pid
    assert runs.starts[slow] == runs.ends[slow] == [a.pid], "the slow job ran once, on A"
    for key in quick:
        assert jobs[key].status is JobStatus.COMPLETED
        assert runs.starts[key] == [b.pid], "a draining worker takes no new work"


# ------------------------------------------------------------------ a frozen worker


async def test_a_frozen_worker_loses_its_lease_and_its_late_report_is_fenced_out(
    sqlite_cluster: Cluster,
) -> None:
    """SIGSTOP is a half-open peer: TCP stays up, nothing comes back. The main drops it
    after the liveness timeout and runs the job elsewhere; when the frozen worker wakes
    and reports, the store keeps the new run's lease and, in the end, its outcome."""
    cluster = sqlite_cluster
    main = await cluster.start_main()
    a = await cluster.start_worker("worker-a", concurrency=1)
    gate = cluster.dir / "gate"
    [key] = await enqueue(cluster, [hold_spec(gate)])
    job_id = uuid.UUID(key)
    async with observe(cluster.url) as store:
        await eventually(lambda: key in RunLog.read(cluster.runs).started_by(a.pid), "A start")
        b = await cluster.start_worker("worker-b", concurrency=1)
        a.process.send_signal(signal.SIGSTOP)
        try:
            await eventually(
                lambda: key in RunLog.read(cluster.runs).started_by(b.pid), "the re-run on B"
            )
            job = await store.get_job(job_id)
            assert job is not None and job.status is JobStatus.HANDED_OFF
            assert job.worker_id == "worker-b"
            b_lease = job.handoff_id
            Path(f"{gate}.{a.pid}").touch()  # A's run ends as soon as A wakes up
        finally:
            a.process.send_signal(signal.SIGCONT)
        settled = re.compile(rf"report (stale|acknowledged)\S* [^\n]*job_id={key}")
        await eventually(lambda: settled.search(a.output()), "A's late report to be settled")
        match = settled.search(a.output())
        assert match is not None and match.group(1) == "stale", match
        job = await store.get_job(job_id)
        assert job is not None and job.status is JobStatus.HANDED_OFF, job
        assert job.handoff_id == b_lease, "A's late report left B's lease alone"
        gate.touch()
        await wait_until_all_terminal(store, 1, cluster)

    for w in (a, b):
        assert await w.terminate() == 0
    main_log = main.output()
    assert await main.terminate() == 0
    job = (await final_jobs(cluster.url))[key]
    assert job.status is JobStatus.COMPLETED and job.result == b.pid, job
    assert job.attempts == 0, "losing a lease is not a failed attempt"
    runs = RunLog.read(cluster.runs)
    assert sorted(runs.starts[key]) == sorted(runs.ends[key]) == sorted([a.pid, b.pid])
    assert re.search(r"treating as disconnected session=\d+ worker_id=worker-a", main_log)


# ------------------------------------------------------------------ 4. bad peers


class RawPeer:
    """A hand-driven TCP peer: bytes out, JSON lines in."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, port: int) -> tuple[RawPeer, dict[str, Any]]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 22)
        peer = cls(reader, writer)
        challenge = await peer.recv()
        assert challenge is not None and challenge["type"] == "challenge", challenge
        return peer, challenge

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def send_json(self, msg: dict[str, Any]) -> None:
        await self.send(json.dumps(msg).encode() + b"\n")

    async def recv(self, timeout: float = 10.0) -> dict[str, Any] | None:
        """The next message other than a ping (answered), or ``None`` at EOF."""
        while True:
            try:
                line = await asyncio.wait_for(self.reader.readline(), timeout)
            except ConnectionResetError:
                return None
            if not line:
                return None
            msg: dict[str, Any] = json.loads(line)
            if msg["type"] != "ping":
                return msg
            await self.send_json({"type": "pong", "nonce": msg["nonce"]})

    async def hello(self, token: str | None, nonce: str) -> dict[str, Any] | None:
        proof = protocol.make_proof(token, nonce) if token else None
        await self.send_json(
            {
                "type": "hello",
                "role": "client",
                "protocol": protocol.PROTOCOL_VERSION,
                "proof": proof,
            }
        )
        return await self.recv()

    async def expect_error(self, code: str, *, fatal: bool) -> dict[str, Any]:
        msg = await self.recv()
        assert msg is not None, f"connection closed instead of error {code}"
        assert msg["type"] == "error" and msg["code"] == code and msg["fatal"] is fatal, msg
        if fatal:
            assert await self.recv() is None, "a fatal error closes the connection"
        return msg

    async def still_open(self) -> None:
        await self.send_json({"type": "ping", "nonce": 4242})
        msg = await self.recv()
        assert msg == {"type": "pong", "nonce": 4242}, msg

    def close(self) -> None:
        self.writer.transport.abort()


TOKEN = "e2e-s3cret"


async def _authenticated_peer(port: int) -> RawPeer:
    peer, challenge = await RawPeer.connect(port)
    welcome = await peer.hello(TOKEN, challenge["nonce"])
    assert welcome is not None and welcome["type"] == "welcome", welcome
    return peer


async def _malformed_json(port: int) -> None:
    peer = await _authenticated_peer(port)
    try:
        await peer.send(b'{"type": "ping", "nonce": \n')
        await peer.expect_error("malformed", fatal=False)
        await peer.still_open()
    finally:
        peer.close()


async def _unknown_type(port: int) -> None:
    peer = await _authenticated_peer(port)
    try:
        await peer.send_json({"type": "launch", "missiles": 3})
        await peer.expect_error("unknown_type", fatal=False)
        await peer.still_open()
    finally:
        peer.close()


async def _line_too_long_before_hello(port: int) -> None:
    peer, _ = await RawPeer.connect(port)
    try:
        await peer.send(b"x" * (64 * 1024 + 1) + b"\n")
        await peer.expect_error("line_too_long", fatal=True)
    finally:
        peer.close()


async def _wrong_token(port: int) -> None:
    peer, challenge = await RawPeer.connect(port)
    try:
        reply = await peer.hello("not-the-token", challenge["nonce"])
        assert reply is not None and reply["type"] == "error", reply
        assert reply["code"] == "auth_failed" and reply["fatal"] is True, reply
        assert await peer.recv() is None
    finally:
        peer.close()


async def _no_hello(port: int) -> None:
    peer, _ = await RawPeer.connect(port)
    try:
        await peer.expect_error("handshake_timeout", fatal=True)
    finally:
        peer.close()


async def test_bad_peers_are_refused_while_a_real_worker_carries_on(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, sqlite_url(tmp_path), token=TOKEN)
    good: list[str] = []
    stop = asyncio.Event()

    async def produce() -> None:
        # A steady stream of good work for as long as the bad peers are at it.
        while not stop.is_set():
            good.extend(await enqueue(cluster, [record_spec(0.02) for _ in range(8)]))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)

    producer: asyncio.Task[None] | None = None
    try:
        main = await cluster.start_main()
        w = await cluster.start_worker("worker-good", concurrency=4)
        producer = asyncio.create_task(produce())
        async with observe(cluster.url) as store:
            await eventually(lambda: RunLog.read(cluster.runs).total_ends() >= 1, "work under way")
            ends_before = RunLog.read(cluster.runs).total_ends()
            await asyncio.gather(
                _malformed_json(cluster.port),
                _unknown_type(cluster.port),
                _line_too_long_before_hello(cluster.port),
                _wrong_token(cluster.port),
                _no_hello(cluster.port),
            )
            assert RunLog.read(cluster.runs).total_ends() > ends_before, (
                "the good worker made progress while the bad peers were at it"
            )
            stop.set()
            await producer
            # A name no worker declared: allowed here; it never reaches the worker (routing
            # by task), so it waits, queued, while every good job ends.
            unknown = Client("127.0.0.1", cluster.port, token=TOKEN, allow_unknown_tasks=True)
            async with unknown as client:
                bad = await client.enqueue(
                    f"{APP}.not_registered", ["x"], execution_mode=ExecutionMode.INLINE
                )
                await wait_until_all_terminal(store, len(good), cluster)
                waiting = await client.get_job(bad.job_id)
        assert await w.terminate() == 0
        assert await main.terminate() == 0
    finally:
        if producer is not None and not producer.done():
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)
        await cluster.close()

    assert waiting is not None and waiting["status"] == "queued", waiting
    assert waiting["attempts"] == 0, "a job no worker can run uses no attempt"
    jobs = await final_jobs(cluster.url)
    assert all(jobs[key].status is JobStatus.COMPLETED for key in good)
    runs = RunLog.read(cluster.runs)
    assert all(runs.starts[key] == [w.pid] for key in good), "each good job ran once"
    assert w.output().count("connected to main") == 1, "the worker's connection never dropped"
    assert "connection to the main lost" not in w.output()


async def test_an_unknown_type_before_hello_is_refused_as_unknown_type(
    sqlite_cluster: Cluster,
) -> None:
    await sqlite_cluster.start_main()
    peer, _ = await RawPeer.connect(sqlite_cluster.port)
    try:
        await peer.send_json({"type": "launch"})
        await peer.expect_error("unknown_type", fatal=True)
    finally:
        peer.close()


# ------------------------------------------------------------------ 5. many jobs


@contextlib.asynccontextmanager
async def fresh_database(prefix: str, template: str | None = None) -> AsyncIterator[str]:
    """The URL of a PostgreSQL database of its own, dropped afterwards: processes that
    share a store (several mains, a main and its workers) all reach it by URL. Empty, or
    a copy of ``template`` (the ``migrated_database`` fixture: a store already migrated,
    for tests that are not about a main creating its schema)."""
    import asyncpg
    from sqlalchemy.engine import make_url

    base = make_url(require_postgres())
    admin = base.set(drivername="postgresql", database="postgres").render_as_string(False)
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(admin)
    try:
        copy = "" if template is None else f' TEMPLATE "{template}"'
        await conn.execute(f'CREATE DATABASE "{name}"{copy}')
    finally:
        await conn.close()
    try:
        yield base.set(database=name).render_as_string(False)
    finally:
        conn = await asyncpg.connect(admin)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    if request.param == "sqlite":
        yield sqlite_url(tmp_path)
        return
    # Already migrated: mains migrating an empty database, several at once, is the
    # pg_url fixtures' work (test_failover.py, test_main_stall.py).
    async with fresh_database("broker_e2e", request.getfixturevalue("migrated_database")) as url:
        yield url


@pytest.mark.parametrize(
    "total", [400, pytest.param(2000, marks=pytest.mark.soak)], ids=lambda n: f"{n}_jobs"
)
async def test_jobs_of_two_workers_one_killed_midway(
    tmp_path: Path, store_url: str, total: int
) -> None:
    """``make test`` runs 400 jobs (the kill still lands on a worker holding gated
    leases, well into the backlog); ``make test-slow`` the 2,000 of the original run."""
    cluster = Cluster(tmp_path, store_url)
    started = time.monotonic()
    try:
        main = await cluster.start_main()
        w1 = await cluster.start_worker("worker-1", concurrency=16)
        w2 = await cluster.start_worker("worker-2", concurrency=16)
        keys = await enqueue(cluster, [record_spec(0.005) for _ in range(total)])
        async with observe(cluster.url) as store:
            await eventually(
                lambda: len(RunLog.read(cluster.runs).ended_by(w1.pid)) >= total // 4,
                "worker-1 to be well into the work",
                timeout=60,
            )
            # Arrange, rather than hope, that the kill catches a worker holding leases:
            # jobs that run until the gate opens, ahead of the backlog, take the slots of
            # whichever worker has credit for them (under load one worker's window may
            # hold the rest of the backlog, and the other takes them all); the kill comes
            # once a worker is running one of them, and takes that worker.
            gate = tmp_path / "gate"
            holds = [replace(hold_spec(gate), priority=10) for _ in range(32)]
            keys += await enqueue(cluster, holds)
            hold_keys = {str(spec.id) for spec in holds}

            def where_holds() -> str:
                runs = RunLog.read(cluster.runs)
                return (
                    f"gated jobs running on worker-1: {len(runs.running_on(w1.pid) & hold_keys)}, "
                    f"on worker-2: {len(runs.running_on(w2.pid) & hold_keys)}, started at all: "
                    f"{len((runs.started_by(w1.pid) | runs.started_by(w2.pid)) & hold_keys)}; "
                    f"jobs ended by worker-1: {len(runs.ended_by(w1.pid))}, "
                    f"by worker-2: {len(runs.ended_by(w2.pid))}"
                )

            def holding() -> Proc | None:
                runs = RunLog.read(cluster.runs)
                return next((w for w in (w1, w2) if runs.running_on(w.pid) & hold_keys), None)

            await eventually(
                lambda: holding() is not None,
                "a worker to be running a gated job",
                timeout=60,
                detail=where_holds,
            )
            doomed = holding()
            assert doomed is not None
            completed_before_kill = {str(j.id) for j in await jobs_in(store, [JobStatus.COMPLETED])}
            await doomed.kill()
            killed = doomed.pid
            gate.touch()
            again = await cluster.start_worker(doomed.name, concurrency=16)
            w1, w2 = (again, w2) if doomed is w1 else (w1, again)
            await wait_until_all_terminal(store, len(keys), cluster, timeout=60)
        for w in (w1, w2):
            assert await w.terminate() == 0
        assert await main.terminate() == 0
        held_at_kill = returned_at_disconnect(main.output())
    finally:
        await cluster.close()
    elapsed = time.monotonic() - started

    jobs = await final_jobs(cluster.url)
    assert set(jobs) == set(keys), "no job lost, none invented"
    stuck = [k for k, j in jobs.items() if j.status in (JobStatus.QUEUED, JobStatus.HANDED_OFF)]
    assert not stuck, f"{len(stuck)} jobs stuck"
    runs = RunLog.read(cluster.runs)
    rerun = check_kill_reruns(
        jobs,
        runs,
        killed=killed,
        survivors={w1.pid, w2.pid},
        completed_before_kill=completed_before_kill,
        held_at_kill=held_at_kill,
    )
    assert held_at_kill, "the kill caught a worker holding leases"
    print(f"\n{total} jobs on {store_url.split(':')[0]}: {elapsed:.1f} s, {len(rerun)} re-run")
