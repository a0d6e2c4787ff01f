"""Group commit of enqueues (:mod:`broker.main.loops.GroupCommit`, used by the main's
:class:`~broker.main.operations.Operations`): callers that arrive during a commit share the next
one, each keeps all-or-none, one caller's bad job fails that caller alone, a transient
failure reaches everyone, and a caller that gave up has nothing written."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from adapters.memory import MemoryAdapter
from broker.exceptions import StorageError, StorageRejectedError, transient
from broker.jobs import EnqueueResult, JobSpec, utcnow
from broker.main.loops import GroupCommit
from broker.main.operations import Operations
from broker.main.settings import MainSettings
from broker.wire import messages as protocol


class CountingStore(MemoryAdapter):
    """Counts transactions; the first one is held until the test opens the gate, so the
    callers arriving meanwhile must queue for the next."""

    def __init__(self) -> None:
        super().__init__()
        self.commits: list[int] = []
        self.gate = asyncio.Event()
        self.refuse_task: str | None = None
        self.unreachable = False

    async def enqueue_many(self, specs: Sequence[JobSpec]) -> list[EnqueueResult]:
        self.commits.append(len(specs))
        await self.gate.wait()
        if self.unreachable:
            raise StorageError("connection refused")
        if any(spec.task == self.refuse_task for spec in specs):
            raise StorageRejectedError("a value the store cannot hold")
        return await super().enqueue_many(specs)


def request(task: str = "t", key: str | None = None) -> protocol.JobRequest:
    return protocol.JobRequest(task=task, idempotency_key=key)


def operations(store: CountingStore) -> Operations:
    group = GroupCommit(store.enqueue_many, max_batch=1000, shared_failure=transient)
    return Operations(store, MainSettings(), clock=utcnow, enqueue=group.submit)


async def test_callers_during_a_commit_share_the_next_one_and_get_their_own_results() -> None:
    store = CountingStore()
    ops = operations(store)
    first = asyncio.create_task(ops.enqueue([request()]))
    while not store.commits:
        await asyncio.sleep(0)
    rest = [asyncio.create_task(ops.enqueue([request(), request(key=f"k{i}")])) for i in range(50)]
    await asyncio.sleep(0)
    store.gate.set()
    results = await asyncio.gather(first, *rest)
    assert store.commits == [1, 100]  # 51 callers, 2 transactions
    for i, result in enumerate(results[1:]):
        assert [r.job.idempotency_key for r in result] == [None, f"k{i}"]
    stored = await store.count_jobs()
    assert sum(c.count for c in stored) == 101


async def test_one_callers_bad_job_fails_that_caller_alone_and_all_of_its_jobs() -> None:
    store = CountingStore()
    store.refuse_task = "poison"
    ops = operations(store)
    blocker = asyncio.create_task(ops.enqueue([request()]))
    while not store.commits:
        await asyncio.sleep(0)
    good = [asyncio.create_task(ops.enqueue([request()])) for _ in range(5)]
    bad = asyncio.create_task(ops.enqueue([request(), request("poison")]))
    store.gate.set()
    await blocker
    assert [len(r) for r in await asyncio.gather(*good)] == [1] * 5
    with pytest.raises(StorageRejectedError):
        await bad
    stored = await store.count_jobs()
    assert sum(c.count for c in stored) == 6  # nothing of the bad caller, not even its good job


async def test_a_transient_failure_reaches_every_caller_of_the_batch() -> None:
    store = CountingStore()
    ops = operations(store)
    blocker = asyncio.create_task(ops.enqueue([request()]))
    while not store.commits:
        await asyncio.sleep(0)
    store.unreachable = True
    callers = [asyncio.create_task(ops.enqueue([request()])) for _ in range(5)]
    store.gate.set()
    outcomes = await asyncio.gather(blocker, *callers, return_exceptions=True)
    assert all(isinstance(o, StorageError) for o in outcomes)
    assert store.commits == [1, 5]  # no retry of each caller alone: it would fail the same


async def test_a_caller_that_gave_up_before_its_turn_has_nothing_written() -> None:
    store = CountingStore()
    ops = operations(store)
    blocker = asyncio.create_task(ops.enqueue([request()]))
    while not store.commits:
        await asyncio.sleep(0)
    gone = asyncio.create_task(ops.enqueue([request("gone")]))
    stays = asyncio.create_task(ops.enqueue([request("stays")]))
    await asyncio.sleep(0)
    gone.cancel()
    store.gate.set()
    await blocker
    assert [r.job.task for r in await stays] == ["stays"]
    assert store.commits == [1, 1]


async def test_batches_respect_their_size_without_splitting_a_caller() -> None:
    calls: list[list[int]] = []

    async def commit(items: list[int]) -> list[int]:
        calls.append(items)
        await asyncio.sleep(0)
        return [item * 2 for item in items]

    group = GroupCommit(commit, max_batch=5, shared_failure=transient)
    results = await asyncio.gather(*(group.submit([i, i]) for i in range(6)), group.submit([9] * 7))
    assert results[:6] == [[2 * i, 2 * i] for i in range(6)] and results[6] == [18] * 7
    assert all(len(c) <= 5 or len(set(c)) == 1 for c in calls)  # only a lone big caller is over
    assert sorted(x for c in calls for x in c) == sorted(
        [i for i in range(6) for _ in "ab"] + [9] * 7
    )


async def test_a_lone_caller_commits_in_its_own_task_and_later_callers_batch_behind_it() -> None:
    tasks: list[asyncio.Task[object] | None] = []
    gate = asyncio.Event()

    async def commit(items: list[int]) -> list[int]:
        tasks.append(asyncio.current_task())
        await gate.wait()
        return items

    group = GroupCommit(commit, max_batch=100, shared_failure=transient)
    lone = asyncio.create_task(group.submit([1]))
    while not tasks:
        await asyncio.sleep(0)
    assert tasks == [lone]  # no runner task, no hop to and from one
    later = [asyncio.create_task(group.submit([i])) for i in (2, 3)]
    await asyncio.sleep(0)
    gate.set()
    assert await asyncio.gather(lone, *later) == [[1], [2], [3]]
    assert len(tasks) == 2 and tasks[1] not in (lone, *later)  # the two later: one commit


async def test_callers_left_by_a_cancelled_runner_are_committed_by_the_next_caller() -> None:
    calls: list[list[int]] = []
    gate = asyncio.Event()

    async def commit(items: list[int]) -> list[int]:
        calls.append(items)
        await gate.wait()
        return items

    group = GroupCommit(commit, max_batch=1, shared_failure=transient)
    first = asyncio.create_task(group.submit([1]))
    while not calls:
        await asyncio.sleep(0)
    waiting = [asyncio.create_task(group.submit([i])) for i in (2, 3)]
    await asyncio.sleep(0)
    first.cancel()  # the lone caller's commit ends; a runner takes the two waiting
    while len(calls) < 2:
        await asyncio.sleep(0)
    assert group._runner is not None
    group._runner.cancel()  # as at shutdown: 2 was being written, 3 still waits
    while group._runner is not None:
        await asyncio.sleep(0)
    gate.set()
    assert await group.submit([4]) == [4]
    assert await waiting[1] == [3]
    assert calls[-2:] == [[3], [4]]  # the one left waiting first, then the newcomer
    waiting[0].cancel()  # its commit was cancelled with the runner: it has no outcome
