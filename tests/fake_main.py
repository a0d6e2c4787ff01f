"""A scripted main for the worker's tests, speaking the real protocol over TCP or over
memory streams, and the helpers those tests share."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest

from broker.jobs import ExecutionMode
from broker.tasks.registry import TaskRegistry, task
from broker.wire import codec
from broker.wire import framing as wire
from broker.wire import messages as protocol
from broker.worker.worker import Worker
from runners.inline import InlineRunner
from tests.memory_streams import MemoryNetwork

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
    """A scripted main: over TCP on a free port, or, with ``memory``, over memory streams
    (:mod:`tests.memory_streams`) that :func:`make_worker` hands the worker."""

    def __init__(
        self, *, token: str | None = None, silent: bool = False, memory: bool = False
    ) -> None:
        self.token = token
        self.silent = silent
        """After the welcome, read nothing and answer nothing."""
        self.network = MemoryNetwork(self._serve) if memory else None
        self.sessions: asyncio.Queue[Session] = asyncio.Queue()
        self.refused: list[protocol.Hello] = []
        self._handlers: set[asyncio.Task[Any]] = set()
        self._writers: list[wire.MessageWriter] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> FakeMain:
        if self.network is None:
            self.server = await asyncio.start_server(
                self._serve, "127.0.0.1", 0, limit=wire.STREAM_LIMIT + 2
            )
            self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.close()
        for writer in self._writers:
            writer.abort()
        for handler in self._handlers:
            handler.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self.server is not None:
            await self.server.wait_closed()

    async def session(self, timeout: float = 3.0) -> Session:
        return await asyncio.wait_for(self.sessions.get(), timeout)

    async def _serve(self, reader: asyncio.StreamReader, raw: wire.StreamSink) -> None:
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
def started() -> asyncio.Event:
    return asyncio.Event()


@pytest.fixture
def gate() -> asyncio.Event:
    return asyncio.Event()


@pytest.fixture
def registry(started: asyncio.Event, gate: asyncio.Event) -> TaskRegistry:
    """``add``, and ``block``, which sets ``started`` and then waits for ``gate``."""
    registry = TaskRegistry()

    @task(name="add", registry=registry, mode="inline")
    async def add(a: int, b: int) -> int:
        return a + b

    @task(name="block", registry=registry, mode="inline")
    async def block() -> str:
        started.set()
        await gate.wait()
        return "unblocked"

    return registry


def make_worker(main: FakeMain, registry: TaskRegistry, **options: Any) -> Worker:
    # No prefetch window unless a test asks: these tests count credit slot by slot.
    options.setdefault("prefetch", 0)
    worker = Worker(
        "127.0.0.1",
        main.port,
        worker_id="worker-1",
        runners={INLINE: InlineRunner(registry, concurrency=2)},
        registry=registry,
        **options,
    )
    if main.network is not None:
        worker.network = main.network
    return worker


@contextlib.asynccontextmanager
async def running(worker: Worker) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(worker.run())
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
