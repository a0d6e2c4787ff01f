"""The worker against a scripted main over real TCP, speaking the real protocol (its drain
and release cases run over memory streams, in tests/unit/test_worker_drain.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from collections.abc import Callable

import pytest

from broker.exceptions import AuthenticationError, ConfigurationError
from broker.jobs import ExecutionMode
from broker.tasks.registry import TaskRegistry
from broker.tasks.runner import Assignment, RunnerStatus, RunOutcome
from broker.wire import messages as protocol
from broker.worker.worker import Worker, install_signal_handlers
from runners.inline import InlineRunner
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
from tests.support import until

_ = (started, gate, registry)  # fixtures, used by name


async def test_handshake_without_token(registry: TaskRegistry) -> None:
    async with FakeMain() as main:
        worker = make_worker(main, registry, queues=["default", "mail"])
        async with running(worker):
            session = await main.session()
            hello = session.hello
            assert hello.role is protocol.Role.WORKER
            assert hello.protocol == protocol.PROTOCOL_VERSION
            assert (hello.worker_id, hello.proof) == ("worker-1", None)
            assert hello.modes == [INLINE]
            assert hello.queues == ["default", "mail"]
            assert hello.held_leases == []
            assert hello.pid is not None and hello.host
            assert await session.recv() == protocol.Ready(slots={INLINE: 2}, seen=0)
            [declared] = session.catalogs  # sent before anything else on the connection
            assert [t.name for t in declared.tasks] == registry.names()
            status = worker.status()
            assert status["connected"] is True
            assert status["main_id"] == "fake-main"
            assert status["runners"]["inline"].capacity == 2


async def test_handshake_with_token(registry: TaskRegistry) -> None:
    async with FakeMain(token="s3cret") as main:
        async with running(make_worker(main, registry, token="s3cret")):
            session = await main.session()
            assert session.hello.proof is not None
            assert await session.expect(protocol.Ready)
        assert main.refused == []


async def test_wrong_token_stops_the_worker(registry: TaskRegistry) -> None:
    async with FakeMain(token="s3cret") as main:
        worker = make_worker(main, registry, token="guess")
        with pytest.raises(AuthenticationError, match="bad proof"):
            await asyncio.wait_for(worker.run(), 3)
        assert len(main.refused) == 1


async def test_missing_token_is_a_configuration_error(registry: TaskRegistry) -> None:
    async with FakeMain(token="s3cret") as main:
        with pytest.raises(ConfigurationError, match="requires a token"):
            await asyncio.wait_for(make_worker(main, registry).run(), 3)


async def test_job_runs_and_its_report_carries_the_lease(registry: TaskRegistry) -> None:
    async with FakeMain() as main:
        worker = make_worker(main, registry)
        async with running(worker):
            session = await main.session()
            await session.expect(protocol.Ready)
            sent = job(1, "add", 2, 3)
            await session.send(sent)

            report = await session.expect(protocol.CompletedReport)
            assert (report.job_id, report.handoff_id, report.result) == (
                sent.job_id,
                sent.handoff_id,
                5,
            )
            assert await session.recv() == protocol.Ready(slots={INLINE: 2}, seen=1)
            assert worker.status()["outbox"] == 1
            await session.send(ack(report))
            await until(lambda: worker.status()["outbox"] == 0, timeout=3)


async def test_ready_credits_are_exact(registry: TaskRegistry, gate: asyncio.Event) -> None:
    async with FakeMain() as main, running(make_worker(main, registry)):
        session = await main.session()
        assert await session.recv() == protocol.Ready(slots={INLINE: 2}, seen=0)
        first, second, third = job(1, "block"), job(2, "block"), job(3, "block")
        await session.send(first, second, third)

        release = await session.expect(protocol.ReleaseReport)
        assert release.handoff_id == third.handoff_id
        assert "no free inline slot" in release.reason
        assert await session.recv() == protocol.Ready(slots={INLINE: 0}, seen=3)

        gate.set()
        completed: set[uuid.UUID] = set()
        while True:
            msg = await session.recv()
            if isinstance(msg, protocol.CompletedReport):
                completed.add(msg.handoff_id)
                continue
            assert isinstance(msg, protocol.Ready)
            assert msg.seen == 3
            if msg.slots[INLINE] == 2:
                break
        assert completed == {first.handoff_id, second.handoff_id}


async def test_seen_follows_jobs_that_never_take_a_slot(registry: TaskRegistry) -> None:
    async with FakeMain() as main, running(make_worker(main, registry)):
        session = await main.session()
        await session.expect(protocol.Ready)
        await session.send(job(4, "add", 1, 1, mode=ExecutionMode.POOLED))

        release = await session.expect(protocol.ReleaseReport)
        assert "does not run pooled jobs" in release.reason
        assert await session.recv() == protocol.Ready(slots={INLINE: 2}, seen=4)


async def test_unknown_task_fails_without_retry_and_imports_nothing(
    registry: TaskRegistry,
) -> None:
    assert "tabnanny" not in sys.modules
    async with FakeMain() as main, running(make_worker(main, registry)):
        session = await main.session()
        await session.expect(protocol.Ready)
        sent = job(1, "tabnanny.check", "/")
        await session.send(sent)

        failed = await session.expect(protocol.FailedReport)
        assert (failed.job_id, failed.handoff_id) == (sent.job_id, sent.handoff_id)
        assert failed.retry is False
        assert "'tabnanny.check' is not registered" in failed.error
        assert await session.recv() == protocol.Ready(slots={INLINE: 2}, seen=1)
    assert "tabnanny" not in sys.modules


class SpyRunner(InlineRunner):
    def __init__(self, registry: TaskRegistry) -> None:
        super().__init__(registry)
        self.asked: list[str] = []

    def run(self, assignment: Assignment) -> asyncio.Future[RunOutcome]:
        self.asked.append(assignment.task)
        return super().run(assignment)


async def test_unknown_task_never_reaches_the_runner(registry: TaskRegistry) -> None:
    runner = SpyRunner(registry)
    async with FakeMain() as main:
        worker = Worker(
            "127.0.0.1",
            main.port,
            worker_id="worker-1",
            runners={INLINE: runner},
            registry=registry,
        )
        async with running(worker):
            session = await main.session()
            await session.expect(protocol.Ready)
            await session.send(job(1, "not.registered"), job(2, "add", 1, 1))
            assert (await session.expect(protocol.FailedReport)).retry is False
            assert (await session.expect(protocol.CompletedReport)).result == 2
    assert runner.asked == ["add"]


async def test_unacked_report_is_resent_after_reconnect(registry: TaskRegistry) -> None:
    async with FakeMain() as main:
        worker = make_worker(main, registry)
        async with running(worker):
            first = await main.session()
            await first.expect(protocol.Ready)
            sent = job(1, "add", 20, 22)
            await first.send(sent)
            report = await first.expect(protocol.CompletedReport)
            first.drop()

            second = await main.session()
            lease = protocol.LeaseRef(job_id=sent.job_id, handoff_id=sent.handoff_id)
            assert second.hello.held_leases == [lease]
            assert await second.recv() == report
            assert await second.recv() == protocol.Ready(slots={INLINE: 2}, seen=0)
            await second.send(ack(report))
            await until(lambda: worker.status()["outbox"] == 0, timeout=3)


async def test_running_job_is_held_across_a_reconnect(
    registry: TaskRegistry, started: asyncio.Event, gate: asyncio.Event
) -> None:
    async with FakeMain() as main, running(make_worker(main, registry)):
        first = await main.session()
        await first.expect(protocol.Ready)
        sent = job(1, "block")
        await first.send(sent)
        await started.wait()
        first.drop()

        second = await main.session()
        lease = protocol.LeaseRef(job_id=sent.job_id, handoff_id=sent.handoff_id)
        assert second.hello.held_leases == [lease]
        assert await second.recv() == protocol.Ready(slots={INLINE: 1}, seen=0)
        gate.set()
        report = await second.expect(protocol.CompletedReport)
        assert report.handoff_id == sent.handoff_id


async def test_sigterm_drains_and_a_second_signal_stops_fast(
    registry: TaskRegistry, started: asyncio.Event
) -> None:
    async with FakeMain() as main:
        worker = make_worker(main, registry)
        async with running(worker) as run:
            session = await main.session()
            await session.expect(protocol.Ready)
            await session.send(job(1, "block"))
            await started.wait()
            install_signal_handlers(worker)

            os.kill(os.getpid(), signal.SIGTERM)
            await session.expect(protocol.Draining)
            assert worker.status()["draining"] is True
            assert not run.done()
            os.kill(os.getpid(), signal.SIGINT)
            release = await session.expect(protocol.ReleaseReport)
            await session.send(ack(release))
            await asyncio.wait_for(run, 3)


async def test_silent_main_is_detected_within_the_liveness_timeout(
    registry: TaskRegistry,
) -> None:
    loop = asyncio.get_running_loop()
    async with FakeMain(silent=True) as main:
        worker = make_worker(main, registry, ping_interval=0.1, liveness_timeout=0.5)
        async with running(worker):
            await main.session()
            connected = loop.time()
            # The reconnect within 3 s is the detection; that it came no sooner than the
            # timeout is the rule (a bound on how late would only measure the load).
            await main.session(timeout=3)
            assert loop.time() - connected >= 0.45


class _WatchedRunner(InlineRunner):
    """An inline runner that counts the statuses asked of it and can be told to report a
    start-up error, as a pooled runner whose children fail to start does."""

    def __init__(self, registry: TaskRegistry) -> None:
        super().__init__(registry, concurrency=2)
        self.statuses = 0
        self.error: str | None = None
        self.listener: Callable[[], None] = lambda: None

    def set_capacity_listener(self, listener: Callable[[], None]) -> None:
        super().set_capacity_listener(listener)
        self.listener = listener

    def status(self) -> RunnerStatus:
        self.statuses += 1
        status = super().status()
        status.startup_error = self.error
        return status


async def test_worker_status_follows_the_runners_without_asking_them_per_ready(
    registry: TaskRegistry,
) -> None:
    runner = _WatchedRunner(registry)
    async with FakeMain() as main:
        worker = Worker(
            "127.0.0.1",
            main.port,
            worker_id="worker-1",
            runners={INLINE: runner},
            registry=registry,
            prefetch=0,  # no window: every job's end is advertised, whatever the runs take
        )
        async with running(worker):
            session = await main.session()
            await session.expect(protocol.Ready)
            asked = runner.statuses
            for seq in (1, 2, 3):
                await session.send(job(seq, "add", seq, 1))
                report = await session.expect(protocol.CompletedReport)
                await session.send(ack(report))
            while len(session.readies) < 3:  # each job's end is advertised
                session.readies.append(await session.expect(protocol.Ready))
            assert runner.statuses == asked, "no runner changed: no status was built"
            assert len(session.statuses) == 1

            runner.error = "the task modules failed to import"
            runner.listener()  # what a runner does when its slots may have changed
            await session.expect(protocol.Ready)
            assert session.statuses[-1].status["runners"]["inline"]["startup_error"] == (
                "the task modules failed to import"
            )
