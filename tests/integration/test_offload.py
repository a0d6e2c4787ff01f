"""Offloaded payloads on the real SQL stores: what the job rows hold, and that nothing is
left behind when an enqueue rolls back, a report is fenced out, a checkpoint is replaced,
or retention prunes."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

import adapters.sql.postgres
import adapters.sql.queries
from adapters.sql import SQLAlchemyAdapter
from broker.jobs import CheckpointSave, Claim, Job, JobSpec, JobStatus, Outcome, Settlement
from broker.main.retention import Retention, prune_once
from broker.testing import FakeClock
from tests.conftest import POSTGRES_URL

START = datetime(2030, 1, 1, tzinfo=UTC)
THRESHOLD = 1000
BIG = "b" * (THRESHOLD + 1)


class Store:
    def __init__(self, url: str, schema: str | None, clock: FakeClock) -> None:
        self.url, self.schema, self.clock = url, schema, clock
        self.adapter = SQLAlchemyAdapter(
            url, schema=schema, clock=clock, offload_threshold=THRESHOLD
        )

    def table(self, name: str) -> str:
        return f'"{self.schema}".{name}' if self.schema else name

    async def scalar(self, sql: str) -> Any:
        async with self.adapter._read("test") as conn:
            return (await conn.execute(sa.text(sql.format(s=self.table)))).scalar()

    async def longest_value_in_rows(self) -> int:
        return int(
            await self.scalar(
                "SELECT max(length(args) + length(kwargs) + coalesce(length(result), 0) "
                "+ coalesce(length(checkpoint), 0)) "
                f"FROM {self.table('broker_jobs')}"
            )
            or 0
        )


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    clock = FakeClock(START)
    if request.param == "sqlite":
        s = Store(f"sqlite+aiosqlite:///{tmp_path / 'offload.db'}", None, clock)
    else:
        s = Store(POSTGRES_URL, request.getfixturevalue("pg_schema"), clock)
    await s.adapter.setup()
    try:
        yield s
    finally:
        await s.adapter.close()


async def _done(store: Store, spec: JobSpec, result: Any, how: Outcome) -> uuid.UUID:
    [made] = await store.adapter.enqueue_many([spec])
    lease = uuid.uuid4()
    [claimed] = await store.adapter.mark_handed_off_many([Claim(made.job.id, lease, "w")])
    assert claimed.args == tuple(spec.args)
    s = Settlement(made.job.id, lease, how, result=result, error="x")
    assert await store.adapter.settle_many([s]) == [True]
    return made.job.id


async def test_the_job_rows_hold_no_large_value(store: Store) -> None:
    small = JobSpec(task="t", args=["s" * (THRESHOLD - 10)])
    ids = [await _done(store, small, "r" * (THRESHOLD - 10), Outcome.COMPLETE)]
    for i in range(3):
        spec = JobSpec(task="t", args=[BIG, i], kwargs={"k": BIG})
        ids.append(await _done(store, spec, {"out": BIG}, Outcome.COMPLETE))
    assert await store.longest_value_in_rows() < 2 * THRESHOLD, "only the small job's values"
    assert await store.adapter.count_payloads() == 9, "args, kwargs and result of 3 jobs"
    jobs = {j.id: j for j in (await store.adapter.list_jobs(limit=10)).jobs}
    assert all(jobs[i].result == {"out": BIG} for i in ids[1:])


async def test_a_rolled_back_enqueue_leaves_no_payload(store: Store) -> None:
    engine = create_async_engine(store.url)
    try:
        with pytest.raises(RuntimeError, match="the application gave up"):
            async with engine.begin() as conn:
                await store.adapter.enqueue_in_transaction(
                    conn, [JobSpec(task="t", args=[BIG]), JobSpec(task="t", kwargs={"k": BIG})]
                )
                raise RuntimeError("the application gave up")
        async with engine.begin() as conn:
            [kept] = await store.adapter.enqueue_in_transaction(
                conn, [JobSpec(task="t", args=[BIG])]
            )
    finally:
        await engine.dispose()
    assert (await store.adapter.list_jobs()).jobs == [kept.job]
    assert await store.adapter.count_payloads() == 1, "only the committed job's"


async def test_a_fenced_out_result_writes_no_payload(store: Store) -> None:
    [made] = await store.adapter.enqueue_many([JobSpec(task="t")])
    old, new = uuid.uuid4(), uuid.uuid4()
    assert await store.adapter.mark_handed_off(made.job.id, old, "w") is not None
    assert await store.adapter.return_to_queue(made.job.id, old)
    assert await store.adapter.mark_handed_off(made.job.id, new, "w") is not None
    stale = Settlement(made.job.id, old, Outcome.COMPLETE, result=BIG)
    fresh = Settlement(made.job.id, new, Outcome.COMPLETE, result=[BIG])
    assert await store.adapter.settle_many([stale]) == [False]
    assert await store.adapter.count_payloads() == 0, "the fence rejected it, payload and all"
    assert await store.adapter.settle_many([fresh, stale]) == [True, False]
    assert (await store.adapter.get_job(made.job.id)).result == [BIG]  # type: ignore[union-attr]
    assert await store.adapter.count_payloads() == 1


async def test_retention_leaves_no_orphaned_payload(store: Store) -> None:
    for how in (Outcome.COMPLETE, Outcome.FAIL):
        await _done(store, JobSpec(task="t", args=[BIG], max_attempts=1), [BIG], how)
    [cancelled] = await store.adapter.enqueue_many([JobSpec(task="t", kwargs={"k": BIG})])
    assert await store.adapter.cancel(cancelled.job.id) is not None
    [queued] = await store.adapter.enqueue_many([JobSpec(task="t", args=[BIG])])
    assert await store.adapter.count_payloads() == 5
    store.clock.advance(timedelta(days=60).total_seconds())
    deleted = await prune_once(store.adapter, Retention(), store.clock)
    assert sum(deleted.values()) == 3
    assert await store.adapter.count_payloads() == 1, "only the queued job's remains"
    orphans = await store.scalar(
        f"SELECT count(*) FROM {store.table('broker_payloads')} p WHERE NOT EXISTS "
        f"(SELECT 1 FROM {store.table('broker_jobs')} j WHERE j.id = p.job_id)"
    )
    assert orphans == 0
    job = await store.adapter.get_job(queued.job.id)
    assert job is not None and job.status is JobStatus.QUEUED and job.args == (BIG,)


async def test_checkpoints_are_offloaded_and_a_replaced_one_leaves_no_payload(
    store: Store,
) -> None:
    [made] = await store.adapter.enqueue_many([JobSpec(task="t", max_attempts=1)])
    job_id, lease, stale = made.job.id, uuid.uuid4(), uuid.uuid4()
    assert await store.adapter.mark_handed_off(job_id, lease, "w") is not None

    async def save(handoff_id: uuid.UUID, seq: int, state: Any) -> bool:
        [saved] = await store.adapter.save_checkpoints(
            [CheckpointSave(job_id, handoff_id, seq, state)]
        )
        return saved

    async def checkpoint_payloads() -> int:
        table = store.table("broker_payloads")
        return int(await store.scalar(f"SELECT count(*) FROM {table} WHERE kind = 'checkpoint'"))

    assert await save(lease, 1, {"big": BIG})
    assert await store.longest_value_in_rows() < 100, "the row holds the mark, not the value"
    assert await checkpoint_payloads() == 1
    assert await save(lease, 2, {"small": 1})
    assert await checkpoint_payloads() == 0, "the replaced checkpoint's payload is deleted"
    assert not await save(stale, 3, {"big": BIG})
    assert await checkpoint_payloads() == 0, "a fenced-out checkpoint writes no payload"
    assert await save(lease, 3, [BIG])
    assert (await store.adapter.get_job(job_id)).checkpoint == [BIG]  # type: ignore[union-attr]
    assert await store.adapter.fail(job_id, lease, "boom", None)
    store.clock.advance(timedelta(days=60).total_seconds())
    assert sum((await prune_once(store.adapter, Retention(), store.clock)).values()) == 1
    assert await store.scalar(f"SELECT count(*) FROM {store.table('broker_payloads')}") == 0


async def test_a_job_read_while_its_checkpoint_is_replaced_comes_back_whole(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read takes a job's row, then its offloaded payloads: a checkpoint replaced by a
    small one in between takes the old payload with it. Each read (``broker job``, the
    listing, a worker's handoffs) returns the job whole, instead of failing with "its
    offloaded checkpoint is missing" (PostgreSQL's reads the job again)."""
    adapter = store.adapter
    [made] = await adapter.enqueue_many([JobSpec(task="t", max_attempts=1)])
    job_id, lease = made.job.id, uuid.uuid4()
    assert await adapter.mark_handed_off(job_id, lease, "w") is not None
    bodies = adapters.sql.queries.sa_bodies
    seq = 0

    async def save(state: Any) -> None:
        nonlocal seq
        seq += 1
        assert await adapter.save_checkpoints([CheckpointSave(job_id, lease, seq, state)])

    async def replaced_in_between(conn: Any, rows: Any) -> Any:
        monkeypatch.setattr(
            adapters.sql.queries, "sa_bodies", bodies
        )  # once: the next read is calm
        await save({"small": seq})
        return await bodies(conn, rows)

    async def listed() -> Job:
        [job] = (await adapter.list_jobs()).jobs
        return job

    async def handed_off() -> Job:
        [job] = await adapter.handoffs_for_worker("w")
        return job

    async def got() -> Job:
        job = await adapter.get_job(job_id)
        assert job is not None
        return job

    for read in (got, listed, handed_off):
        await save({"big": BIG})
        monkeypatch.setattr(adapters.sql.queries, "sa_bodies", replaced_in_between)
        job = await read()
        # Whole, as it stood before the replacement or after: SQLite's read connection
        # reads one snapshot throughout; PostgreSQL's reads again.
        assert job.checkpoint in ({"big": BIG}, {"small": seq - 1}), read.__name__


async def test_an_enqueue_meeting_its_key_holder_mid_checkpoint_returns_the_holder_whole(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An enqueue whose idempotency key a running job holds returns that job; when the
    job's checkpoint is replaced by a small one between the read of its row and of its
    payloads, the enqueue looks again instead of failing with "its offloaded checkpoint
    is missing"."""
    adapter = store.adapter
    [made] = await adapter.enqueue_many([JobSpec(task="t", idempotency_key="k")])
    job_id, lease = made.job.id, uuid.uuid4()
    assert await adapter.mark_handed_off(job_id, lease, "w") is not None
    assert await adapter.save_checkpoints([CheckpointSave(job_id, lease, 1, {"big": BIG})])
    bodies = adapters.sql.postgres.pg_bodies

    async def replaced_in_between(*args: Any) -> Any:
        monkeypatch.setattr(adapters.sql.postgres, "pg_bodies", bodies)  # once
        assert await adapter.save_checkpoints([CheckpointSave(job_id, lease, 2, {"small": 2})])
        return await bodies(*args)

    monkeypatch.setattr(adapters.sql.postgres, "pg_bodies", replaced_in_between)
    [again] = await adapter.enqueue_many([JobSpec(task="t", idempotency_key="k")])
    assert again.duplicate and again.job.id == job_id
    assert again.job.checkpoint in ({"big": BIG}, {"small": 2})
