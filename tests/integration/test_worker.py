"""The worker against a scripted main over real TCP, speaking the real protocol."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest

from broker.exceptions import AuthenticationError, ConfigurationError
from broker.jobs import ExecutionMode
from broker.tasks.registry import TaskRegistry, task
from broker.tasks.runner import Assignment, RunnerStatus, RunOutcome
from broker.wire import codec
from broker.wire import framing as wire
from broker.wire import messages as protocol
from broker.worker.worker import Worker, install_signal_handlers
from runners.inline import InlineRunner

M = TypeVar("M", bound=protocol.Message)
INLINE = ExecutionMode.INLINE


@dataclass(eq=False)
class Session:
    """One worker connection as the fake main sees it."""

    hello: protocol.Hello
    writer: wire.MessageWriter
    inbox: asyncio.Queue[protocol.Message] = field(default_factory=asyncio.Queue)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    readies: list[protocol.Ready] = field(default_factory=list)
    statuses: list[protocol.WorkerStatus] = field(default_factory=list)
    """``worker_status`` messages, kept aside: they are for operators, not the protocol."""
    catalogs: list[protocol.TaskCatalog] = field(default_factory=list)
    """``tasks`` messages (the worker's task catalog), kept aside like the statuses."""

    async def send(self, *msgs: protocol.Message) -> None:
        await self.writer.send_many(msgs)

    async def recv(self, timeout: float = 3.0) -> protocol.Message:
        """The next message other than ping/pong, which the fake main handles itself."""
        return await asyncio.wait_for(self.inbox.get(), timeout)

    async def expect(self, kind: type[M], timeout: float = 3.0) -> M:
        """The next message, which must be a ``kind``; ``ready`` messages in between are
        kept in ``readies`` (when a slot frees is the runner's business, not the test's)."""
        while True:
            msg = await self.recv(timeout)
            if isinstance(msg, protocol.Ready) and kind is not protocol.Ready:
                self.readies.append(msg)
                continue
            assert isinstance(msg, kind), f"expected {kind.type}, got {msg!r}"
            return msg

    def drop(self) -> None:
        self.writer.abort()


class FakeMain:
    def __init__(self, *, token: str | None = None, silent: bool = False) -> None:
        self.token = token
        self.silent = silent
        """After the welcome, read nothing and answer nothing."""
        self.sessions: asyncio.Queue[Session] = asyncio.Queue()
        self.refused: list[protocol.Hello] = []
        self._handlers: set[asyncio.Task[Any]] = set()
        self._writers: list[wire.MessageWriter] = []

    async def __aenter__(self) -> FakeMain:
        self.server = await asyncio.start_server(
            self._serve, "127.0.0.1", 0, limit=wire.STREAM_LIMIT + 2
        )
        self.port: int = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        for writer in self._writers:
            writer.abort()
        for handler in self._handlers:
            handler.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self.server.wait_closed()

    async def session(self, timeout: float = 3.0) -> Session:
        return await asyncio.wait_for(self.sessions.get(), timeout)

    async def _serve(self, reader: asyncio.StreamReader, raw: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        writer = wire.MessageWriter(raw)
        self._writers.append(writer)
        lines = wire.LineReader(reader, wire.MAX_LINE_BYTES)
        nonce = protocol.make_nonce()
        await writer.send(
            protocol.Challenge(
                nonce=nonce,
                protocol=protocol.PROTOCOL_VERSION,
                auth_required=self.token is not None,
            )
        )
        hello = await wire.read_message(lines)
        assert isinstance(hello, protocol.Hello)
        if self.token is not None and not protocol.check_proof(self.token, nonce, hello.proof):
            self.refused.append(hello)
            await writer.send(
                protocol.Error(code=protocol.ErrorCode.AUTH_FAILED, message="bad proof", fatal=True)
            )
            await writer.close()
            return
        session = Session(hello, writer)
        await writer.send(
            protocol.Welcome(
                main_id="fake-main",
                protocol=protocol.PROTOCOL_VERSION,
                ping_interval=5.0,
                adopted=list(hello.held_leases),
                max_line_bytes=wire.MAX_LINE_BYTES,
            )
        )
        await self.sessions.put(session)
        try:
            if self.silent:
                await asyncio.sleep(3600)
            while (line := await wire.read_message(lines)) is not None:
                for msg in codec.unbatch(line):  # a batch's items, one by one
                    if isinstance(msg, protocol.Ping):
                        await writer.send(protocol.Pong(nonce=msg.nonce))
                    elif isinstance(msg, protocol.WorkerStatus):
                        session.statuses.append(msg)
                    elif isinstance(msg, protocol.TaskCatalog):
                        session.catalogs.append(msg)
                    elif not isinstance(msg, protocol.Pong):
                        session.inbox.put_nowait(msg)
        except (OSError, wire.UnterminatedLineError):
            pass
        finally:
            session.closed.set()


def job(seq: int, name: str, *args: Any, mode: ExecutionMode = INLINE) -> protocol.JobHandoff:
    return protocol.JobHandoff(
        seq=seq,
        job_id=uuid.uuid4(),
        handoff_id=uuid.uuid4(),
        task=name,
        args=list(args),
        kwargs={},
        execution_mode=mode,
        attempt=1,
        max_attempts=3,
        timeout=None,
        queue="default",
    )


def ack(
    report: protocol.CompletedReport | protocol.FailedReport | protocol.ReleaseReport,
) -> protocol.ReportAck:
    return protocol.ReportAck(
        job_id=report.job_id, handoff_id=report.handoff_id, status=protocol.AckStatus.APPLIED
    )


@pytest.fixture
def gate() -> asyncio.Event:
    return asyncio.Event()


@pytest.fixture
def registry(gate: asyncio.Event) -> TaskRegistry:
    registry = TaskRegistry()

    @task(name="add", registry=registry, mode="inline")
    async def add(a: int, b: int) -> int:
        return a + b

    @task(name="block", registry=registry, mode="inline")
    async def block() -> str:
        await gate.wait()
        return "unblocked"

    return registry


def make_worker(port: int, registry: TaskRegistry, **options: Any) -> Worker:
    # No prefetch window unless a test asks: these tests count credit slot by slot.
    options.setdefault("prefetch", 0)
    return Worker(
        "127.0.0.1",
        port,
        worker_id="worker-1",
        runners={INLINE: InlineRunner(registry, concurrency=2)},
        registry=registry,
        **options,
    )


@contextlib.asynccontextmanager
async def running(worker: Worker) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(worker.run())
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_handshake_without_token(registry: TaskRegistry) -> None:
    async with FakeMain() as main:
        worker = make_worker(main.port, registry, queues=["default", "mail"])
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
        async with running(make_worker(main.port, registry, token="s3cret")):
            session = await main.session()
            assert session.hello.proof is not None
            assert await session.expect(protocol.Ready)
        assert main.refused == []


async def test_wrong_token_stops_the_worker(registry: TaskRegistry) -> None:
    async with FakeMain(token="s3cret") as main:
        worker = make_worker(main.port, registry, token="guess")
        with pytest.raises(AuthenticationError, match="bad proof"):
            await asyncio.wait_for(worker.run(), 3)
        assert len(main.refused) == 1


async def test_missing_token_is_a_configuration_error(registry: TaskRegistry) -> None:
    async with FakeMain(token="s3cret") as main:
        with pytest.raises(ConfigurationError, match="requires a token"):
            await asyncio.wait_for(make_worker(main.port, registry).run(), 3)


async def test_job_runs_and_its_report_carries_the_lease(registry: TaskRegistry) -> None:
    async with FakeMain() as main:
        worker = make_worker(main.port, registry)
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
            for _ in range(100):
                if worker.status()["outbox"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert worker.status()["outbox"] == 0


async def test_ready_credits_are_exact(registry: TaskRegistry, gate: asyncio.Event) -> None:
    async with FakeMain() as main, running(make_worker(main.port, registry)):
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
    async with FakeMain() as main, running(make_worker(main.port, registry)):
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
    async with FakeMain() as main, running(make_worker(main.port, registry)):
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
        worker = make_worker(main.port, registry)
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
            for _ in range(100):
                if worker.status()["outbox"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert worker.status()["outbox"] == 0


async def test_running_job_is_held_across_a_reconnect(
    registry: TaskRegistry, gate: asyncio.Event
) -> None:
    async with FakeMain() as main, running(make_worker(main.port, registry)):
        first = await main.session()
        await first.expect(protocol.Ready)
        sent = job(1, "block")
        await first.send(sent)
        await asyncio.sleep(0.05)
        first.drop()

        second = await main.session()
        lease = protocol.LeaseRef(job_id=sent.job_id, handoff_id=sent.handoff_id)
        assert second.hello.held_leases == [lease]
        assert await second.recv() == protocol.Ready(slots={INLINE: 1}, seen=0)
        gate.set()
        report = await second.expect(protocol.CompletedReport)
        assert report.handoff_id == sent.handoff_id


async def test_job_arriving_while_draining_is_released(
    registry: TaskRegistry, gate: asyncio.Event
) -> None:
    async with FakeMain() as main:
        worker = make_worker(main.port, registry)
        async with running(worker) as run:
            session = await main.session()
            await session.expect(protocol.Ready)
            busy = job(1, "block")
            await session.send(busy)
            await asyncio.sleep(0.05)
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
    registry: TaskRegistry, gate: asyncio.Event
) -> None:
    async with FakeMain() as main:
        worker = make_worker(main.port, registry)
        async with running(worker) as run:
            session = await main.session()
            await session.expect(protocol.Ready)
            sent = job(1, "block")
            await session.send(sent)
            await asyncio.sleep(0.05)
            worker.request_stop()
            await session.expect(protocol.Draining)
            await asyncio.sleep(0.3)
            assert not run.done()

            gate.set()
            report = await session.expect(protocol.CompletedReport)
            assert report.handoff_id == sent.handoff_id
            await asyncio.sleep(0.2)
            assert not run.done(), "run() returned before its last report was acknowledged"
            await session.send(ack(report))
            await asyncio.wait_for(run, 3)
            assert worker.status()["outbox"] == 0
            await asyncio.wait_for(session.closed.wait(), 3)


async def test_second_stop_gives_running_jobs_back(registry: TaskRegistry) -> None:
    async with FakeMain() as main:
        worker = make_worker(main.port, registry)
        async with running(worker) as run:
            session = await main.session()
            await session.expect(protocol.Ready)
            sent = job(1, "block")
            await session.send(sent)
            await asyncio.sleep(0.05)
            worker.request_stop()
            worker.request_stop()

            await session.expect(protocol.Draining)
            release = await session.expect(protocol.ReleaseReport)
            assert release.handoff_id == sent.handoff_id
            await session.send(ack(release))
            await asyncio.wait_for(run, 3)


async def test_drain_timeout_fails_the_jobs_it_cancels(registry: TaskRegistry) -> None:
    async with FakeMain() as main:
        worker = make_worker(main.port, registry, drain_timeout=0.1)
        async with running(worker) as run:
            session = await main.session()
            await session.expect(protocol.Ready)
            await session.send(job(1, "block"))
            await asyncio.sleep(0.05)
            worker.request_stop()

            await session.expect(protocol.Draining)
            failed = await session.expect(protocol.FailedReport)
            assert failed.error == "cancelled"
            assert failed.retry is True
            await session.send(ack(failed))
            await asyncio.wait_for(run, 3)


async def test_idle_worker_drains_at_once_and_closes(registry: TaskRegistry) -> None:
    async with FakeMain() as main:
        worker = make_worker(main.port, registry)
        async with running(worker) as run:
            session = await main.session()
            await session.expect(protocol.Ready)
            worker.request_stop()
            await asyncio.wait_for(run, 3)
            await asyncio.wait_for(session.closed.wait(), 3)
            assert session.inbox.get_nowait() == protocol.Draining()
            assert worker.status()["connected"] is False


async def test_sigterm_drains_and_a_second_signal_stops_fast(registry: TaskRegistry) -> None:
    async with FakeMain() as main:
        worker = make_worker(main.port, registry)
        async with running(worker) as run:
            session = await main.session()
            await session.expect(protocol.Ready)
            await session.send(job(1, "block"))
            await asyncio.sleep(0.05)
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
        worker = make_worker(main.port, registry, ping_interval=0.1, liveness_timeout=0.5)
        async with running(worker):
            await main.session()
            connected = loop.time()
            await main.session(timeout=3)
            elapsed = loop.time() - connected
            assert 0.45 <= elapsed <= 1.5


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
