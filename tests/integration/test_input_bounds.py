"""What one legal message may cost the main, against real mains over real TCP (issue 30,
findings 1, 2 and 4).

A 15.5 MiB enqueue of 5.4 million empty lists (under the 16 MiB payload limit) froze the
main for 7 to 21 s and grew it by 0.4 GB per request in flight; names had no length, so a
40 MiB task name went in through the wire and through ``enqueue_in``; a 20 MiB
``worker_status`` was kept and echoed in every ``status`` reply. What a request costs the
main's loop is measured as the CPU of its loop's thread (a probe pinging the main shows the
wall-clock wait beside it), memory on a main run as a child process (its peak RSS, from
/proc).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from adapters.memory import MemoryAdapter
from broker.client.client import Client
from broker.client.transactional import enqueue_in
from broker.exceptions import InvalidJobError, PayloadTooLargeError
from broker.jobs import ExecutionMode, JobSpec, JobStatus
from broker.model.bounds import DEFAULT_MAX_PAYLOAD_CONTAINERS, MAX_WORKER_STATUS_BYTES
from broker.tasks.registry import TaskRegistry, task
from broker.wire import messages as protocol
from runners.inline import InlineRunner
from tests.e2e.test_depth_limits import FAST, _run_on_a_worker
from tests.integration.test_backpressure import RawPeer, _main_process, _start
from tests.support import FakeWorker, until

MiB = 1 << 20
CLIENT = protocol.Role.CLIENT
NESTED = 5_400_000
"""Empty lists in the issue's enqueue: 15.5 MiB of ``[[],[],...]``."""


def _nested_args() -> bytes:
    return b"[[" + b"[]," * (NESTED - 1) + b"[]]]"


def _enqueue_line(request_id: str, args: bytes, task: str = "t") -> bytes:
    head = json.dumps({"type": "enqueue", "request_id": request_id, "allow_unknown_tasks": True})
    job = b'{"task":' + json.dumps(task).encode() + b',"args":' + args + b"}"
    return head[:-1].encode() + b',"jobs":[' + job + b"]}\n"


async def _answer(peer: RawPeer, timeout: float = 60) -> protocol.Message | None:
    """The main's next message to ``peer`` other than its pings (answered on the way)."""
    while True:
        msg = await peer.read(timeout=timeout)
        if not isinstance(msg, protocol.Ping):
            return msg
        await peer.send(protocol.Pong(nonce=msg.nonce))


class Probe:
    """A second connection that pings the main every few milliseconds and keeps the
    longest wait for a pong: how long the main's loop could not answer anyone."""

    def __init__(self, peer: RawPeer) -> None:
        self.peer = peer
        self.longest = 0.0
        self.answered = 0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        nonce = 0
        while True:
            nonce += 1
            sent = loop.time()
            await self.peer.send(protocol.Ping(nonce=nonce))
            pong = await _answer(self.peer)
            assert isinstance(pong, protocol.Pong) and pong.nonce == nonce, pong
            self.longest = max(self.longest, loop.time() - sent)
            self.answered += 1
            await asyncio.sleep(0.005)


async def test_a_nested_enqueue_is_refused_before_it_is_built(tmp_path: Path) -> None:
    """16 enqueues of 5.4 million empty lists in flight on one connection: each is refused
    (``payload_too_large``, naming the flag) for under 0.1 s of the main loop's CPU a
    request, and the main's peak RSS up by less than 64 MiB. Before the container bound
    each took seconds of the loop and about 0.4 GB."""
    async with _main_process(tmp_path) as main:
        flooder = await RawPeer.connect(main.port)
        prober = await RawPeer.connect(main.port)
        probing: asyncio.Task[None] | None = None
        try:
            await flooder.hello(CLIENT)
            await prober.hello(CLIENT)
            probe = Probe(prober)
            probing = asyncio.create_task(probe.run())
            await until(lambda: probe.answered >= 10)
            baseline = main.memory("VmHWM")
            args = _nested_args()
            assert 15 * MiB < len(args) < 16 * MiB
            line = _enqueue_line("r0", args)
            ids = [f"r{i}" for i in range(16)]
            started, cpu = time.monotonic(), main.loop_cpu()
            for rid in ids:  # pipelined: all 16 are on the wire before any answer is read
                await flooder.send_raw(line.replace(b'"r0"', f'"{rid}"'.encode(), 1))
            answers: dict[str, protocol.Message] = {}
            while len(answers) < len(ids):
                reply = await _answer(flooder, timeout=120)
                assert isinstance(reply, protocol.RequestError), reply
                answers[reply.request_id] = reply
            elapsed, cpu = time.monotonic() - started, main.loop_cpu() - cpu
            probing.cancel()
            for reply in answers.values():
                assert isinstance(reply, protocol.RequestError)
                assert reply.code == protocol.ErrorCode.PAYLOAD_TOO_LARGE, reply
                assert f"more than {DEFAULT_MAX_PAYLOAD_CONTAINERS} lists" in reply.message
                assert "--max-payload-containers" in reply.message
            grown = main.memory("VmHWM") - baseline
            print(
                f"16 nested enqueues refused in {elapsed:.2f} s, {cpu:.2f} s of the loop's "
                f"CPU; longest pong wait {probe.longest * 1000:.0f} ms; peak RSS "
                f"+{grown / MiB:.1f} MiB"
            )
            # CPU, not the pong wait: beside CPU spinners (make test-loaded) the scheduler
            # alone can hold a pong back for most of a second. Reading 250 MiB and refusing
            # it costs the loop's thread well under 0.1 s a request; building the lists cost
            # it seconds each.
            assert cpu < 16 * 0.1, f"the main's loop spent {cpu:.2f} s of CPU on 16 refusals"
            assert grown < 64 * MiB, f"the main's peak RSS grew {grown / MiB:.0f} MiB"
        finally:
            if probing is not None:
                probing.cancel()
            flooder.close()
            prober.close()


async def test_a_40_mib_task_name_is_refused_on_the_wire(tmp_path: Path) -> None:
    """Even with a line limit that lets 40 MiB through, the name is refused (names are at
    most 1024 bytes) and nothing is stored; the connection stays open."""
    async with _main_process(tmp_path, "--max-line-bytes", str(48 * MiB)) as main:
        peer = await RawPeer.connect(main.port)
        try:
            await peer.hello(CLIENT)
            await peer.send_raw(_enqueue_line("long", b"[]", task="x" * (40 * MiB)))
            reply = await _answer(peer)
            assert isinstance(reply, protocol.RequestError), reply
            assert reply.code == protocol.ErrorCode.MALFORMED
            assert "task must be at most 1024 bytes" in reply.message
            await peer.send(protocol.ListJobs(request_id="list"))
            listing = await _answer(peer)
            assert isinstance(listing, protocol.JobList) and listing.jobs == []
        finally:
            peer.close()


def test_a_40_mib_task_name_is_refused_by_enqueue_in(tmp_path: Path) -> None:
    """The direct door: ``enqueue_in`` (and any ``JobSpec``) refuses the name before
    anything is written, as it refuses a payload over the container bound."""
    path = tmp_path / "app.db"

    async def setup() -> None:
        from adapters.sql import SQLAlchemyAdapter

        store = SQLAlchemyAdapter(f"sqlite+aiosqlite:///{path}")
        await store.setup()
        await store.close()

    asyncio.run(setup())
    engine = sa.create_engine(f"sqlite:///{path}")
    try:
        with engine.begin() as conn:
            with pytest.raises(InvalidJobError, match="task must be at most 1024 bytes"):
                enqueue_in(conn, "x" * (40 * MiB))
            with pytest.raises(InvalidJobError, match="queue must be at most 1024 bytes"):
                enqueue_in(conn, "t", queue="q" * 1025)
            with pytest.raises(PayloadTooLargeError, match="lists and objects"):
                enqueue_in(conn, "t", [[[]] * DEFAULT_MAX_PAYLOAD_CONTAINERS])
            enqueue_in(conn, "t" * 1024, [[[]] * (DEFAULT_MAX_PAYLOAD_CONTAINERS - 3)])
        with engine.connect() as conn:
            tasks = conn.exec_driver_sql("SELECT task FROM broker_jobs").scalars().all()
        assert [len(task) for task in tasks] == [1024], "only the job within every bound"
    finally:
        engine.dispose()


async def test_a_20_mib_worker_status_is_refused_and_not_kept(tmp_path: Path) -> None:
    async with _main_process(tmp_path) as main:
        peer = await RawPeer.connect(main.port)
        client = Client(port=main.port)
        try:
            await peer.hello(protocol.Role.WORKER, worker_id="w1")
            big = protocol.WorkerStatus(status={"runners": {}, "notes": "x" * (20 * MiB)})
            await peer.send(big)
            error = await _answer(peer)
            assert isinstance(error, protocol.Error), error
            assert error.code == protocol.ErrorCode.OVER_LIMIT and not error.fatal
            assert f"over the limit of {MAX_WORKER_STATUS_BYTES} bytes" in error.message
            # Not kept: the status the main reports right after holds none of it. (The main's
            # RSS says nothing here: the 20 MiB line, within the line bound, was read into a
            # buffer the allocator may keep.)
            before = await client.status()
            assert len(json.dumps(before)) < MAX_WORKER_STATUS_BYTES, "the big status was kept"
            small = protocol.WorkerStatus(status={"runners": {"pooled": {"capacity": 2}}})
            await peer.send(small)  # within the bound: kept, and the connection is fine

            async def reported() -> Any:
                status = await client.status()
                workers = status["workers"]
                assert isinstance(workers, list) and len(workers) == 1
                return workers[0] if workers[0]["capacity"] == {"pooled": 2} else None

            await until(reported)
        finally:
            await client.close()
            peer.close()


async def test_a_result_over_the_container_bound_fails_its_job_cleanly() -> None:
    """A worker that sends such a result anyway (a current worker fails the job itself):
    the main refuses the line unread, fails the job without retry in its place, and
    answers the report, so the worker forgets it and keeps its connection."""
    memory = MemoryAdapter()
    main = await _start(memory)
    worker = FakeWorker(main.port)
    try:
        await worker.connect()
        [made] = await memory.enqueue_many([JobSpec(task="t", max_attempts=5)])
        await worker.ready(pooled=1)
        job = await worker.next_job()
        ack = await worker.complete(job, result=[[]] * (DEFAULT_MAX_PAYLOAD_CONTAINERS + 10))
        assert ack.status is protocol.AckStatus.APPLIED
        stored = await memory.get_job(made.job.id)
        assert stored is not None and stored.status is JobStatus.FAILED
        assert stored.last_error is not None and "lists and objects" in stored.last_error
        assert worker.connected
        assert worker.welcome is not None  # a current worker fails such a result itself
        assert worker.welcome.max_payload_containers == DEFAULT_MAX_PAYLOAD_CONTAINERS
    finally:
        await worker.close()
        await main.stop()


class _HeldStore(MemoryAdapter):
    """A store whose enqueues wait until the test lets them go (the fault: a slow store)."""

    def __init__(self) -> None:
        super().__init__()
        self.go = asyncio.Event()

    async def enqueue_many(self, specs: Any, *args: Any, **kwargs: Any) -> Any:
        await self.go.wait()
        return await super().enqueue_many(specs, *args, **kwargs)


async def test_the_bytes_of_requests_read_ahead_are_bounded_per_connection() -> None:
    """Six enqueues of 15 MiB on one connection while the store is slow: the main reads
    ahead only while that connection's requests in progress hold under 32 MiB, so at
    most three (the count cap alone, 16, let all six, 90 MiB, in). Six leave 45 MiB
    unread, more than the kernel's socket buffers hold."""
    store = _HeldStore()
    main = await _start(store, ping_interval=5.0, liveness_timeout=60.0)  # the peer never pongs
    peer = await RawPeer.connect(main.port)
    try:
        await peer.hello(CLIENT)
        body = json.dumps(["x" * (15 * MiB)]).encode()

        async def send_all() -> None:
            for i in range(6):
                await peer.send_raw(_enqueue_line(f"r{i}", body))

        sending = asyncio.create_task(send_all())
        [session] = await until(lambda: [s for s in main.sessions.values() if s.requests])
        await until(lambda: len(session.requests) >= 3)
        # The main stopped reading, so 90 MiB cannot all leave the socket: the sender
        # is still stuck a second later (a main that read on would have taken them all).
        done, _ = await asyncio.wait({sending}, timeout=1.0)
        assert not done, "the main read every request while the store held them"
        assert len(session.requests) <= 3, len(session.requests)
        assert session.request_bytes < 32 * MiB + 16 * MiB
        store.go.set()
        await sending
        answered = [await _answer(peer) for _ in range(6)]
        assert all(isinstance(a, protocol.EnqueuedReply) for a in answered), answered
        assert main.connections.read_ahead.bytes == 0
    finally:
        peer.close()
        await main.stop()


async def test_the_bytes_of_requests_read_ahead_are_bounded_in_all() -> None:
    """Three connections, three 15 MiB enqueues each, a slow store and a 16 MiB total:
    a connection with a request in progress stops reading once the total is reached,
    so four are read in all (each connection's first, and one more) where the cap per
    connection alone (32 MiB) let nine in."""
    store = _HeldStore()
    main = await _start(store, ping_interval=5.0, liveness_timeout=60.0, max_request_bytes=16 * MiB)
    peers = [await RawPeer.connect(main.port) for _ in range(3)]
    body = json.dumps(["x" * (15 * MiB)]).encode()

    async def send_three(peer: RawPeer) -> None:
        await peer.hello(CLIENT)
        for i in range(3):
            await peer.send_raw(_enqueue_line(f"r{i}", body))

    sending = [asyncio.create_task(send_three(peer)) for peer in peers]
    try:

        def in_progress() -> int:
            return sum(len(s.requests) for s in main.sessions.values())

        await until(
            lambda: len(main.sessions) == 3 and all(s.requests for s in main.sessions.values())
        )
        done, _ = await asyncio.wait(sending, timeout=1.0)
        assert not done and in_progress() <= 4, in_progress()
        store.go.set()
        await asyncio.gather(*sending)
        for peer in peers:
            answered = [await _answer(peer) for _ in range(3)]
            assert all(isinstance(a, protocol.EnqueuedReply) for a in answered), answered
    finally:
        for peer in peers:
            peer.close()
        await main.stop()


async def test_a_worker_fails_a_result_over_the_container_bound_before_sending_it() -> None:
    """A real worker (its bound from ``welcome``) fails the job itself, without retry, and
    keeps serving; a result within the bound completes."""
    registry = TaskRegistry()

    @task(name="wide", registry=registry, mode="inline")
    async def wide(n: int) -> list[list[int]]:
        return [[]] * n

    inline = ExecutionMode.INLINE
    specs = [
        JobSpec(task="wide", args=[DEFAULT_MAX_PAYLOAD_CONTAINERS + 1], execution_mode=inline),
        JobSpec(task="wide", args=[1000], execution_mode=inline),
    ]
    runner = InlineRunner(registry, concurrency=2)
    over, fits = await _run_on_a_worker(FAST, runner, registry, specs)
    assert over.status is JobStatus.FAILED and over.result is None
    assert over.attempts == 1 and over.max_attempts > 1, "failed without retry"
    assert f"holds more than {DEFAULT_MAX_PAYLOAD_CONTAINERS} lists" in (over.last_error or "")
    assert fits.status is JobStatus.COMPLETED and fits.result == [[]] * 1000


async def test_the_client_refuses_an_enqueue_over_the_container_bound_before_sending() -> None:
    memory = MemoryAdapter()
    main = await _start(memory)
    try:
        async with Client("127.0.0.1", main.port, allow_unknown_tasks=True) as client:
            with pytest.raises(PayloadTooLargeError, match="--max-payload-containers"):
                await client.enqueue("t", [[[]] * DEFAULT_MAX_PAYLOAD_CONTAINERS])
            # Within the bound it goes in, on the same connection.
            assert not (await client.enqueue("t", [[[]] * 1000])).duplicate
            [session] = main.sessions.values()
            assert session.errors == 0, "nothing over the bound reached the main"
        assert len((await memory.list_jobs()).jobs) == 1
    finally:
        await main.stop()
