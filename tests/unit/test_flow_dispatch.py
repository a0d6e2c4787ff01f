"""The dispatcher under flow control, with the in-memory store: a paused queue is left out
of every read while another drains; a limited queue's jobs go at its rate, the dispatcher
sleeping until each token is due (a bounded number of reads: no busy loop)."""

from __future__ import annotations

import asyncio
from typing import Any

from broker.core.handoff import Dispatch, Handoff
from broker.jobs import Job, JobSpec, JobStatus
from broker.model.rates import parse_rate
from broker.storage import JobFilter, QueueSettings
from tests.unit.test_dispatch_pipeline import ReadSizes, dispatcher, worker


def _loop_time() -> float:
    """The loop's own clock: a rate limit is paced by it, so these tests keep it."""
    return asyncio.get_running_loop().time()


class Reads(ReadSizes):
    """Notes the queues every read leaves out."""

    def __init__(self) -> None:
        super().__init__()
        self.excluded: list[frozenset[str]] = []

    async def select_eligible(self, **kw: Any) -> list[Job]:
        self.excluded.append(frozenset(kw.get("exclude_queues", ())))
        return await super().select_eligible(**kw)


async def test_a_paused_queue_is_left_out_of_every_read_while_another_drains() -> None:
    store = Reads()
    await store.enqueue_many([JobSpec(task="t", queue="held", priority=9) for _ in range(5)])
    await store.enqueue_many([JobSpec(task="t", queue="free") for _ in range(5)])
    core = Handoff()
    core.flow.apply(QueueSettings("held", paused=True))
    worker(core, 1, 20)
    sent: list[Dispatch] = []
    d = dispatcher(store, core, sent, now=_loop_time)
    run = asyncio.create_task(d.run())
    try:
        async with asyncio.timeout(10):
            while len(sent) < 5:
                await asyncio.sleep(0.01)
        assert {s.job.queue for s in sent} == {"free"}
        assert store.excluded and all(e == {"held"} for e in store.excluded)
        core.flow.apply(QueueSettings("held"))
        d.wake()  # what a resume does
        async with asyncio.timeout(10):
            while len(sent) < 10:
                await asyncio.sleep(0.01)
    finally:
        run.cancel()
    assert [s.job.queue for s in sent[5:]] == ["held"] * 5


async def test_a_limited_queue_goes_at_its_rate_and_the_dispatcher_sleeps_between() -> None:
    store = Reads()
    await store.enqueue_many([JobSpec(task="t", queue="api") for _ in range(6)])
    core = Handoff()
    core.flow.apply(QueueSettings("api", rate=parse_rate("20/s", burst=2)))
    worker(core, 1, 20)
    loop = asyncio.get_running_loop()
    times: list[float] = []

    class Sent(list[Dispatch]):
        """The jobs sent, and the loop time each was sent at."""

        def extend(self, more: Any) -> None:
            more = list(more)
            times.extend([loop.time()] * len(more))
            super().extend(more)

    sent = Sent()
    d = dispatcher(store, core, sent, now=_loop_time)
    run = asyncio.create_task(d.run())
    try:
        async with asyncio.timeout(10):
            while len(sent) < 6:
                await asyncio.sleep(0.01)
    finally:
        run.cancel()
    # Two at once (the burst), then one every 50 ms: the last at 0.2 s at the earliest.
    assert times[-1] - times[0] >= 0.2 - 0.02, times
    # A read per token and a few more, not one per loop turn.
    assert len(store.excluded) <= 30


class TaskReads(ReadSizes):
    """Notes the tasks every read asks for."""

    def __init__(self) -> None:
        super().__init__()
        self.tasks: list[frozenset[str] | None] = []

    async def select_eligible(self, **kw: Any) -> list[Job]:
        tasks = kw.get("tasks")
        self.tasks.append(None if tasks is None else frozenset(tasks))
        return await super().select_eligible(**kw)


async def test_a_limited_task_at_the_head_of_its_queue_holds_no_other_task_back() -> None:
    """Five jobs of a task limited to one an hour stand first in the queue: one goes, and
    the five jobs of another task behind them go at once; the reads leave the limited
    task out while it has no token, and the dispatcher does not spin on it."""
    store = TaskReads()
    await store.enqueue_many([JobSpec(task="slow", priority=9) for _ in range(5)])
    await store.enqueue_many([JobSpec(task="fast") for _ in range(5)])
    core = Handoff()
    worker(core, 1, 20)
    core.declared(1, ["slow", "fast"], {"slow": parse_rate("1/h")})
    sent: list[Dispatch] = []
    d = dispatcher(store, core, sent, now=_loop_time)
    run = asyncio.create_task(d.run())
    try:
        async with asyncio.timeout(10):
            while len(sent) < 6:
                await asyncio.sleep(0.01)
        reads = len(store.tasks)
        for _ in range(20):  # idle: a token is an hour away, and nothing else is queued
            await asyncio.sleep(0.01)
    finally:
        run.cancel()
    assert sorted(s.job.task for s in sent) == ["fast"] * 5 + ["slow"]
    assert store.tasks[-1] == {"fast"}, "the read leaves the task without a token out"
    assert len(store.tasks) - reads <= 6, "no busy loop while the limited task waits"


def test_the_newest_declaration_decides_a_tasks_limit_and_it_goes_with_its_workers() -> None:
    core = Handoff()
    worker(core, 1, 5)
    worker(core, 2, 5)
    core.declared(1, ["t"], {"t": parse_rate("5/s")})
    core.declared(2, ["t"], {"t": parse_rate("9/s")})
    assert core.flow.task_rates == {"t": parse_rate("9/s")}
    core.declared(2, ["t"])  # the new release removed the limit; worker 1 still has it
    assert core.flow.task_rates == {"t": parse_rate("5/s")}
    core.disconnect(1, 0.0)  # no connected worker declares it any more
    assert core.flow.task_rates == {} and not core.flow.limiting


def test_a_read_leaves_blocked_tasks_out_even_while_a_worker_runs_any_task() -> None:
    core = Handoff()
    worker(core, 1, 5)  # declares nothing: runs any task
    worker(core, 2, 5)
    core.declared(2, ["t", "u"], {"t": parse_rate("1/h")})
    assert core.tasks_to_read(0.0) is None, "every task has a token"
    core.flow.admitted("q", 0.0, "t")
    assert core.tasks_to_read(1.0) == {"u"}


class KeyReads(ReadSizes):
    """A memory store that records the keys each dispatch read left out."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: list[frozenset[tuple[str, str]]] = []

    async def select_eligible(self, **kw: Any) -> list[Job]:
        self.keys.append(frozenset(kw.get("exclude_keys", ())))
        return await super().select_eligible(**kw)


async def test_a_flooding_key_at_the_head_of_its_task_holds_no_other_key_back() -> None:
    """Per-key limits: five jobs of tenant A, limited to one an hour for each tenant,
    stand first; one goes, and tenant B's job behind them goes at once (its own bucket);
    the reads leave A's key out while it has no token, with no busy loop."""
    store = KeyReads()
    await store.enqueue_many([JobSpec(task="mail", priority=9, rate_key="A") for _ in range(5)])
    await store.enqueue_many([JobSpec(task="mail", rate_key="B")])
    core = Handoff()
    worker(core, 1, 20)
    core.declared(1, ["mail"], {"mail": parse_rate("1/h")}, keyed=["mail"])
    sent: list[Dispatch] = []
    d = dispatcher(store, core, sent, now=_loop_time)
    run = asyncio.create_task(d.run())
    try:
        async with asyncio.timeout(10):
            while len(sent) < 2:
                await asyncio.sleep(0.01)
        reads = len(store.keys)
        for _ in range(20):  # idle: both keys' tokens are an hour away
            await asyncio.sleep(0.01)
    finally:
        run.cancel()
    assert sorted(s.job.rate_key or "" for s in sent) == ["A", "B"]
    assert ("mail", "A") in store.keys[-1], "the reads leave the key without a token out"
    assert len(store.keys) - reads <= 6, "no busy loop while the keys wait"
    stored = await store.list_jobs(JobFilter(), limit=10)
    assert sum(j.status is JobStatus.QUEUED and j.attempts == 0 for j in stored.jobs) == 4
