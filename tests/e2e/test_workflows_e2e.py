"""Workflows end to end under the faults of issue 32: real ``broker-main`` and
``broker-worker`` processes on a SQLite file and on PostgreSQL, while a worker is killed
with ``kill -9``, a pooled child is killed with ``kill -9``, and the main is killed with
``kill -9`` and restarted on the same store and port.

A fan-in over a group is created once, runs once, and receives every result in the
group's order; a chain of 20 steps finishes with the right value. Every step writes its
one side effect with the attempt it belongs to (``tests/e2e_app.py``, ``effects-PID.log``)
and the store says how many attempts each job had (``recoveries``: attempts lost to a
fault), so "an effect once per completed attempt" is counted, not guessed: no attempt
wrote two effects, every effect but the completing attempt's belongs to an attempt the
store counted as lost, and only jobs a fault hit lost one.

Each fault fires on an event (so many effects written, a step started in a given
process), and the steps a fault must hit wait on a gate file the test opens afterwards,
so the fault always lands while they run, however fast or loaded the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

from broker import chain, group
from broker.client.client import Client
from broker.jobs import Job, JobStatus
from broker.tasks.registry import TaskRegistry, task
from broker.tasks.workflow import Step
from tests.e2e.test_e2e import (
    APP,
    Cluster,
    Proc,
    RunLog,
    final_jobs,
    jobs_in,
    observe,
    returned_at_disconnect,
)
from tests.e2e.test_e2e import store_url as store_url  # the fixture: SQLite, PostgreSQL
from tests.support import until

pytestmark = pytest.mark.slow

ON_SQLITE_HERE_POSTGRES_IN_TEST_SLOW = pytest.mark.parametrize(
    "store_url",
    ["sqlite", pytest.param("postgres", marks=[pytest.mark.postgres, pytest.mark.slow_e2e])],
    indirect=True,
)
"""The faults are the main's and the worker's, whatever the store: make test runs these
runs on SQLite, make test-slow on PostgreSQL too (7-9 s each, quiet). make test keeps the
workflows on PostgreSQL through the main (``tests/integration/test_workflows.py``), the
store's workflow rules (the conformance suite) and faults on PostgreSQL through the same
processes (``test_e2e.py``'s killed worker, ``test_checkpoints.py``'s kill -9)."""

_names = TaskRegistry()
"""Stand-ins with the worker's task names and signatures: this process runs none of them."""


@task(name=f"{APP}.wf_member", mode="inline", registry=_names)
async def wf_member(key: str, value: int, seconds: float = 0.0, gate: str = "") -> int:
    raise NotImplementedError


@task(name=f"{APP}.wf_member_pooled", mode="pooled", registry=_names)
def wf_member_pooled(key: str, value: int, runs: str, gate: str = "") -> int:
    raise NotImplementedError


@task(name=f"{APP}.wf_collect", mode="inline", registry=_names)
async def wf_collect(results: list[int], key: str) -> int:
    raise NotImplementedError


@task(name=f"{APP}.wf_step", mode="inline", registry=_names)
async def wf_step(value: int, key: str, gate: str = "") -> int:
    raise NotImplementedError


@task(name=f"{APP}.wf_step_pooled", mode="pooled", registry=_names)
def wf_step_pooled(value: int, key: str, runs: str, gate: str = "") -> int:
    raise NotImplementedError


# The workers come back within the orphan grace of a restarted main even on a loaded
# machine (they retry at least every 0.5 s), and a busy worker is not declared dead:
# its sockets close at a kill -9, which the main sees at once, so the liveness timeout
# only has to tell a wedged worker, and none is wedged here.
MAIN_FLAGS = ("--orphan-grace", "8", "--liveness-timeout", "10")
WORKER_FLAGS: tuple[str, ...] = ("--reconnect-max-delay", "0.5", "--pooled-runner-count", "1")
WORKER_FLAGS += ("--pooled-runner-concurrency", "4")


@dataclass
class Effects:
    """Every effect the steps wrote: key -> (attempt, recoveries, pid), one per effect."""

    by_key: dict[str, list[tuple[int, int, int]]]

    @classmethod
    def read(cls, directory: Path) -> Effects:
        by_key: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
        for path in sorted(directory.glob("effects-*.log")):
            for line in path.read_text().split("\n")[:-1]:  # the last piece may be torn
                _, key, attempt, recoveries, pid = line.split()
                by_key[key].append((int(attempt), int(recoveries), int(pid)))
        return cls(dict(by_key))

    def count(self) -> int:
        return sum(len(v) for v in self.by_key.values())


def key_of(job: Job) -> str:
    """The step's key among its arguments: a member's first, a step's or a fan-in's second
    (the first is what its parents returned)."""
    first_is_key = job.task.startswith(f"{APP}.wf_member")
    return str(job.args[0] if first_is_key else job.args[1])


def check_effects(jobs: dict[str, Job], effects: Effects, hit: set[str]) -> dict[str, Job]:
    """Every job completed, with one effect per attempt that got as far as its effect, and
    more than one attempt only for the jobs in ``hit`` (a fault landed on them). Returns
    the jobs by key."""
    by_key = {key_of(job): job for job in jobs.values()}
    assert len(by_key) == len(jobs), "two jobs with one key"
    assert set(effects.by_key) <= set(by_key), set(effects.by_key) - set(by_key)
    for key, job in by_key.items():
        assert job.status is JobStatus.COMPLETED, (key, job.status, job.last_error)
        seen = [(attempt, recoveries) for attempt, recoveries, _ in effects.by_key.get(key, [])]
        assert len(set(seen)) == len(seen), f"{key}: an attempt made its effect twice: {seen}"
        assert (job.attempts + 1, job.recoveries) in seen, f"{key}: the completing attempt {seen}"
        assert all(r <= job.recoveries for _, r in seen), f"{key}: {seen}, {job.recoveries}"
        if job.recoveries:
            assert key in hit, f"{key} lost {job.recoveries} attempts, yet no fault hit it"
    return by_key


async def held_in_store(url: str) -> set[str]:
    """Jobs handed off in the store (read while no main runs): a killed main's leases."""
    async with observe(url) as store:
        return {str(job.id) for job in await jobs_in(store, [JobStatus.HANDED_OFF])}


def parent_pid(pid: int) -> int:
    with contextlib.suppress(FileNotFoundError):
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return 0


class Faults:
    """The three faults, in order, on one cluster; records the jobs each could hit."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.workers: list[Proc] = []
        self.main: Proc | None = None
        self.returned: set[str] = set()  # job ids
        self.held_at_main_kill: set[str] = set()  # job ids
        self.child_hit: str | None = None  # a key
        self.lost_in_child: set[str] = set()  # job ids

    async def start(self) -> None:
        self.main = await self.cluster.start_main(*MAIN_FLAGS)
        starts = (self.cluster.start_worker(n, *WORKER_FLAGS) for n in ("worker-1", "worker-2"))
        self.workers.extend(await asyncio.gather(*starts))

    async def kill_worker(self, pid: int) -> None:
        """``kill -9`` of the worker ``pid``; the other carries on alone (no replacement:
        a process start is most of these tests' time on a loaded machine)."""
        victim = next(w for w in self.workers if w.pid == pid)
        await victim.kill()
        self.workers.remove(victim)

    async def kill_child_running(self, keys: list[str]) -> str:
        """Kill the pooled child running the first of ``keys`` to start in a child of a
        live worker: wait for one (they are held by a gate, so it does not end first)."""
        live = {w.pid for w in self.workers}

        def running() -> tuple[str, int] | None:
            runs = RunLog.read(self.cluster.runs)
            for key in keys:
                for pid in runs.starts.get(key, []):
                    if parent_pid(pid) in live and pid not in runs.ends.get(key, []):
                        return key, pid
            return None

        found: tuple[str, int] = await until(running, 60)
        key, pid = found
        os.kill(pid, signal.SIGKILL)
        self.child_hit = key
        return key

    async def kill_and_restart_main(self) -> None:
        assert self.main is not None
        await self.main.kill()
        self.held_at_main_kill = await held_in_store(self.cluster.url)
        self.main = await self.cluster.start_main(*MAIN_FLAGS)

    def hit(self, ids_to_keys: dict[str, str]) -> set[str]:
        """The keys a fault could have hit: returned when the killed worker's connection
        ended (prefetched ones too), lost with the killed child (each job it held, as its
        worker logged them), the leases of the killed main."""
        mains = "\n".join(p.output() for p in self.cluster.procs if p.name == "main")
        self.returned = returned_at_disconnect(mains)
        workers = "\n".join(p.output() for p in self.cluster.procs if p.name != "main")
        self.lost_in_child = set(re.findall(r"job attempt lost job_id=(\S+)", workers))
        ids = self.returned | self.held_at_main_kill | self.lost_in_child
        keys = {ids_to_keys[i] for i in ids if i in ids_to_keys}
        return keys | ({self.child_hit} if self.child_hit else set())


# ------------------------------------------------------------------ fan-in


@ON_SQLITE_HERE_POSTGRES_IN_TEST_SLOW
@pytest.mark.timeout(300)  # four process starts: 15 s each at load 14 on two cores
async def test_a_fan_in_of_100_is_made_once_through_every_fault(
    tmp_path: Path, store_url: str
) -> None:
    await _fan_in_through_the_faults(tmp_path, store_url, 100)


@pytest.mark.soak
@pytest.mark.timeout(600)
async def test_a_fan_in_of_1000_is_made_once_through_every_fault(
    tmp_path: Path, store_url: str
) -> None:
    """The issue's full size (``make test-slow``)."""
    await _fan_in_through_the_faults(tmp_path, store_url, 1000)


async def _fan_in_through_the_faults(tmp_path: Path, store_url: str, size: int) -> None:
    """Every tenth member is pooled and waits on the gate, so a child always holds one
    when it is killed; the last four inline members wait on it too (fewer than the
    inline slots, so they never starve the others), so the main is killed with members
    running. The gate opens while the main is down: those members end and their reports
    wait for the restarted main."""
    cluster = Cluster(tmp_path, store_url)
    faults = Faults(cluster)
    gate = str(tmp_path / "gate")
    runs = str(cluster.runs)
    pooled = [i for i in range(size) if i % 10 == 5]
    held_inline = list(range(size - 4, size))
    free = [i for i in range(size) if i not in pooled and i not in held_inline]

    def member(i: int) -> Step:
        if i in pooled:
            return wf_member_pooled.bind(f"m{i}", i, runs, gate)
        return wf_member.bind(f"m{i}", i, 0.02, gate if i in held_inline else "")

    try:
        await faults.start()
        members = group(member(i) for i in range(size))
        client = Client("127.0.0.1", cluster.port, retry_timeout=120)
        async with client:
            flow = await client.enqueue_workflow(members.then(wf_collect.bind("fan-in")))
            final_id = flow.final_job_id
            assert final_id is not None
            # Waits across the main's restart: the client subscribes again at the new main.
            waiting = asyncio.create_task(client.wait(final_id, timeout=300))

            def ended() -> int:
                return Effects.read(cluster.runs).count()

            await until(lambda: ended() >= len(free) // 4, 120)

            def a_busy_worker() -> int | None:
                busy = RunLog.read(cluster.runs)
                return next((w.pid for w in faults.workers if busy.running_on(w.pid)), None)

            await faults.kill_worker(await until(a_busy_worker, 60))

            await faults.kill_child_running([f"m{i}" for i in pooled])

            def free_done_and_held_running() -> bool:
                runs_now = RunLog.read(cluster.runs)
                effects = Effects.read(cluster.runs).by_key
                return all(f"m{i}" in effects for i in free) and any(
                    f"m{i}" in runs_now.starts for i in held_inline
                )

            await until(free_done_and_held_running, 180)
            await faults.kill_and_restart_main()
            Path(gate).touch()
            final = await waiting
        assert final["status"] == JobStatus.COMPLETED.value, cluster.logs()
        assert final["args"] == [[i * i for i in range(size)], "fan-in"]
        assert final["result"] == sum(i * i for i in range(size))
        runs_log = RunLog.read(cluster.runs)
        assert len(runs_log.starts["fan-in"]) == 1, "the continuation ran more than once"
        assert faults.main is not None
        await faults.main.terminate()

        jobs = await final_jobs(store_url)
        assert len(jobs) == size + 1, "exactly one continuation was made"
        ids_to_keys = {i: key_of(job) for i, job in jobs.items()}
        by_key = check_effects(jobs, Effects.read(cluster.runs), faults.hit(ids_to_keys))
        assert by_key["fan-in"].recoveries == 0
        child_key = faults.child_hit
        assert child_key is not None and by_key[child_key].recoveries >= 1, child_key
        assert len(runs_log.starts[child_key]) >= 2, "the killed child's member ran again"
        assert faults.returned, "the killed worker held members"
        assert faults.held_at_main_kill, "the main was killed with members running"
    finally:
        Path(gate).touch()
        await cluster.close()


# ------------------------------------------------------------------ chain


@ON_SQLITE_HERE_POSTGRES_IN_TEST_SLOW
@pytest.mark.timeout(300)
async def test_a_chain_of_20_runs_each_effect_once_per_attempt_through_every_fault(
    tmp_path: Path, store_url: str
) -> None:
    """Step 4 (inline) runs when its worker is killed, step 9 (pooled) when its child is,
    step 14 (inline) when the main is; each waits on a gate of its own, opened once the
    fault is done. Steps 4 and 9 lose exactly one attempt each (cut before their effect);
    step 14's lease is adopted by the restarted main, or lost if its worker came back
    too late; no other step loses one."""
    cluster = Cluster(tmp_path, store_url)
    faults = Faults(cluster)
    runs = str(cluster.runs)
    gates = {i: str(tmp_path / f"gate-{i}") for i in (4, 9, 14)}
    steps: list[Step] = [wf_member.bind("s0", 3)]
    for i in range(1, 20):
        if i == 9:
            steps.append(wf_step_pooled.bind(f"s{i}", runs, gates[9]))
        else:
            steps.append(wf_step.bind(f"s{i}", gates.get(i, "")))

    def started(key: str, count: int = 1) -> bool:
        return len(RunLog.read(cluster.runs).starts.get(key, [])) >= count

    try:
        await faults.start()
        client = Client("127.0.0.1", cluster.port, retry_timeout=120)
        async with client:
            flow = await client.enqueue_workflow(chain(*steps))
            final_id = flow.final_job_id
            assert final_id is not None
            waiting = asyncio.create_task(client.wait(final_id, timeout=300))

            await until(lambda: started("s4"), 120)
            (holder,) = RunLog.read(cluster.runs).starts["s4"]
            await faults.kill_worker(holder)
            await until(lambda: started("s4", 2), 60)
            Path(gates[4]).touch()

            assert await faults.kill_child_running(["s9"]) == "s9"
            await until(lambda: started("s9", 2), 60)
            Path(gates[9]).touch()

            await until(lambda: started("s14"), 120)
            await faults.kill_and_restart_main()
            Path(gates[14]).touch()
            final = await waiting
        assert (final["status"], final["result"]) == (JobStatus.COMPLETED.value, 9 + 19)
        assert faults.main is not None
        await faults.main.terminate()

        jobs = await final_jobs(store_url)
        assert len(jobs) == 20
        ids_to_keys = {i: key_of(job) for i, job in jobs.items()}
        effects = Effects.read(cluster.runs)
        by_key = check_effects(jobs, effects, faults.hit(ids_to_keys))
        runs_log = RunLog.read(cluster.runs)
        for key in ("s4", "s9"):
            assert by_key[key].recoveries == 1, (key, by_key[key].recoveries)
            assert len(runs_log.starts[key]) == 2 and len(effects.by_key[key]) == 1, key
        for i in range(20):
            if i not in (4, 9, 14):
                assert by_key[f"s{i}"].recoveries == 0, f"s{i}"
                assert len(runs_log.starts[f"s{i}"]) == len(effects.by_key[f"s{i}"]) == 1
        assert len(effects.by_key["s14"]) == by_key["s14"].recoveries + 1
    finally:
        for gate in gates.values():
            Path(gate).touch()
        await cluster.close()
