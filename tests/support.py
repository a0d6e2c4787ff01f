"""Test peers that speak the real protocol over real TCP, driven step by step by a test."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

from broker.jobs import ExecutionMode
from broker.main.main import Main
from broker.main.settings import MainSettings
from broker.wire import codec
from broker.wire import framing as wire
from broker.wire import messages as protocol

FAST = MainSettings(
    port=0,
    ping_interval=0.2,
    liveness_timeout=1.0,
    orphan_grace=0.5,
    error_retry_interval=0.05,
    poll_interval=0.05,
    handshake_timeout=0.5,
)
"""A main on an ephemeral port whose every timer is short, so tests of liveness, orphans
and retries finish in a second or two."""


def cli_with_greeting_wait(seconds: float, command: str) -> list[str]:
    """``python -m broker.ops.cli COMMAND`` (``worker`` or ``broker``) as a real process whose
    wait for the main's greeting is ``seconds`` instead of ``wire.GREETING_TIMEOUT`` (2 s),
    for the tests that outwait a peer that never greets; the command's arguments follow."""
    entry = {"worker": "worker_entry", "broker": "broker_entry"}[command]
    code = (
        "import sys\n"
        "if sys.path[:1] == ['']: del sys.path[0]\n"  # as python -m broker.ops.cli does
        "from broker.ops import cli\n"
        "from broker.wire import framing as wire\n"
        "wire.GREETING_TIMEOUT = float(sys.argv[1])\n"
        f"raise SystemExit(cli.{entry}(sys.argv[2:]))\n"
    )
    return [sys.executable, "-c", code, str(seconds)]


@contextlib.asynccontextmanager
async def running_main(store: Any, settings: MainSettings = FAST) -> AsyncIterator[Main]:
    """A started main without retention (tests prune on their own), stopped on exit."""
    main = Main(store, settings, retention=None)
    await main.start()
    try:
        yield main
    finally:
        await main.stop()


async def until(check: Callable[[], Any], timeout: float = 15.0) -> Any:
    """Poll ``check()`` (sync or async) until it is truthy and return that value; fail after
    ``timeout`` seconds. Tests wait on conditions, never on fixed sleeps."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.02)


class FakeWorker:
    """A worker whose every message the test chooses, to provoke exact interleavings."""

    def __init__(self, port: int, worker_id: str = "fake-worker", token: str | None = None) -> None:
        self.port = port
        self.worker_id = worker_id
        self.token = token
        self.jobs: asyncio.Queue[protocol.JobHandoff] = asyncio.Queue()
        self.acks: asyncio.Queue[protocol.ReportAck] = asyncio.Queue()
        self.errors: list[protocol.Error] = []
        self.pings = 0
        """Pings received from the main (each answered at once)."""
        self.welcome: protocol.Welcome | None = None
        self.seen = 0
        self._writer: wire.MessageWriter | None = None
        self._reader: asyncio.Task[None] | None = None

    async def connect(
        self,
        *,
        modes: tuple[ExecutionMode, ...] = tuple(ExecutionMode),
        held: list[protocol.LeaseRef] | None = None,
        queues: list[str] | None = None,
    ) -> protocol.Welcome:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", self.port, limit=wire.STREAM_LIMIT
        )
        lines = wire.LineReader(reader, max_line_bytes=1 << 20)
        self._writer = wire.MessageWriter(writer)
        challenge = await wire.read_message(lines)
        assert isinstance(challenge, protocol.Challenge)
        proof = protocol.make_proof(self.token, challenge.nonce) if self.token else None
        await self.send(
            protocol.Hello(
                role=protocol.Role.WORKER,
                protocol=protocol.PROTOCOL_VERSION,
                proof=proof,
                worker_id=self.worker_id,
                modes=list(modes),
                queues=queues,
                held_leases=held or [],
            )
        )
        welcome = await wire.read_message(lines)
        if isinstance(welcome, protocol.Error):
            raise ConnectionRefusedError(welcome.message)
        assert isinstance(welcome, protocol.Welcome)
        self.welcome = welcome
        self._reader = asyncio.create_task(self._read(lines))
        return welcome

    async def _read(self, lines: wire.LineReader) -> None:
        try:
            while (line := await wire.read_message(lines)) is not None:
                for msg in codec.unbatch(line):
                    await self._handle(msg)
        except (ConnectionError, OSError):
            pass

    async def _handle(self, msg: protocol.Message) -> None:
        match msg:
            case protocol.JobHandoff():
                self.jobs.put_nowait(msg)
            case protocol.ReportAck():
                self.acks.put_nowait(msg)
            case protocol.Ping(nonce=nonce):
                self.pings += 1
                await self.send(protocol.Pong(nonce=nonce))
            case protocol.Error():
                self.errors.append(msg)

    @property
    def connected(self) -> bool:
        """Still reading: the main has not closed the connection."""
        return self._reader is not None and not self._reader.done()

    async def send(self, msg: protocol.Message) -> None:
        assert self._writer is not None
        await self._writer.send(msg)

    async def ready(self, seen: int | None = None, **slots: int) -> None:
        await self.send(
            protocol.Ready(
                slots={ExecutionMode(k): v for k, v in slots.items()},
                seen=self.seen if seen is None else seen,
            )
        )

    async def next_job(self, timeout: float = 30.0) -> protocol.JobHandoff:
        """The next job sent. ``timeout`` only guards against a hang: a loaded machine can
        keep the test's process (the main's loop among it) off the CPU for seconds."""
        job = await asyncio.wait_for(self.jobs.get(), timeout)
        self.seen = job.seq
        return job

    async def no_job_within(self, seconds: float) -> bool:
        try:
            await asyncio.wait_for(self.jobs.get(), seconds)
        except TimeoutError:
            return True
        return False

    async def report(self, msg: protocol.Message, timeout: float = 5.0) -> protocol.ReportAck:
        await self.send(msg)
        return await asyncio.wait_for(self.acks.get(), timeout)

    async def complete(self, job: protocol.JobHandoff, result: Any = None) -> protocol.ReportAck:
        return await self.report(
            protocol.CompletedReport(job_id=job.job_id, handoff_id=job.handoff_id, result=result)
        )

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._writer is not None:
            self._writer.abort()
        await asyncio.sleep(0)


def lease_of(job: protocol.JobHandoff) -> protocol.LeaseRef:
    return protocol.LeaseRef(job_id=job.job_id, handoff_id=job.handoff_id)


__all__ = ["FakeWorker", "lease_of", "until"]
