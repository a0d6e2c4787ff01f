"""Hand-off at enqueue: when a worker has a free slot and no job is waiting, a new job is
written already handed off, in the enqueue's own transaction, under a lease minted before
the insert, and sent right after the commit, with no dispatch pass between. Over real TCP
on the memory store, SQLite and PostgreSQL; the core's rules for when it may happen are
unit-tested below."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from adapters.memory import MemoryAdapter
from adapters.sql import SQLAlchemyAdapter
from broker.client.client import Client
from broker.core.handoff import Handoff
from broker.exceptions import BrokerError
from broker.jobs import ExecutionMode, JobSpec, JobStatus
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


# ---------------------------------------------------------------------- the core's rules


def _worker_joins(
    core: Handoff, peer_id: int, worker_id: str, slots: int, queues: list[str] | None = None
) -> None:
    """A worker connects, says hello (pooled and forked, serving ``queues``) and offers
    ``slots`` pooled slots."""
    core.hello(
        core.new_peer(peer_id, 0.0),
        protocol.Hello(
            role=protocol.Role.WORKER,
            protocol=protocol.PROTOCOL_VERSION,
            worker_id=worker_id,
            modes=[POOLED, ExecutionMode.FORKED],
            queues=queues,
        ),
    )
    core.ready(peer_id, {POOLED: slots}, seen=0)


def _core_with_idle_worker(slots: int = 2) -> Handoff:
    core = Handoff()
    _worker_joins(core, 1, "w", slots)
    return core


NOW = datetime(2030, 1, 1, tzinfo=UTC)


def test_only_a_drained_mode_takes_jobs_at_enqueue() -> None:
    core = _core_with_idle_worker()
    spec = JobSpec(task="t")
    assert core.plan_at_enqueue([spec], NOW) == [None]  # nothing read yet
    started = core.queue_changes
    core.read_eligible(started, [POOLED], full=True, queues=None)  # more may wait
    assert core.plan_at_enqueue([spec], NOW) == [None]
    core.read_eligible(started, [POOLED], full=False, queues=None)
    [planned] = core.plan_at_enqueue([spec], NOW)
    assert planned is not None and planned.job.id == spec.id and planned.worker_id == "w"
    assert core.credit(POOLED) == 1  # reserved before the insert


def test_a_change_during_the_read_means_nothing_is_known_drained() -> None:
    core = _core_with_idle_worker()
    started = core.queue_changes
    core.queue_changed()  # say a lease came back while the read was out
    core.read_eligible(started, [POOLED], full=False, queues=None)
    assert core.plan_at_enqueue([JobSpec(task="t")], NOW) == [None]


def test_a_drained_proof_holds_only_for_the_queues_its_reads_covered() -> None:
    """A read while the only worker serving every queue was paused covered queue ``a``
    alone: once that worker is dispatchable again, a pooled job in queue ``b`` may be
    waiting for it, so an enqueue must not take its slot at once (found by the handoff
    state machine's long profile)."""
    core = _core_with_idle_worker()
    _worker_joins(core, 2, "w-a", 1, queues=["a"])
    wide = core.peers[1].liveness
    wide.paused_since = 0.0  # over its outbox cap: not dispatchable
    assert core.served_queues() == {"a"}
    core.read_eligible(core.queue_changes, [POOLED], full=False, queues=core.served_queues())
    assert core.plan_at_enqueue([JobSpec(task="t", queue="a")], NOW) != [None]
    wide.paused_since = None
    assert core.plan_at_enqueue([JobSpec(task="t", queue="a")], NOW) == [None]
    core.read_eligible(core.queue_changes, [POOLED], full=False, queues=core.served_queues())
    assert core.plan_at_enqueue([JobSpec(task="t", queue="b")], NOW) != [None]


def test_jobs_not_due_with_a_concurrency_key_or_without_a_free_slot_wait() -> None:
    core = _core_with_idle_worker(slots=1)
    core.read_eligible(core.queue_changes, [POOLED, ExecutionMode.FORKED], full=False, queues=None)
    later = JobSpec(task="t", run_at=NOW + timedelta(seconds=5))
    keyed = JobSpec(task="t", concurrency_key="k", concurrency_limit=1)
    forked = JobSpec(task="t", execution_mode=ExecutionMode.FORKED)  # no forked slot
    first, second = JobSpec(task="t"), JobSpec(task="t")
    plans = core.plan_at_enqueue([later, keyed, forked, first, second], NOW)
    assert [p is not None for p in plans] == [False, False, False, True, False]
    assert plans[3] is not None and plans[3].job.id == first.id
    assert isinstance(plans[3].lease, uuid.UUID)
