"""Payload limits: oversized args are refused at enqueue with nothing written, and an
oversized result fails its job instead of being stored, on every path."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from adapters.memory import MemoryAdapter
from adapters.sql import SQLAlchemyAdapter
from broker.client.client import Client
from broker.exceptions import (
    ConfigurationError,
    InvalidJobError,
    PayloadTooLargeError,
)
from broker.jobs import ExecutionMode, JobSpec, JobStatus
from broker.main.main import Main
from broker.main.settings import DEFAULT_MAX_LINE_BYTES, MainSettings, line_limit_for
from broker.ops import cli
from broker.payload import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    DEFAULT_OFFLOAD_BYTES,
    LINE_HEADROOM_BYTES,
    args_size,
    check_args,
    result_too_large,
)
from broker.storage import SupportsOffload
from broker.tasks.registry import TaskRegistry, task
from broker.wire import messages as protocol
from broker.worker.worker import Worker
from runners.inline import InlineRunner
from tests.support import FakeWorker, running_main, until

LIMIT = 1000
SMALL = MainSettings(
    port=0,
    max_payload_bytes=LIMIT,
    max_line_bytes=LIMIT + LINE_HEADROOM_BYTES,
    ping_interval=0.2,
    liveness_timeout=2.0,
    error_retry_interval=0.05,
    poll_interval=0.05,
)


def _main(
    store: Any, settings: MainSettings = SMALL
) -> contextlib.AbstractAsyncContextManager[Main]:
    return running_main(store, settings)


# ------------------------------------------------------------------ sizes and settings


def test_sizes_are_compact_ascii_json() -> None:
    assert args_size([1, "é"], {"k": None}) == len('[1,"\\u00e9"]') + len('{"k":null}')
    spec = JobSpec(task="t", args=["x" * 2000])
    with pytest.raises(PayloadTooLargeError) as raised:
        check_args(spec, LIMIT)
    message = str(raised.value)
    assert "2006 bytes" in message and f"limit of {LIMIT} bytes" in message
    assert check_args(spec, None) == 0
    assert result_too_large("x" * 10, LIMIT) is None
    assert result_too_large(None, LIMIT) is None
    problem = result_too_large("x" * 2000, LIMIT)
    assert problem is not None and "2002 bytes" in problem and str(LIMIT) in problem


def test_the_default_line_fits_a_job_at_the_default_payload_limit() -> None:
    defaults = MainSettings()
    assert defaults.max_payload_bytes == DEFAULT_MAX_PAYLOAD_BYTES == 16 << 20
    assert defaults.max_line_bytes == DEFAULT_MAX_LINE_BYTES == 21 << 20
    assert defaults.max_line_bytes >= DEFAULT_MAX_PAYLOAD_BYTES + (4 << 20) + LINE_HEADROOM_BYTES
    defaults.validate()
    with pytest.raises(ConfigurationError, match=r"max_line_bytes .* must exceed"):
        MainSettings(max_line_bytes=1 << 20).validate()
    with pytest.raises(ConfigurationError, match="max_payload_bytes must be positive"):
        MainSettings(max_payload_bytes=0).validate()
    MainSettings(max_line_bytes=1 << 20, max_payload_bytes=None).validate()
    assert line_limit_for(8 << 20, 4 << 20) == 13 << 20
    assert line_limit_for(8 << 20, None) == 9 << 20
    assert line_limit_for(10, 10) == 2 << 20, "never below 2 MiB"
    assert line_limit_for(32 << 20, 4 << 20) == 33 << 20, "never above a worker's line bound"
    MainSettings(max_payload_bytes=32 << 20, max_line_bytes=33 << 20).validate()
    with pytest.raises(ConfigurationError, match="at most 33554432"):
        MainSettings(max_payload_bytes=(32 << 20) + 1, max_line_bytes=40 << 20).validate()


def test_cli_flags_set_the_payload_limit_and_a_line_limit_that_fits_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = cli.main_parser().parse_args([])
    assert args.max_payload_bytes == 16 << 20 and args.max_line_bytes is None
    args = cli.main_parser().parse_args(["--max-payload-bytes", str(8 << 20)])
    assert args.max_payload_bytes == 8 << 20
    monkeypatch.setenv("BROKER_MAX_PAYLOAD_BYTES", "4096")
    assert cli.main_parser().parse_args([]).max_payload_bytes == 4096
    assert "BROKER_MAX_PAYLOAD_BYTES" in cli.main_parser().format_help()


async def test_broker_main_applies_the_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[Main] = []
    args = cli.main_parser().parse_args(
        [
            *("--database-url", "memory://", "--port", "0"),
            *("--max-payload-bytes", str(3 << 20), "--offload-threshold", "1000"),
        ]
    )
    monkeypatch.setattr(Main, "start", lambda self: _record(started, self))
    with pytest.raises(_Stop):
        await cli.run_main(args)
    [main] = started
    assert main.settings.max_payload_bytes == 3 << 20
    assert main.settings.max_line_bytes == 8 << 20, "3 MiB payload, 4 MiB checkpoint, 1 MiB"
    assert isinstance(main.store, SupportsOffload) and main.store.offload_threshold == 1000
    default = cli.main_parser().parse_args([])
    assert default.offload_threshold == DEFAULT_OFFLOAD_BYTES == 64 << 10


class _Stop(Exception):
    pass


async def _record(started: list[Main], main: Main) -> None:
    started.append(main)
    raise _Stop


# ------------------------------------------------------------------ enqueue through the main


async def test_an_oversized_job_refuses_its_whole_batch_and_writes_nothing() -> None:
    store = MemoryAdapter()
    async with _main(store) as main, Client("127.0.0.1", main.port) as client:
        ok = JobSpec(task="t", args=["fine"])
        big = JobSpec(task="t", kwargs={"blob": "x" * 1500})
        with pytest.raises(InvalidJobError) as raised:
            await client.enqueue_many([ok, big])
        message = str(raised.value)
        assert str(big.id) in message
        assert "bytes as JSON" in message and f"payload limit of {LIMIT} bytes" in message
        assert (await store.list_jobs()).jobs == [], "nothing of the batch was stored"
        # The connection is still good, and a job within the limit goes in.
        assert not (await client.enqueue("t", ["y" * 900])).duplicate
        assert len((await store.list_jobs()).jobs) == 1


async def test_the_wire_answer_is_request_error_payload_too_large() -> None:
    store = MemoryAdapter()
    async with _main(store) as main:
        peer = _RawClient(main.port)
        await peer.connect()
        request = protocol.JobRequest(task="t", args=["x" * 5000])
        await peer.send(protocol.Enqueue(request_id="big", jobs=[request]))
        reply = await peer.reply()
        assert isinstance(reply, protocol.RequestError)
        assert reply.request_id == "big" and reply.code == protocol.ErrorCode.PAYLOAD_TOO_LARGE
        assert "5006 bytes" in reply.message and str(LIMIT) in reply.message
        await peer.close()
    assert (await store.list_jobs()).jobs == []


async def test_an_absurd_task_name_cannot_make_an_unsendable_job_message() -> None:
    """Names are at most 1024 bytes, so a job message always fits in a line."""
    store = MemoryAdapter()
    async with _main(store) as main, Client("127.0.0.1", main.port) as client:
        with pytest.raises(InvalidJobError, match="task must be at most 1024 bytes"):
            await client.enqueue("t" * (LIMIT + LINE_HEADROOM_BYTES - 1900), ["x" * 900])
    assert (await store.list_jobs()).jobs == []


async def test_the_client_refuses_a_request_longer_than_the_mains_line_limit() -> None:
    store = MemoryAdapter()
    async with _main(store) as main, Client("127.0.0.1", main.port) as client:
        with pytest.raises(PayloadTooLargeError, match="line limit"):
            await client.enqueue("t", ["x" * (LIMIT + LINE_HEADROOM_BYTES)])
        assert not (await client.enqueue("t")).duplicate, "the connection was not closed"


async def test_the_client_reads_replies_larger_than_one_mib() -> None:
    store = MemoryAdapter()
    settings = MainSettings(port=0)  # the defaults: 16 MiB payload, 21 MiB lines
    async with _main(store, settings) as main, Client("127.0.0.1", main.port) as client:
        blob = "x" * ((1 << 20) - 100)
        made = await client.enqueue("t", [blob])
        job = await client.get_job(made.job_id)
        assert job is not None and job["args"] == [blob]


# ------------------------------------------------------------------ results


async def test_an_oversized_result_fails_the_job_without_retry_and_stores_nothing() -> None:
    store = MemoryAdapter()
    async with _main(store) as main:
        worker = FakeWorker(main.port)
        await worker.connect()
        [result] = await store.enqueue_many([JobSpec(task="t", max_attempts=5)])
        await worker.ready(pooled=1)
        sent = await worker.next_job()
        report = protocol.CompletedReport(
            job_id=sent.job_id, handoff_id=sent.handoff_id, result={"blob": "x" * 3000}
        )
        await worker.send(report)
        ack = await asyncio.wait_for(worker.acks.get(), 5)
        assert ack.status is protocol.AckStatus.APPLIED
        job = await store.get_job(result.job.id)
        assert job is not None
        assert job.status is JobStatus.FAILED, "dead at once: the same run gives the same result"
        assert job.result is None and job.attempts == 1
        assert job.last_error is not None
        assert "3011 bytes" in job.last_error and f"limit of {LIMIT} bytes" in job.last_error
        await worker.send(report)  # a repeat: the settled lease is this connection's no more
        again = await asyncio.wait_for(worker.acks.get(), 5)
        assert again.status is protocol.AckStatus.STALE
        assert await store.get_job(result.job.id) == job, "the repeat changed nothing"
        await worker.close()


async def test_a_result_within_the_limit_is_stored() -> None:
    store = MemoryAdapter()
    async with _main(store) as main:
        worker = FakeWorker(main.port)
        await worker.connect()
        [result] = await store.enqueue_many([JobSpec(task="t")])
        await worker.ready(pooled=1)
        sent = await worker.next_job()
        await worker.complete(sent, result="y" * 900)
        job = await until(lambda: _terminal(store, result.job.id))
        assert job.status is JobStatus.COMPLETED and job.result == "y" * 900
        await worker.close()


async def _terminal(store: MemoryAdapter, job_id: uuid.UUID) -> Any:
    job = await store.get_job(job_id)
    return job if job is not None and job.status.is_terminal else None


async def test_a_real_worker_gets_both_result_paths_failed(tmp_path: Path) -> None:
    """Over the payload limit, whether or not it would fit in a line, the worker replaces
    its own report with a failure (it learns the limit from ``welcome``; the main checks
    again, see above). Either way no result is stored."""
    registry = TaskRegistry()

    @task(name="sized", registry=registry, mode="inline")
    async def sized(n: int) -> str:
        return "z" * n

    store = SQLAlchemyAdapter(f"sqlite+aiosqlite:///{tmp_path / 'payload.db'}")
    async with _main(store) as main:
        worker = Worker(
            "127.0.0.1",
            main.port,
            worker_id="w-payload",
            runners={ExecutionMode.INLINE: InlineRunner(registry, concurrency=2)},
            registry=registry,
        )
        run = asyncio.create_task(worker.run())
        try:
            specs = [
                JobSpec(task="sized", args=[n], execution_mode=ExecutionMode.INLINE)
                for n in (500, 5000, 2 * SMALL.max_line_bytes)
            ]
            await store.enqueue_many(specs)
            main.wake()
            done = [await until(lambda s=s: _terminal(store, s.id), 10) for s in specs]
        finally:
            worker.request_stop()
            await asyncio.wait_for(run, 10)
    fits, over_payload, over_line = done
    assert fits.status is JobStatus.COMPLETED and fits.result == "z" * 500
    for job in (over_payload, over_line):
        assert job.status is JobStatus.FAILED and job.result is None
        assert job.attempts == 1 and job.max_attempts > 1, "failed without retry"
    assert "payload limit" in (over_payload.last_error or "")
    assert "payload limit" in (over_line.last_error or "")


# ------------------------------------------------------------------ in the app's transaction


async def test_enqueue_in_transaction_refuses_oversized_jobs_and_inserts_none(
    tmp_path: Path,
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'app.db'}"
    store = SQLAlchemyAdapter(url, max_payload_bytes=LIMIT)
    await store.setup()
    app = create_async_engine(url)
    try:
        async with app.begin() as conn:
            await conn.execute(sa.text("CREATE TABLE orders (id INTEGER PRIMARY KEY)"))
        ok, big = JobSpec(task="ship", args=[1]), JobSpec(task="ship", args=["x" * 2000])
        with pytest.raises(PayloadTooLargeError, match="2006 bytes"):
            async with app.begin() as conn:
                await conn.execute(sa.text("INSERT INTO orders (id) VALUES (1)"))
                await store.enqueue_in_transaction(conn, [ok, big])
        assert (await store.list_jobs()).jobs == []
        async with app.connect() as conn:
            orders = (await conn.execute(sa.text("SELECT COUNT(*) FROM orders"))).scalar()
        assert orders == 0, "the application's transaction rolled back with it"
        default = SQLAlchemyAdapter(url)
        async with app.begin() as conn:
            [made] = await default.enqueue_in_transaction(conn, [big])  # 16 MiB by default
        assert not made.duplicate
        await default.close()
        unlimited = SQLAlchemyAdapter(url, max_payload_bytes=None)
        async with app.begin() as conn:
            await unlimited.enqueue_in_transaction(conn, [JobSpec(task="ship", args=["y" * 5000])])
        await unlimited.close()
        with pytest.raises(ConfigurationError):
            SQLAlchemyAdapter(url, max_payload_bytes=0)
    finally:
        await app.dispose()
        await store.close()


# ------------------------------------------------------------------ helpers


class _RawClient:
    """A client connection that shows the main's raw replies."""

    def __init__(self, port: int) -> None:
        self.port = port

    async def connect(self) -> None:
        from broker.wire import framing as wire

        reader, writer = await asyncio.open_connection(
            "127.0.0.1", self.port, limit=wire.STREAM_LIMIT + 2
        )
        self.lines = wire.LineReader(reader, max_line_bytes=wire.MAX_LINE_BYTES)
        self.writer = wire.MessageWriter(writer)
        assert isinstance(await wire.read_message(self.lines), protocol.Challenge)
        await self.send(
            protocol.Hello(role=protocol.Role.CLIENT, protocol=protocol.PROTOCOL_VERSION)
        )
        assert isinstance(await wire.read_message(self.lines), protocol.Welcome)

    async def send(self, msg: protocol.Message) -> None:
        await self.writer.send(msg)

    async def reply(self) -> protocol.Message:
        from broker.wire import framing as wire

        while True:
            msg = await asyncio.wait_for(wire.read_message(self.lines), 5)
            assert msg is not None
            if not isinstance(msg, protocol.Ping):
                return msg

    async def close(self) -> None:
        await self.writer.close()
