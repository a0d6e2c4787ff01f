"""Back-pressure and limits, against a real main over real TCP (issue 15, findings 3-6 and 9).

A peer that talks but does not read, floods requests, or never authenticates must cost the
main a bounded amount of memory and must not stop other peers from being served; liveness
needs answers to the main's own pings, and a stall of the main itself is not held against
its peers. Memory is measured on a main run as a child process (its RSS, from /proc).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from adapters.memory import MemoryAdapter
from broker.client.client import Client
from broker.exceptions import BrokerUnavailableError
from broker.jobs import ExecutionMode, Job, JobSpec, JobStatus
from broker.main.main import Main
from broker.main.settings import MainSettings
from broker.ops import cli
from broker.wire import codec
from broker.wire import framing as wire
from broker.wire import messages as protocol
from tests.support import FAST, FakeWorker, until

REPO = Path(__file__).resolve().parents[2]
POOLED = ExecutionMode.POOLED
MiB = 1 << 20


async def _start(store: MemoryAdapter, **overrides: Any) -> Main:
    main = Main(store, MainSettings(**{**FAST.__dict__, **overrides}))
    await main.start()
    return main


async def _enqueue(store: MemoryAdapter, n: int, **kw: Any) -> list[Job]:
    results = await store.enqueue_many([JobSpec(task="t.noop", args=[i], **kw) for i in range(n)])
    return [r.job for r in results]


async def _all(store: MemoryAdapter, jobs: list[Job], status: JobStatus) -> bool:
    found = [await store.get_job(job.id) for job in jobs]
    return all(job is not None and job.status is status for job in found)


class RawPeer:
    """A peer that reads only when the test says so, to play one that never does."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.lines = wire.LineReader(reader)
        self.writer = writer

    @classmethod
    async def connect(cls, port: int) -> RawPeer:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def read(self, timeout: float = 10.0) -> protocol.Message | None:
        return await asyncio.wait_for(wire.read_message(self.lines), timeout)

    async def send(self, *msgs: protocol.Message) -> None:
        self.writer.write(b"".join(codec.encode(msg) for msg in msgs))
        await self.writer.drain()

    async def send_raw(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def hello(self, role: protocol.Role, **fields: Any) -> protocol.Welcome:
        challenge = await self.read()
        assert isinstance(challenge, protocol.Challenge)
        await self.answer_challenge(role, **fields)
        welcome = await self.read()
        assert isinstance(welcome, protocol.Welcome), welcome
        self.lines.max_line_bytes = welcome.max_line_bytes
        return welcome

    async def answer_challenge(self, role: protocol.Role, **fields: Any) -> None:
        await self.send(protocol.Hello(role=role, protocol=protocol.PROTOCOL_VERSION, **fields))

    async def keep_pinging(self) -> None:
        """Talk without ever reading, until the main closes the connection."""
        with contextlib.suppress(ConnectionError, OSError):
            for nonce in itertools.count(1):
                await self.send(protocol.Ping(nonce=nonce))
                await asyncio.sleep(0.05)

    def close(self) -> None:
        self.writer.transport.abort()


@dataclass(eq=False)
class MainProcess:
    """``broker-main`` as a child process, so its memory can be read from /proc."""

    process: asyncio.subprocess.Process
    port: int = 0
    log: list[str] = field(default_factory=list)

    def memory(self, key: str) -> int:
        """``VmRSS`` (resident now) or ``VmHWM`` (the peak), in bytes."""
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        match = re.search(rf"^{key}:\s+(\d+) kB$", status, re.MULTILINE)
        assert match is not None, status
        return int(match.group(1)) * 1024

    def loop_cpu(self) -> float:
        """Seconds of CPU its main thread (the one running its event loop) has used:
        what the loop spent, whatever else ran on the machine meanwhile."""
        fields = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/stat").read_text()
        utime, stime = fields.rsplit(")", 1)[1].split()[11:13]
        return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")

    def logged(self, needle: str) -> int:
        return sum(needle in line for line in self.log)


@asynccontextmanager
async def _main_process(tmp_path: Path, *flags: str) -> AsyncIterator[MainProcess]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "broker.ops.cli",
        "main",
        "--database-url",
        f"sqlite+aiosqlite:///{tmp_path / 'broker.db'}",
        "--port",
        "0",
        *flags,
        cwd=REPO,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    main = MainProcess(process)
    listening = asyncio.get_running_loop().create_future()

    async def collect() -> None:
        assert process.stderr is not None
        async for raw in process.stderr:
            line = raw.decode(errors="replace")
            main.log.append(line)
            found = re.search(r"broker-main listening on 127\.0\.0\.1:(\d+)", line)
            if found and not listening.done():
                listening.set_result(int(found.group(1)))
        if not listening.done():
            listening.set_exception(AssertionError("".join(main.log)))

    collector = asyncio.create_task(collect())
    try:
        main.port = await asyncio.wait_for(listening, 30)
        yield main
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
        await collector


# ------------------------------------------------------------------ liveness


async def test_a_worker_that_pings_but_never_reads_loses_its_leases() -> None:
    memory = MemoryAdapter()
    main = await _start(memory)
    loop = asyncio.get_running_loop()
    deaf = await RawPeer.connect(main.port)
    talking: asyncio.Task[None] | None = None
    other = FakeWorker(main.port, worker_id="other")
    try:
        await deaf.hello(protocol.Role.WORKER, worker_id="deaf", modes=[POOLED])
        await deaf.send(protocol.Ready(slots={POOLED: 3}, seen=0))
        jobs = await _enqueue(memory, 3)
        await until(lambda: _all(memory, jobs, JobStatus.HANDED_OFF))
        talking = asyncio.create_task(deaf.keep_pinging())
        leased_at = loop.time()
        await other.connect()
        await other.ready(pooled=3)
        slack = 3.0  # a loaded two-core machine
        rerun = [await other.next_job(timeout=FAST.liveness_timeout + slack) for _ in jobs]
        assert {job.job_id for job in rerun} == {job.id for job in jobs}
        assert loop.time() - leased_at < FAST.liveness_timeout + slack
    finally:
        if talking is not None:
            talking.cancel()
        deaf.close()
        await other.close()
        await main.stop()


async def test_a_stalled_main_does_not_return_live_workers_leases() -> None:
    memory = MemoryAdapter()
    main = await _start(memory)
    worker = FakeWorker(main.port)
    try:
        await worker.connect()
        jobs = await _enqueue(memory, 2)
        await worker.ready(pooled=2)
        held = {(await worker.next_job()).handoff_id for _ in jobs}
        pings = worker.pings
        time.sleep(FAST.liveness_timeout * 2)  # blocks the whole loop, the main's included
        # Two liveness timeouts' worth of pings after the stall: any wrong judgement has
        # been made by then, and a dropped connection ends the wait at once.
        per_timeout = math.ceil(FAST.liveness_timeout / FAST.ping_interval)
        await until(lambda: worker.pings >= pings + 2 * per_timeout or not worker.connected)
        assert worker.connected, "the main dropped a live worker after its own stall"
        stored = [await memory.get_job(job.id) for job in jobs]
        assert {job.handoff_id for job in stored if job is not None} == held
        assert await _all(memory, jobs, JobStatus.HANDED_OFF)
        assert not main.leader.ledger.pending()
    finally:
        await worker.close()
        await main.stop()


# ------------------------------------------------------------------ credit


async def test_a_ready_over_the_credit_cap_is_refused() -> None:
    memory = MemoryAdapter()
    main = await _start(memory, max_credit=2)
    worker = FakeWorker(main.port)
    try:
        await worker.connect()
        await _enqueue(memory, 5)
        await worker.ready(pooled=2**62)
        [error] = await until(lambda: worker.errors)
        assert error.code == protocol.ErrorCode.OVER_LIMIT and not error.fatal
        assert "limit of 2" in error.message and "--max-credit" in error.message
        assert worker.connected
        await worker.ready(pooled=2)  # within the cap: applied as usual
        got = [await worker.next_job() for _ in range(2)]
        assert len({job.job_id for job in got}) == 2
        assert await worker.no_job_within(0.3), "never more than the cap"
    finally:
        await worker.close()
        await main.stop()


# ------------------------------------------------------------------ connection caps


@pytest.mark.parametrize(
    ("limit", "flag"),
    [
        ("max_connections", "--max-connections)"),
        ("max_connections_per_address", "--max-connections-per-address"),
    ],
)
async def test_a_connection_over_a_cap_is_refused_with_a_clear_error(limit: str, flag: str) -> None:
    main = await _start(MemoryAdapter(), handshake_timeout=30.0, **{limit: 2})
    holders = [await RawPeer.connect(main.port) for _ in range(2)]
    try:
        for peer in holders:
            await peer.hello(protocol.Role.CLIENT)
        refused = await RawPeer.connect(main.port)
        holders.append(refused)  # closed with the others
        error = await refused.read()
        assert isinstance(error, protocol.Error), error
        assert error.code == protocol.ErrorCode.OVER_LIMIT and error.fatal
        assert flag in error.message
        assert await refused.read() is None, "closed after the error"
        with pytest.raises(BrokerUnavailableError, match=re.escape(flag)):
            async with Client("127.0.0.1", main.port, timeout=5.0, retry_timeout=0):
                pass
        holders[0].close()  # the place comes back once a holder leaves
        await until(lambda: _challenged(main.port))
    finally:
        for peer in holders:
            peer.close()
        await main.stop()


async def test_a_connection_over_the_handshake_limit_waits_its_turn() -> None:
    """Over ``--max-unauthenticated`` a connection is not refused: it waits in line and
    is challenged as soon as a handshake ends (a fleet restarting at once gets in)."""
    main = await _start(MemoryAdapter(), handshake_timeout=30.0, max_unauthenticated=2)
    holders = [await RawPeer.connect(main.port) for _ in range(2)]
    try:
        for peer in holders:
            assert isinstance(await peer.read(), protocol.Challenge)
        waiting = await RawPeer.connect(main.port)
        holders.append(waiting)
        await until(lambda: main.connections.admission.waiting == 1)
        await holders[0].answer_challenge(protocol.Role.CLIENT)
        assert isinstance(await waiting.read(), protocol.Challenge)
        assert main.connections.admission.waiting == 0
    finally:
        for peer in holders:
            peer.close()
        await main.stop()


async def test_a_connection_that_waits_past_the_handshake_deadline_is_refused() -> None:
    main = await _start(MemoryAdapter(), handshake_timeout=0.5, max_unauthenticated=1)
    try:
        # The one slot, held for good (a peer would hold it for a deadline of its own).
        assert main.connections.admission.enter("127.0.0.1", asyncio.Future())
        late = await RawPeer.connect(main.port)
        error = await late.read()
        assert isinstance(error, protocol.Error) and error.code == protocol.ErrorCode.OVER_LIMIT
        assert "--max-unauthenticated" in error.message
        assert "no slot came free within the handshake deadline" in error.message
        assert main.connections.admission.waiting == 0
        late.close()
    finally:
        await main.stop()


async def _challenged(port: int) -> bool:
    """Whether a new connection is greeted with a challenge (not refused)."""
    peer = await RawPeer.connect(port)
    try:
        return isinstance(await peer.read(), protocol.Challenge)
    finally:
        peer.close()


# ------------------------------------------------------------------ requests


class GatedStore(MemoryAdapter):
    """``get_job`` waits for ``gate``, so a test can hold requests in progress."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.running = 0
        self.started = 0
        self.cancelled = 0

    async def get_job(self, job_id: uuid.UUID) -> Job | None:
        self.started += 1
        self.running += 1
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
        return await super().get_job(job_id)


async def test_requests_are_bounded_and_cancelled_when_their_connection_closes() -> None:
    store = GatedStore()
    main = await _start(store, max_requests_per_connection=3, max_requests=2)
    flood = await RawPeer.connect(main.port)
    worker = FakeWorker(main.port)
    try:
        await flood.hello(protocol.Role.CLIENT)
        await flood.send(
            *(protocol.GetJob(request_id=f"r{i}", job_id=uuid.uuid4()) for i in range(10))
        )
        await until(lambda: store.running == 2)  # the cap on requests across connections
        [session] = [s for s in main.sessions.values() if s.role is protocol.Role.CLIENT]
        await until(lambda: len(session.requests) == 3)  # then the main stops reading it
        # Requests hold no slot that dispatch needs: a worker is still served.
        await worker.connect()
        [job] = await _enqueue(store, 1)
        await worker.ready(pooled=1)
        assert (await worker.next_job()).job_id == job.id
        assert store.started == 2 and len(session.requests) == 3

        flood.close()
        await until(lambda: store.cancelled == 2)  # nobody is left to answer
        store.gate.set()
        async with Client("127.0.0.1", main.port, timeout=5.0) as client:
            assert await client.get_job(job.id) is not None
        assert store.started == 3, "requests of a closed connection never ran"
    finally:
        flood.close()
        await worker.close()
        await main.stop()


# ------------------------------------------------------------------ memory


async def test_a_client_that_floods_requests_and_never_reads_costs_bounded_memory(
    tmp_path: Path,
) -> None:
    """200 ``list_jobs`` of about 0.5 MiB each, pipelined by a client that keeps pinging
    but never reads: the old main queued every reply (100 MiB and more) and kept the
    connection. Bound: the main's peak RSS grows by less than 32 MiB (the outbox cap of
    1 MiB, four replies in progress, and their decoding), the connection is closed within
    the liveness timeout, and other peers are served meanwhile."""
    flags = ["--ping-interval", "0.5", "--liveness-timeout", "3"]
    flags += ["--max-outbox-bytes", str(MiB), "--max-requests-per-connection", "4"]
    async with (
        _main_process(tmp_path, *flags) as main,
        Client("127.0.0.1", main.port, timeout=30.0) as client,
    ):
        await client.enqueue_many(
            [JobSpec(task="t.big", args=["x" * 12_000, i]) for i in range(40)]
        )
        page = await client.list_jobs(limit=40)  # warms the main's caches
        assert len(page.jobs) == 40
        baseline = main.memory("VmRSS")

        flood = await RawPeer.connect(main.port)
        await flood.hello(protocol.Role.CLIENT)
        await flood.send(*(protocol.ListJobs(request_id=f"r{i}", limit=40) for i in range(200)))
        talking = asyncio.create_task(flood.keep_pinging())
        worker = FakeWorker(main.port)
        try:
            # Other peers are served while the flood is held back.
            await worker.connect(queues=["work"])
            [ref] = await client.enqueue_many([JobSpec(task="t.small", queue="work")])
            await worker.ready(pooled=1)
            assert (await worker.next_job(timeout=10)).job_id == ref.job_id
            await asyncio.wait_for(talking, 3 + 10)  # ends when the main drops it
        finally:
            talking.cancel()
            flood.close()
            await worker.close()
        await until(lambda: main.logged("treating as disconnected") == 1)
        growth = main.memory("VmHWM") - baseline
        assert growth < 32 * MiB, f"the main grew by {growth / MiB:.0f} MiB"
        assert "queues" in await client.status()


async def test_unauthenticated_connections_buffer_little(tmp_path: Path) -> None:
    """100 connections each send 1.5 MiB without a newline before any ``hello``: the old
    main buffered each in full (150 MiB and more) until the handshake deadline. Bound: each
    is refused past the 64 KiB pre-auth cap, having cost at most about 512 KiB (one 256 KiB
    socket read, the stream's read-ahead and the line buffer), so the peak RSS grows by less
    than 80 MiB (50 MiB plus the allocator's slack), and a normal client is still served.
    The connection caps are raised so that only the stream limit is tested."""
    flags = ["--max-unauthenticated", "1000", "--max-connections-per-address", "1000"]
    flags += ["--max-unauthenticated-per-address", "1000"]
    async with (
        _main_process(tmp_path, *flags) as main,
        Client("127.0.0.1", main.port, timeout=30.0) as client,
    ):
        assert "queues" in await client.status()
        baseline = main.memory("VmRSS")

        async def partial_line() -> None:
            peer = await RawPeer.connect(main.port)
            try:
                with contextlib.suppress(ConnectionError, OSError):
                    await peer.send_raw(b"x" * (3 * MiB // 2))
                    while await peer.read() is not None:  # until the main closes it
                        pass
            finally:
                peer.close()

        await asyncio.gather(*(partial_line() for _ in range(100)))
        await until(lambda: main.logged("code=line_too_long") == 100, timeout=30)
        growth = main.memory("VmHWM") - baseline
        assert growth < 80 * MiB, f"the main grew by {growth / MiB:.0f} MiB"
        assert "queues" in await client.status()


def test_every_limit_has_a_flag_and_an_environment_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BROKER_MAX_CREDIT", "7")
    args = cli.main_parser().parse_args(["--max-outbox-bytes", "4096"])
    assert int(args.max_credit) == 7 and args.max_outbox_bytes == 4096
    assert args.max_connections_per_address == MainSettings().max_connections_per_address
    text = cli.main_parser().format_help()
    for var in ("REQUESTS_PER_CONNECTION", "REQUESTS", "CONNECTIONS", "UNAUTHENTICATED"):
        assert f"BROKER_MAX_{var}]" in text
