"""The worker's drain and release cases against a scripted main over memory streams
(:mod:`tests.memory_streams`): the real worker, link and protocol, with no port and no
fixed sleep. A job's start is an event its task sets; "not yet" is asserted once every
task has had its turns, since nothing here waits on a socket."""

from __future__ import annotations

import asyncio

from broker.tasks.registry import TaskRegistry
from broker.wire import messages as protocol
from tests.fake_main import (
    INLINE,
    FakeMain,
    ack,
    gate,
    job,
    make_worker,
    registry,
    running,
    started,
)

_ = (started, gate, registry)  # fixtures, used by name


async def turns(count: int = 50) -> None:
    """Let every task that can run, run: over memory streams a message reaches its reader
    within a turn or two, so this many leave nothing under way."""
    for _ in range(count):
        await asyncio.sleep(0)


async def test_job_arriving_while_draining_is_released(
    registry: TaskRegistry, started: asyncio.Event, gate: asyncio.Event
) -> None:
    async with FakeMain(memory=True) as main:
        worker = make_worker(main, registry)
        async with running(worker) as run:
            session = await main.session()
            await session.expect(protocol.Ready)
            busy = job(1, "block")
            await session.send(busy)
            await started.wait()
            worker.request_stop()
            await session.expect(protocol.Draining)
            assert await session.recv() == protocol.Ready(slots={INLINE: 0}, seen=1)

            late = job(2, "add", 1, 2)
            await session.send(late)
            release = await session.expect(protocol.ReleaseReport)
            assert release.handoff_id == late.handoff_id
            assert "draining" in release.reason
            assert await session.recv() == protocol.Ready(slots={INLINE: 0}, seen=2)
            gate.set()
            completed = await session.expect(protocol.CompletedReport)
            assert completed.handoff_id == busy.handoff_id
            await session.send(ack(release), ack(completed))
            await asyncio.wait_for(run, 3)


async def test_drain_waits_for_the_running_job_and_flushes_its_report(
    registry: TaskRegistry, started: asyncio.Event, gate: asyncio.Event
) -> None:
    async with FakeMain(memory=True) as main:
        worker = make_worker(main, registry)
        async with running(worker) as run:
            session = await main.session()
            await session.expect(protocol.Ready)
            sent = job(1, "block")
            await session.send(sent)
            await started.wait()
            worker.request_stop()
            await session.expect(protocol.Draining)
            await turns()
            assert not run.done(), "run() returned while a job was running"

            gate.set()
            report = await session.expect(protocol.CompletedReport)
            assert report.handoff_id == sent.handoff_id
            await turns()
            assert not run.done(), "run() returned before its last report was acknowledged"
            await session.send(ack(report))
            await asyncio.wait_for(run, 3)
            assert worker.status()["outbox"] == 0
            await asyncio.wait_for(session.closed.wait(), 3)


async def test_second_stop_gives_running_jobs_back(
    registry: TaskRegistry, started: asyncio.Event
) -> None:
    async with FakeMain(memory=True) as main:
        worker = make_worker(main, registry)
        async with running(worker) as run:
            session = await main.session()
            await session.expect(protocol.Ready)
            sent = job(1, "block")
            await session.send(sent)
            await started.wait()
            worker.request_stop()
            worker.request_stop()

            await session.expect(protocol.Draining)
            release = await session.expect(protocol.ReleaseReport)
            assert release.handoff_id == sent.handoff_id
            await session.send(ack(release))
            await asyncio.wait_for(run, 3)


async def test_drain_timeout_fails_the_jobs_it_cancels(
    registry: TaskRegistry, started: asyncio.Event
) -> None:
    async with FakeMain(memory=True) as main:
        worker = make_worker(main, registry, drain_timeout=0)
        async with running(worker) as run:
            session = await main.session()
            await session.expect(protocol.Ready)
            await session.send(job(1, "block"))
            await started.wait()
            worker.request_stop()

            await session.expect(protocol.Draining)
            failed = await session.expect(protocol.FailedReport)
            assert failed.error == "cancelled"
            assert failed.retry is True
            await session.send(ack(failed))
            await asyncio.wait_for(run, 3)


async def test_idle_worker_drains_at_once_and_closes(registry: TaskRegistry) -> None:
    async with FakeMain(memory=True) as main:
        worker = make_worker(main, registry)
        async with running(worker) as run:
            session = await main.session()
            await session.expect(protocol.Ready)
            worker.request_stop()
            await asyncio.wait_for(run, 3)
            await asyncio.wait_for(session.closed.wait(), 3)
            assert session.inbox.get_nowait() == protocol.Draining()
            assert worker.status()["connected"] is False
