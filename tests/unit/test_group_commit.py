"""Group commit of enqueues (:mod:`broker.group_commit`, used by the main's
:class:`~broker.operations.Operations`): callers that arrive during a commit share the next
one, each keeps all-or-none, one caller's bad job fails that caller alone, a transient
failure reaches everyone, and a caller that gave up has nothing written."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from adapters.memory import MemoryAdapter
from broker import protocol
from broker.config import MainSettings
from broker.exceptions import StorageError, StorageRejectedError, transient
from broker.group_commit import GroupCommit
from broker.jobs import EnqueueResult, JobSpec, utcnow
from broker.operations import Operations


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
