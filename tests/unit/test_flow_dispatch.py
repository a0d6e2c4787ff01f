"""The dispatcher under flow control, with the in-memory store: a paused queue is left out
of every read while another drains; a limited queue's jobs go at its rate, the dispatcher
sleeping until each token is due (a bounded number of reads: no busy loop)."""

from __future__ import annotations

import asyncio
from typing import Any

from broker.core.handoff import Dispatch, Handoff
from broker.jobs import Job, JobSpec
from broker.model.rates import parse_rate
from broker.storage import QueueSettings
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
