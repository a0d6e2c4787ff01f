"""Poison isolation: no report, claim or name the store cannot take stops the others.

Issue 15, findings 1 and 7: one report that could not be stored made the main retry
the same batch forever, so no outcome from any worker was recorded again; a worker
named ``"evil\\u0000"`` made every claim fail on PostgreSQL. Each test runs a real
main over real TCP on a real store (SQLite files; PostgreSQL where the trigger is
PostgreSQL's).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import pytest

from adapters.sql import SQLAlchemyAdapter
from broker.client.client import Client
from broker.exceptions import BrokerError, InvalidJobError, ProtocolError
from broker.jobs import (
    Claim,
    ExecutionMode,
    Job,
    JobSpec,
    JobStatus,
    Outcome,
    Settlement,
    utcnow,
)
from broker.main.main import Main
from broker.model.bounds import MAX_DELAY_SECONDS, MAX_NAME_BYTES
from broker.model.values import EARLIEST_RUN_AT, LATEST_RUN_AT, storable_text
from broker.storage import StorageAdapter
from broker.tasks.registry import TaskRegistry, task
from broker.tasks.runner import Reschedule
from broker.testing.faults import FaultyAdapter
from broker.wire import codec
from broker.wire import messages as protocol
from broker.worker.worker import Worker
from runners.inline import InlineRunner
from tests.conftest import POSTGRES_URL
from tests.fake_main import FakeMain, job, make_worker, running
from tests.integration.test_main import _start
from tests.support import FAST, FakeWorker, until

APPLIED = protocol.AckStatus.APPLIED


def _sql_store(request: pytest.FixtureRequest, kind: str, tmp_path: Path) -> SQLAlchemyAdapter:
    if kind == "sqlite":
        return SQLAlchemyAdapter(f"sqlite+aiosqlite:///{tmp_path / 'poison.db'}")
    return SQLAlchemyAdapter(POSTGRES_URL, schema=request.getfixturevalue("pg_schema"))


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> StorageAdapter:
    return _sql_store(request, request.param, tmp_path)


@pytest.fixture
def postgres(request: pytest.FixtureRequest, tmp_path: Path) -> StorageAdapter:
    return _sql_store(request, "postgres", tmp_path)


@pytest.fixture
def sqlite(request: pytest.FixtureRequest, tmp_path: Path) -> StorageAdapter:
    return _sql_store(request, "sqlite", tmp_path)


@contextlib.asynccontextmanager
async def _main(store: StorageAdapter | FaultyAdapter, **overrides: Any) -> AsyncIterator[Main]:
    main = await _start(store, **overrides)
    try:
        yield main
    finally:
        await main.stop()


class RawWorker(FakeWorker):
    """A fake worker that can also send lines no well-behaved peer would build."""

    async def send_raw(self, *bodies: dict[str, Any]) -> None:
        """All ``bodies`` in one write, so the main reads them in one go (one report batch)."""
        assert self._writer is not None
        await self._writer.write_raw(b"".join(json.dumps(b).encode() + b"\n" for b in bodies))


async def _worker_with_jobs(
    main: Main, store: StorageAdapter, n: int, **spec: Any
) -> tuple[RawWorker, list[protocol.JobHandoff]]:
    worker = RawWorker(main.port)
    await worker.connect()
    await store.enqueue_many([JobSpec(task="t", args=[i], **spec) for i in range(n)])
    await worker.ready(pooled=n)
    jobs = [await worker.next_job() for _ in range(n)]
    return worker, sorted(jobs, key=lambda job: job.args[0])


def _completed(job: protocol.JobHandoff, result: Any = None) -> dict[str, Any]:
    return {
        "type": "completed",
        "job_id": str(job.job_id),
        "handoff_id": str(job.handoff_id),
        "result": result,
    }


async def _acks(worker: FakeWorker, n: int, timeout: float = 5.0) -> dict[uuid.UUID, Any]:
    """The next ``n`` acks by job id; the timeout is the issue's "within a second" plus
    slack for a loaded machine."""
    acks = [await asyncio.wait_for(worker.acks.get(), timeout) for _ in range(n)]
    return {ack.job_id: ack.status for ack in acks}


async def _job(store: StorageAdapter, job_id: uuid.UUID) -> Job:
    job = await store.get_job(job_id)
    assert job is not None
    return job


# ------------------------------------------------------------------ reports


async def test_a_reschedule_no_store_can_hold_is_refused_and_later_reports_apply(
    store: StorageAdapter,
) -> None:
    async with _main(store) as main:
        worker, jobs = await _worker_with_jobs(main, store, 3)
        bad = {"type": "reschedule", "job_id": str(jobs[0].job_id)}
        await worker.send_raw(
            {**bad, "handoff_id": str(jobs[0].handoff_id), "delay": 1e300},
            {**bad, "handoff_id": str(uuid.uuid4()), "delay": 1e300},  # no valid lease at all
            _completed(jobs[1]),
            _completed(jobs[2]),
        )
        assert await _acks(worker, 2) == {jobs[1].job_id: APPLIED, jobs[2].job_id: APPLIED}
        for job in jobs[1:]:
            assert (await _job(store, job.job_id)).status is JobStatus.COMPLETED
        await until(lambda: len(worker.errors) == 2)
        assert all(
            "delay must be a number of seconds from 0 to" in e.message for e in worker.errors
        )
        assert not any(e.fatal for e in worker.errors)
        # The bad report changed nothing, and the connection still works for that job.
        assert (await _job(store, jobs[0].job_id)).status is JobStatus.HANDED_OFF
        assert (await worker.complete(jobs[0])).status is APPLIED
        await worker.close()


async def test_a_settlement_that_cannot_be_computed_fails_only_its_job(
    sqlite: StorageAdapter,
) -> None:
    """A real poison past the decoder: the main's clock so late that ``now + delay`` is out
    of ``datetime``'s range (the ``Reschedule(1e12)`` failure, reproduced within limits)."""
    late = asyncio.Event()

    def clock() -> datetime:
        return datetime(9999, 12, 30, tzinfo=UTC) if late.is_set() else utcnow()

    main = Main(sqlite, FAST, clock=clock, retry_delay_fn=lambda n: timedelta(0))
    await main.start()
    try:
        worker, jobs = await _worker_with_jobs(main, sqlite, 3)
        late.set()
        await worker.send_raw(
            _completed(jobs[0], "ok"),
            {
                "type": "reschedule",
                "job_id": str(jobs[1].job_id),
                "handoff_id": str(jobs[1].handoff_id),
                "delay": 86400.0 * 30,
            },
            _completed(jobs[2], "ok"),
        )
        assert await _acks(worker, 3) == {job.job_id: APPLIED for job in jobs}
        poisoned = await _job(sqlite, jobs[1].job_id)
        assert poisoned.status is JobStatus.FAILED
        assert poisoned.last_error is not None
        assert poisoned.last_error.startswith("report could not be stored")
        assert "OverflowError" in poisoned.last_error
        for job in (jobs[0], jobs[2]):
            assert (await _job(sqlite, job.job_id)).result == "ok"
        await worker.close()
    finally:
        await main.stop()


async def test_an_error_text_with_nul_and_a_lone_surrogate_is_stored_escaped(
    store: StorageAdapter,
) -> None:
    """NUL fails on PostgreSQL, a lone surrogate on both stores; before the fix either one
    stopped every later report."""
    async with _main(store) as main:
        worker, jobs = await _worker_with_jobs(main, store, 3)
        error = "ValueError: bad\x00byte \ud800 here"
        await worker.send(
            protocol.FailedReport(jobs[0].job_id, jobs[0].handoff_id, error=error, retry=False)
        )
        await worker.send(protocol.CompletedReport(jobs[1].job_id, jobs[1].handoff_id, result=1))
        await worker.send(protocol.CompletedReport(jobs[2].job_id, jobs[2].handoff_id, result=2))
        assert await _acks(worker, 3) == {job.job_id: APPLIED for job in jobs}
        failed = await _job(store, jobs[0].job_id)
        assert failed.status is JobStatus.FAILED
        assert failed.last_error == "ValueError: bad\\x00byte \\ud800 here"
        assert [(await _job(store, j.job_id)).result for j in jobs[1:]] == [1, 2]
        await worker.close()


async def test_nul_in_arguments_and_results_round_trips_on_postgresql(
    postgres: StorageAdapter,
) -> None:
    """Arguments and results are stored as escaped JSON text, never JSONB, so a NUL inside
    them is data like any other: it needs no refusal, on any store."""
    async with _main(postgres) as main:
        async with Client("127.0.0.1", main.port) as client:
            ref = await client.enqueue("t", ["a\x00b"], {"k\x00": "\x00"})
        worker = FakeWorker(main.port)
        await worker.connect()
        await worker.ready(pooled=1)
        job = await worker.next_job()
        assert (job.args, job.kwargs) == (["a\x00b"], {"k\x00": "\x00"})
        assert (await worker.complete(job, {"out": "\x00"})).status is APPLIED
        assert (await _job(postgres, ref.job_id)).result == {"out": "\x00"}
        await worker.close()


def _settle_calls(faulty: FaultyAdapter) -> list[Sequence[Settlement]]:
    return [
        cast(Sequence[Settlement], args) for name, args in faulty.calls if name == "settle_many"
    ]


async def test_a_result_the_store_refuses_fails_that_job_and_the_batch_is_split(
    sqlite: StorageAdapter,
) -> None:
    faulty = FaultyAdapter(sqlite)
    async with _main(faulty) as main:
        worker, jobs = await _worker_with_jobs(main, sqlite, 4)
        bad = jobs[2].job_id
        faulty.rejects_settlement = lambda s: s.job_id == bad and s.outcome is Outcome.COMPLETE
        await worker.send_raw(*(_completed(job, job.args[0]) for job in jobs))
        assert await _acks(worker, 4) == {job.job_id: APPLIED for job in jobs}
        poisoned = await _job(sqlite, bad)
        assert poisoned.status is JobStatus.FAILED
        assert poisoned.last_error is not None
        assert poisoned.last_error.startswith("report could not be stored: the worker's completed")
        assert "InjectedRejection" in poisoned.last_error
        for job in jobs:
            if job.job_id != bad:
                assert (await _job(sqlite, job.job_id)).result == job.args[0]
        sizes = [len(call) for call in _settle_calls(faulty)]
        assert sizes[0] == 4, "the four reports were read as one batch"
        assert 2 in sizes and sizes.count(1) >= 2, f"the batch was split, not retried: {sizes}"
        await worker.close()


async def test_a_report_whose_failure_cannot_be_stored_either_is_refused(
    sqlite: StorageAdapter,
) -> None:
    faulty = FaultyAdapter(sqlite)
    async with _main(faulty) as main:
        worker, jobs = await _worker_with_jobs(main, sqlite, 3)
        bad = jobs[0].job_id
        faulty.rejects_settlement = lambda s: s.job_id == bad and s.outcome is not Outcome.LOST
        await worker.send_raw(*(_completed(job) for job in jobs))
        statuses = await _acks(worker, 3)
        assert statuses == {
            bad: protocol.AckStatus.REFUSED,
            jobs[1].job_id: APPLIED,
            jobs[2].job_id: APPLIED,
        }
        # The main took the lease back: a recovery (no attempt counted), and the job runs
        # again at once.
        await until(lambda: _is_queued(sqlite, bad))
        assert (await _job(sqlite, bad)).attempts == 0
        assert (await _job(sqlite, bad)).recoveries == 1
        await until(lambda: len(main.leader.ledger) == 0)
        await worker.close()


async def _is_queued(store: StorageAdapter, job_id: uuid.UUID) -> bool:
    return (await _job(store, job_id)).status is JobStatus.QUEUED


async def test_a_transient_store_error_is_retried_without_splitting(
    sqlite: StorageAdapter,
) -> None:
    faulty = FaultyAdapter(sqlite)
    async with _main(faulty) as main:
        worker, jobs = await _worker_with_jobs(main, sqlite, 3)
        faulty.settle_failures = 2
        await worker.send_raw(*(_completed(job, "done") for job in jobs))
        assert await _acks(worker, 3) == {job.job_id: APPLIED for job in jobs}
        assert [len(call) for call in _settle_calls(faulty)] == [3, 3, 3]
        for job in jobs:
            assert (await _job(sqlite, job.job_id)).result == "done"
        await worker.close()


# ------------------------------------------------------------------ claims


async def test_a_claim_the_store_refuses_never_holds_back_the_other_jobs(
    sqlite: StorageAdapter,
) -> None:
    faulty = FaultyAdapter(sqlite)
    async with _main(faulty) as main:
        results = await sqlite.enqueue_many([JobSpec(task="t", args=[i]) for i in range(4)])
        bad = results[1].job.id
        faulty.rejects_claim = lambda claim: claim.job_id == bad
        worker = FakeWorker(main.port)
        await worker.connect()
        await worker.ready(pooled=4)
        sent = {(await worker.next_job()).job_id for _ in range(3)}
        assert sent == {r.job.id for r in results} - {bad}
        assert (await _job(sqlite, bad)).status is JobStatus.QUEUED
        claims = [
            cast(Sequence[Claim], args)
            for name, args in faulty.calls
            if name == "mark_handed_off_many"
        ]
        assert len(claims[0]) == 4 and any(len(c) == 1 and c[0].job_id == bad for c in claims)
        # Every lease of a failed claim went to the ledger, which settles them (no-ops).
        faulty.rejects_claim = lambda claim: False
        await until(lambda: len(main.leader.ledger) == 0)
        await worker.close()


async def test_a_worker_id_with_nul_is_refused_at_hello_and_others_are_served(
    store: StorageAdapter,
) -> None:
    async with _main(store) as main:
        evil = FakeWorker(main.port, worker_id="evil\x00")
        with pytest.raises(ConnectionRefusedError, match=r"hello\.worker_id must not contain"):
            await evil.connect()
        good = FakeWorker(main.port)
        await good.connect()
        [result] = await store.enqueue_many([JobSpec(task="t")])
        await good.ready(pooled=1)
        assert (await good.next_job()).job_id == result.job.id
        await evil.close()
        await good.close()


async def test_indexed_names_too_long_for_an_index_entry_are_refused(
    sqlite: StorageAdapter,
) -> None:
    """A worker id or key over the limit would fail every claim that carries it (an index
    entry on PostgreSQL holds about 2.7 KB)."""
    long = "k" * (MAX_NAME_BYTES + 1)
    async with _main(sqlite) as main, Client("127.0.0.1", main.port) as client:
        refused = FakeWorker(main.port, worker_id=long)
        with pytest.raises(ConnectionRefusedError, match="worker_id must be at most 1024 bytes"):
            await refused.connect()
        await refused.close()
        for key in ({"idempotency_key": long}, {"concurrency_key": long, "concurrency_limit": 1}):
            # Refused by the decoder (every name is bounded there), so ``malformed``.
            with pytest.raises(ProtocolError, match="must be at most 1024 bytes"):
                await client.enqueue_requests([protocol.JobRequest(task="t", **key)])
        assert await sqlite.count_jobs() == []


@pytest.mark.parametrize(
    "job",
    [
        {"task": "evil\ninjected log line"},
        {"task": "t", "queue": "\x1b[2Jcleared"},
        {"task": "t", "idempotency_key": "k\x00"},
        {"task": "t", "unique_key": "\ud800"},
        {"task": "t", "concurrency_key": "\u2028", "concurrency_limit": 1},
    ],
    ids=["newline", "ansi", "nul", "surrogate", "separator"],
)
async def test_hostile_names_are_refused_at_enqueue(
    sqlite: StorageAdapter, job: dict[str, Any]
) -> None:
    async with _main(sqlite) as main, Client("127.0.0.1", main.port) as client:
        with pytest.raises(BrokerError, match="must not contain control characters"):
            await client.enqueue_requests([protocol.JobRequest(**job)])
        with pytest.raises(InvalidJobError, match="must not contain control characters"):
            JobSpec(**job)
        assert await sqlite.count_jobs() == []


@pytest.mark.parametrize(
    ("request_", "fragment"),
    [
        (protocol.JobRequest(task="t", delay=1e300), "ten years"),
        (protocol.JobRequest(task="t", delay=MAX_DELAY_SECONDS + 1), "ten years"),
        (protocol.JobRequest(task="t", run_at="9999-12-31T23:59:59-14:00"), "between"),
        (protocol.JobRequest(task="t", run_at="0001-01-01T00:00:00+14:00"), "between"),
    ],
)
def test_delays_and_run_times_out_of_range_are_refused(
    request_: protocol.JobRequest, fragment: str
) -> None:
    with pytest.raises(InvalidJobError, match=fragment):
        request_.to_spec(datetime.now(UTC))


def test_storable_text_escapes_and_caps() -> None:
    assert storable_text("plain é") == "plain é"
    assert storable_text("a\x00b\udc80") == "a\\x00b\\udc80"
    capped = storable_text("x" * 100, limit=10)
    assert capped == "x" * 10 + " [... 90 more characters cut]"


# ------------------------------------------------------------------ the task side


@pytest.mark.parametrize("delay", [1e12, math.inf, math.nan, -1, True, "60"])
def test_reschedule_checks_its_delay_when_raised(delay: Any) -> None:
    with pytest.raises(ValueError, match="Reschedule delay must be a number of seconds"):
        Reschedule(delay)
    assert Reschedule(MAX_DELAY_SECONDS).delay == MAX_DELAY_SECONDS


async def test_a_worker_forgets_a_refused_report_and_survives_an_ack_it_cannot_read() -> None:
    registry = TaskRegistry()

    @task(name="add", registry=registry, mode="inline")
    async def add(a: int, b: int) -> int:
        return a + b

    async with FakeMain() as main:
        worker = make_worker(main, registry)
        async with running(worker):
            session = await main.session()
            await session.send(job(1, "add", 1, 2))
            report = await session.expect(protocol.CompletedReport)
            ids = {"job_id": str(report.job_id), "handoff_id": str(report.handoff_id)}
            future = {"type": "report_ack", **ids, "status": "from-a-newer-main"}
            await session.writer.write_raw(json.dumps(future).encode() + b"\n")
            await session.send(
                protocol.ReportAck(report.job_id, report.handoff_id, protocol.AckStatus.REFUSED)
            )
            await until(lambda: worker.status()["outbox"] == 0)
            assert not session.closed.is_set(), "the connection (and its leases) was kept"
            assert main.sessions.empty(), "no reconnect"


async def test_a_task_raising_reschedule_1e12_fails_and_others_are_recorded(
    sqlite: StorageAdapter,
) -> None:
    registry = TaskRegistry()

    @task(name="forever", registry=registry, mode="inline")
    async def forever() -> None:
        raise Reschedule(1e12)

    @task(name="double", registry=registry, mode="inline")
    async def double(n: int) -> int:
        return 2 * n

    async with _main(sqlite) as main:
        specs = [JobSpec(task="forever", max_attempts=1, execution_mode=ExecutionMode.INLINE)]
        specs += [JobSpec(task="double", args=[i], execution_mode="inline") for i in range(3)]
        jobs = [r.job for r in await sqlite.enqueue_many(specs)]
        worker = Worker(
            "127.0.0.1",
            main.port,
            worker_id="w",
            runners={ExecutionMode.INLINE: InlineRunner(registry, concurrency=4)},
            registry=registry,
        )
        running = asyncio.create_task(worker.run())
        try:

            async def all_terminal() -> bool:
                return all([(await _job(sqlite, j.id)).status.is_terminal for j in jobs])

            await until(all_terminal, timeout=10)
            forever_job = await _job(sqlite, jobs[0].id)
            assert forever_job.status is JobStatus.FAILED
            assert forever_job.last_error is not None and "ten years" in forever_job.last_error
            assert [(await _job(sqlite, j.id)).result for j in jobs[1:]] == [0, 2, 4]
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)


def test_a_refused_ack_decodes() -> None:
    line = codec.encode(protocol.ReportAck(uuid.uuid4(), uuid.uuid4(), protocol.AckStatus.REFUSED))
    assert b'"status":"refused"' in line
    decoded = codec.decode(line)
    assert isinstance(decoded, protocol.ReportAck)
    assert decoded.status is protocol.AckStatus.REFUSED


def test_datetime_math_is_safe_at_both_ends_of_the_range() -> None:
    """The range leaves room for a delay, a retry backoff and any UTC offset."""
    late = LATEST_RUN_AT - timedelta(microseconds=1)
    assert late + timedelta(seconds=MAX_DELAY_SECONDS) > late
    assert JobSpec(task="t", run_at=late).run_at == late
    assert JobSpec(task="t", run_at=EARLIEST_RUN_AT).run_at == EARLIEST_RUN_AT
