"""Hand-off at enqueue: when a worker has a free slot and no job is waiting, a new job is
written already handed off, in the enqueue's own transaction, under a lease minted before
the insert, and sent right after the commit, with no dispatch pass between. Over real TCP
on the memory store, SQLite and PostgreSQL; the core's rules for when it may happen are
unit-tested in tests/unit/test_drained.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from adapters.memory import MemoryAdapter
from adapters.sql import SQLAlchemyAdapter
from broker.client.client import Client
from broker.exceptions import BrokerError
from broker.jobs import ExecutionMode, JobStatus
from broker.storage import StorageAdapter
from broker.testing.faults import ClaimFault, FaultyAdapter
from broker.wire import messages as protocol
from tests.conftest import drop_schema, fresh_schema_name, require_postgres
from tests.support import FakeWorker, running_main, until

POOLED = ExecutionMode.POOLED


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[FaultyAdapter]:
    inner: StorageAdapter
    schema = None
    if request.param == "memory":
        inner = MemoryAdapter()
    elif request.param == "sqlite":
        inner = SQLAlchemyAdapter(f"sqlite+aiosqlite:///{tmp_path / 'handoff.db'}")
    else:
        schema = fresh_schema_name()
        inner = SQLAlchemyAdapter(require_postgres(), schema=schema)
    faulty = FaultyAdapter(inner)
    faulty.enqueue_handoffs = True
    try:
        yield faulty
    finally:
        if schema is not None:
            await drop_schema(schema)


def claims_by_dispatcher(store: FaultyAdapter) -> int:
    return sum(name == "mark_handed_off_many" for name, _ in store.calls)


async def test_a_job_enqueued_for_an_idle_worker_starts_without_a_dispatch_pass(
    store: FaultyAdapter,
) -> None:
    async with running_main(store) as main:
        worker = FakeWorker(main.port)
        await worker.connect()
        await worker.ready(pooled=2)
        await until(lambda: POOLED in main.handoff.drained)
        async with Client(port=main.port) as client:
            enqueued = await client.enqueue("app.t", [1])
            job = await worker.next_job()
            assert job.job_id == enqueued.job_id
            stored = await store.get_job(job.job_id)
            assert stored is not None and stored.status is JobStatus.HANDED_OFF
            assert stored.handoff_id == job.handoff_id and stored.worker_id == "fake-worker"
            assert store.calls[-1] != ("enqueue_handed_off", ())
            assert claims_by_dispatcher(store) == 0  # no pass claimed it
            ack = await worker.complete(job, result=2)
            assert ack.status is protocol.AckStatus.APPLIED
        await worker.close()


async def test_an_unknown_enqueue_outcome_returns_the_lease_and_the_job_runs_once(
    store: FaultyAdapter,
) -> None:
    async with running_main(store) as main:
        worker = FakeWorker(main.port)
        await worker.connect()
        await worker.ready(pooled=1)
        await until(lambda: POOLED in main.handoff.drained)
        store.fail_next_claims(ClaimFault.AFTER_COMMIT)
        async with Client(port=main.port) as client:
            with pytest.raises(BrokerError):
                await client.enqueue("app.t", idempotency_key="once")
            # The insert committed (handed off under a lease nobody was sent): the ledger
            # gives that lease back and the dispatcher hands the job out under a new one.
            job = await worker.next_job()
            returned = [args for name, args in store.calls if name == "return_to_queue"]
            assert returned and returned[0][0] == job.job_id
            assert returned[0][1] != job.handoff_id
            again = await client.enqueue("app.t", idempotency_key="once")
            assert again.duplicate and again.job_id == job.job_id
        assert await worker.no_job_within(0.2)
        await worker.close()
