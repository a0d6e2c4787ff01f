"""The prefetch window of a real worker against a scripted main over real TCP: a job
beyond the slots waits on the worker and starts when one frees, a drain runs it, and a
dropped connection drops it (the main has returned its lease)."""

from __future__ import annotations

import asyncio

import msgspec

from broker.tasks.registry import TaskRegistry
from broker.wire import messages as protocol
from tests.fake_main import (
    INLINE,
    FakeMain,
    Session,
    gate,
    job,
    make_worker,
    registry,
    running,
    started,
)
from tests.support import until

_ = (started, gate, registry)  # fixtures, used by name


async def _two_running_one_waiting(
    session: Session,
) -> tuple[list[protocol.JobHandoff], protocol.JobHandoff]:
    """Fill both inline slots with blocked jobs and send one more into the window."""
    assert await session.recv() == protocol.Ready(slots={INLINE: 2 + 2}, seen=0), (
        "two free slots plus a window of two"
    )
    blocked = [job(1, "block"), job(2, "block")]
    waiting = job(3, "add", 1, 2)
    await session.send(*blocked, waiting)
    return blocked, waiting


async def test_a_job_beyond_the_slots_waits_and_runs_when_a_slot_frees(
    registry: TaskRegistry, gate: asyncio.Event
) -> None:
    async with FakeMain() as main:
        worker = make_worker(main, registry, prefetch=2)
        async with running(worker):
            session = await main.session()
            blocked, waiting = await _two_running_one_waiting(session)
            await until(lambda: worker.status()["prefetched"] == 1)
            assert worker.status()["running"] == 2
            gate.set()
            reports = [await session.expect(protocol.CompletedReport) for _ in range(3)]
            assert {r.handoff_id for r in reports} == {j.handoff_id for j in [*blocked, waiting]}
            assert [r.result for r in reports if r.handoff_id == waiting.handoff_id] == [3]
            assert worker.status()["prefetched"] == 0


async def test_a_dropped_connection_drops_the_prefetched_job_but_keeps_the_running_ones(
    registry: TaskRegistry, gate: asyncio.Event
) -> None:
    async with FakeMain() as main:
        worker = make_worker(main, registry, prefetch=2)
        async with running(worker):
            first = await main.session()
            blocked, _waiting = await _two_running_one_waiting(first)
            await until(lambda: worker.status()["prefetched"] == 1)
            first.drop()
            second = await main.session()
            assert {ref.handoff_id for ref in second.hello.held_leases} == {
                j.handoff_id for j in blocked
            }, "the prefetched lease is not held any more"
            assert worker.status()["prefetched"] == 0
            gate.set()
            reports = [await second.expect(protocol.CompletedReport) for _ in range(2)]
            assert {r.handoff_id for r in reports} == {j.handoff_id for j in blocked}


async def test_a_draining_worker_runs_its_prefetched_job(
    registry: TaskRegistry, gate: asyncio.Event
) -> None:
    async with FakeMain() as main:
        worker = make_worker(main, registry, prefetch=2)
        async with running(worker):
            session = await main.session()
            _blocked, waiting = await _two_running_one_waiting(session)
            await until(lambda: worker.status()["prefetched"] == 1)
            worker.request_stop()
            await session.expect(protocol.Draining)
            gate.set()
            reports = [await session.expect(protocol.CompletedReport) for _ in range(3)]
            assert waiting.handoff_id in {r.handoff_id for r in reports}


async def test_an_urgent_job_sent_after_the_window_filled_starts_first(
    registry: TaskRegistry, gate: asyncio.Event
) -> None:
    """Issue 35: both slots busy, two jobs of the backlog waiting in the window, then an
    urgent one arrives: the first slot to free runs it, ahead of the backlog held."""
    async with FakeMain() as main:
        worker = make_worker(main, registry, prefetch=3)
        async with running(worker):
            session = await main.session()
            await session.recv()  # the first ready
            backlog = [job(3, "add", 1, 0), job(4, "add", 2, 0)]
            urgent = msgspec.structs.replace(job(5, "add", 9, 0), priority=9)
            await session.send(job(1, "block"), job(2, "block"), *backlog)
            await until(lambda: worker.status()["prefetched"] == 2)
            await session.send(urgent)
            await until(lambda: worker.status()["prefetched"] == 3)
            gate.set()
            reports = [await session.expect(protocol.CompletedReport) for _ in range(5)]
            results = [r.result for r in reports if r.result != "unblocked"]
            assert results[0] == 9, "the urgent job took the first slot that freed"
