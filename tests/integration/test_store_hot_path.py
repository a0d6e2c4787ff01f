"""The SQL store's hot path: single-statement claims and settles, and their own pool.

The conformance suite covers the contract; these target what the one-statement path
could get wrong that it does not spell out: a batch mixing keyed, unkeyed, not-due,
repeated and unknown jobs; settles from several processes releasing the same keys in
opposite orders; the error mapping of the raw driver path; and dispatch going on
while every general-pool connection is taken.
"""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from adapters.sql import SQLAlchemyAdapter
from broker.exceptions import ConfigurationError, StorageError, StorageRejectedError
from broker.jobs import Claim, ExecutionMode, Job, JobSpec, JobStatus, Outcome, Settlement
from broker.testing import FakeClock
from tests.conftest import POSTGRES_URL, require_postgres

START = datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)
ALL_MODES = frozenset(ExecutionMode)


@pytest.fixture(params=["sqlite", "postgres"])
async def store_url(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[str, str | None]]:
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'hot.db'}", None
        return
    yield POSTGRES_URL, request.getfixturevalue("pg_schema")


async def _open(url: str, schema: str | None, clock: FakeClock, **kw: int) -> SQLAlchemyAdapter:
    store = SQLAlchemyAdapter(url, clock=clock, schema=schema, **kw)
    await store.setup()
    return store


async def _all_claimed(
    store: SQLAlchemyAdapter, specs: list[JobSpec]
) -> tuple[list[uuid.UUID], list[Job]]:
    """Enqueue ``specs`` and claim them all in one batch: their leases and the jobs."""
    for spec in specs:
        await store.enqueue(spec)
    leases = [uuid.uuid4() for _ in specs]
    claimed = await store.mark_handed_off_many(
        [Claim(spec.id, lease, "w") for spec, lease in zip(specs, leases, strict=True)]
    )
    assert len(claimed) == len(specs)
    return leases, claimed


async def _key_has_room(store: SQLAlchemyAdapter, key: str) -> bool:
    """Whether a new job of ``key`` (limit 1) can be claimed at once: its slot is free."""
    other = (await store.enqueue(JobSpec(task="t", concurrency_key=key, concurrency_limit=1))).job
    return await store.mark_handed_off(other.id, uuid.uuid4(), "w") is not None


async def test_a_batched_claim_mixing_keyed_unkeyed_and_unclaimable_jobs(
    store_url: tuple[str, str | None],
) -> None:
    clock = FakeClock(START)
    store = await _open(*store_url, clock)
    try:
        free = (await store.enqueue(JobSpec(task="t", args=["free"]))).job
        keyed = [
            (await store.enqueue(JobSpec(task="t", concurrency_key="k", concurrency_limit=1))).job
            for _ in range(2)
        ]
        later = (await store.enqueue(JobSpec(task="t", run_at=START + timedelta(hours=1)))).job
        leases = [uuid.uuid4() for _ in range(6)]
        claims = [
            Claim(keyed[1].id, leases[0], "w"),
            Claim(free.id, leases[1], "w"),
            Claim(later.id, leases[2], "w"),
            Claim(keyed[0].id, leases[3], "w"),
            Claim(free.id, leases[4], "w"),  # the same job again: the first claim wins
            Claim(uuid.uuid4(), leases[5], "w"),  # no such job
        ]
        claimed = await store.mark_handed_off_many(claims)
        assert [(j.id, j.handoff_id) for j in claimed] == [
            (keyed[1].id, leases[0]),
            (free.id, leases[1]),
        ], "claim order kept; one slot of key k; never the not-due job"
        for job in claimed:
            stored = await store.get_job(job.id)
            assert stored == job and stored.status is JobStatus.HANDED_OFF
        assert (await store.get_job(keyed[0].id)).status is JobStatus.QUEUED  # type: ignore[union-attr]
        assert (await store.get_job(later.id)).status is JobStatus.QUEUED  # type: ignore[union-attr]
        # The slot is held: the other keyed job stays out until the first one settles.
        assert await store.mark_handed_off(keyed[0].id, uuid.uuid4(), "w") is None
        assert await store.settle_many([Settlement(keyed[1].id, leases[0], Outcome.COMPLETE)]) == [
            True
        ]
        assert await store.mark_handed_off(keyed[0].id, uuid.uuid4(), "w") is not None
    finally:
        await store.close()


async def test_a_settle_batch_mixing_every_shape_of_move_with_stale_and_repeated_reports(
    store_url: tuple[str, str | None],
) -> None:
    """One batch of every outcome (each shape of move sets other columns), a stale lease,
    a repeat of an accepted report and an unknown job: each accepted move sets exactly
    its own columns, the others change nothing, and the slots given back are counted."""
    clock = FakeClock(START)
    store = await _open(*store_url, clock)
    try:
        specs = [JobSpec(task="t", args=[i]) for i in range(6)]
        specs.append(JobSpec(task="t", args=[6], concurrency_key="k", concurrency_limit=1))
        leases, _ = await _all_claimed(store, specs)
        retry_at = START + timedelta(minutes=5)
        ids = [spec.id for spec in specs]
        batch = [
            Settlement(ids[0], leases[0], Outcome.COMPLETE, result={"n": 0}),
            Settlement(ids[1], leases[1], Outcome.FAIL, error="boom", run_at=retry_at),
            Settlement(ids[2], leases[2], Outcome.FAIL, error="dead"),
            Settlement(ids[3], leases[3], Outcome.RESCHEDULE, run_at=retry_at),
            Settlement(ids[4], uuid.uuid4(), Outcome.COMPLETE),  # a stale lease
            Settlement(ids[5], leases[5], Outcome.LOST, error="gone", run_at=retry_at),
            Settlement(ids[0], leases[0], Outcome.FAIL, error="late repeat"),
            Settlement(ids[6], leases[6], Outcome.COMPLETE, result=[6]),
            Settlement(uuid.uuid4(), uuid.uuid4(), Outcome.COMPLETE),  # no such job
        ]
        assert await store.settle_many(batch) == [
            True, True, True, True, False, True, False, True, False
        ]  # fmt: skip
        jobs = [await store.get_job(job_id) for job_id in ids]
        assert all(job is not None for job in jobs)
        done, retried, dead, later, stale, lost, keyed = jobs  # type: ignore[misc]
        assert (done.status, done.result, done.attempts) == (JobStatus.COMPLETED, {"n": 0}, 0)
        assert (retried.status, retried.last_error, retried.run_at, retried.attempts) == (
            JobStatus.QUEUED, "boom", retry_at, 1
        )  # fmt: skip
        assert (dead.status, dead.last_error, dead.attempts) == (JobStatus.FAILED, "dead", 1)
        assert (later.status, later.run_at, later.attempts) == (JobStatus.QUEUED, retry_at, 0)
        assert stale.status is JobStatus.HANDED_OFF and stale.handoff_id == leases[4]
        assert (lost.status, lost.recoveries, lost.attempts) == (JobStatus.QUEUED, 1, 0)
        assert (keyed.status, keyed.result) == (JobStatus.COMPLETED, [6])
        assert all(job.updated_at == START for job in (done, retried, dead, later, lost, keyed))
        # The keyed job gave its slot back: another job of key k is claimable at once.
        assert await _key_has_room(store, "k")
    finally:
        await store.close()


async def test_the_dispatch_selection_leaves_the_payloads_out_and_the_claim_has_them(
    store_url: tuple[str, str | None],
) -> None:
    """Dispatch reads jobs only to plan them; their arguments come with the claim."""
    clock = FakeClock(START)
    store = await _open(*store_url, clock)
    try:
        spec = JobSpec(task="t", args=["x" * 5000, 1], kwargs={"k": [1, 2]})
        await store.enqueue(spec)
        [selected] = await store.select_eligible(modes=ALL_MODES)
        assert (selected.id, selected.task, selected.status) == (spec.id, "t", JobStatus.QUEUED)
        assert (selected.args, selected.kwargs, selected.result) == ((), {}, None)
        [claimed] = await store.mark_handed_off_many([Claim(spec.id, uuid.uuid4(), "w")])
        assert (claimed.args, claimed.kwargs) == (("x" * 5000, 1), {"k": [1, 2]})
    finally:
        await store.close()


async def test_a_batch_of_completions_alone_with_stale_repeated_and_keyed_reports(
    store_url: tuple[str, str | None],
) -> None:
    """The everyday batch, completions only (PostgreSQL writes it with a statement of its
    own): each accepted completion sets its status, result and time alone, a stale lease
    and an unknown job change nothing, a repeat is refused, and a keyed job's slot comes
    back."""
    clock = FakeClock(START)
    store = await _open(*store_url, clock)
    try:
        specs = [JobSpec(task="t", args=[i], max_attempts=3) for i in range(3)]
        specs.append(JobSpec(task="t", concurrency_key="k", concurrency_limit=1))
        leases, claimed = await _all_claimed(store, specs)
        clock.advance(3)
        ids = [spec.id for spec in specs]
        batch = [
            Settlement(ids[0], leases[0], Outcome.COMPLETE, result={"n": 0}),
            Settlement(ids[1], leases[1], Outcome.COMPLETE),
            Settlement(ids[2], uuid.uuid4(), Outcome.COMPLETE, result="stale"),
            Settlement(ids[0], leases[0], Outcome.COMPLETE, result="repeat"),
            Settlement(ids[3], leases[3], Outcome.COMPLETE, result=[3]),
            Settlement(uuid.uuid4(), uuid.uuid4(), Outcome.COMPLETE),
        ]
        assert await store.settle_many(batch) == [True, True, False, False, True, False]
        done, plain, stale, keyed = [await store.get_job(job_id) for job_id in ids]
        assert done is not None and plain is not None and stale is not None and keyed is not None
        later = START + timedelta(seconds=3)
        assert (done.status, done.result, done.attempts, done.updated_at) == (
            JobStatus.COMPLETED, {"n": 0}, 0, later
        )  # fmt: skip
        assert (plain.status, plain.result, plain.last_error) == (JobStatus.COMPLETED, None, None)
        assert (stale.status, stale.handoff_id, stale.result) == (
            JobStatus.HANDED_OFF, leases[2], None
        )  # fmt: skip
        assert stale.updated_at == claimed[2].updated_at
        assert (keyed.status, keyed.result) == (JobStatus.COMPLETED, [3])
        assert await _key_has_room(store, "k")
    finally:
        await store.close()


async def test_settles_releasing_the_same_keys_in_opposite_orders_all_go_through(
    store_url: tuple[str, str | None],
) -> None:
    """Each batch gives back slots of keys a and b; the batches list them in opposite
    orders and run at once from separate engines. Every slot comes back exactly once."""
    clock = FakeClock(START)
    url, schema = store_url
    handles = [await _open(url, schema, clock) for _ in range(4)]
    store = handles[0]
    try:
        per_key = 40
        jobs = {
            key: [
                (
                    await store.enqueue(
                        JobSpec(task="t", concurrency_key=key, concurrency_limit=per_key)
                    )
                ).job
                for _ in range(per_key)
            ]
            for key in ("a", "b")
        }
        held = {
            key: await store.mark_handed_off_many([Claim(j.id, uuid.uuid4(), "w") for j in js])
            for key, js in jobs.items()
        }
        assert all(len(h) == per_key for h in held.values())

        def batch(i: int) -> list[Settlement]:
            a = held["a"][i::4]
            b = held["b"][i::4]
            ordered = a + b if i % 2 else b + a
            return [Settlement(j.id, j.handoff_id or uuid.uuid4(), Outcome.RETURN) for j in ordered]

        results = await asyncio.gather(*(h.settle_many(batch(i)) for i, h in enumerate(handles)))
        assert all(all(r) for r in results)
        again = await store.mark_handed_off_many(
            [Claim(j.id, uuid.uuid4(), "w") for key in ("a", "b") for j in jobs[key]]
        )
        assert len(again) == 2 * per_key, "every slot was given back, none twice"
    finally:
        for handle in handles:
            await handle.close()


async def test_a_value_postgres_refuses_is_rejected_and_changes_nothing(pg_schema: str) -> None:
    store = await _open(POSTGRES_URL, pg_schema, FakeClock(START))
    try:
        job = (await store.enqueue(JobSpec(task="t"))).job
        with pytest.raises(StorageRejectedError):
            await store.mark_handed_off_many([Claim(job.id, uuid.uuid4(), "bad\x00worker")])
        assert (await store.get_job(job.id)).status is JobStatus.QUEUED  # type: ignore[union-attr]
        claimed = await store.mark_handed_off(job.id, uuid.uuid4(), "good")
        assert claimed is not None
    finally:
        await store.close()


async def test_an_unreachable_postgres_is_transient_trouble_not_a_rejection() -> None:
    require_postgres()
    with socket.socket() as probe:  # a port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = SQLAlchemyAdapter(f"postgresql+asyncpg://postgres@127.0.0.1:{port}/test")
    job_id, lease = uuid.uuid4(), uuid.uuid4()
    calls = [
        store.select_eligible(modes=ALL_MODES),
        store.next_run_at(modes=ALL_MODES),
        store.mark_handed_off_many([Claim(job_id, lease, "w")]),
        store.settle_many([Settlement(job_id, lease, Outcome.COMPLETE)]),
        store.enqueue(JobSpec(task="t")),
    ]
    try:
        for call in calls:
            with pytest.raises(StorageError) as caught:
                await call
            assert not isinstance(caught.value, StorageRejectedError)
    finally:
        await store.close()


async def test_claims_and_settles_go_on_while_every_general_connection_is_taken(
    pg_schema: str,
) -> None:
    store = await _open(POSTGRES_URL, pg_schema, FakeClock(START), pool_size=1)
    held = []
    try:
        job = (await store.enqueue(JobSpec(task="t"))).job
        # The general pool: one connection plus SQLAlchemy's 10 overflow, all checked out.
        held = [await store._engine.connect() for _ in range(11)]
        assert [j.id for j in await store.select_eligible(modes=ALL_MODES)] == [job.id]
        claimed = await store.mark_handed_off(job.id, uuid.uuid4(), "w")
        assert claimed is not None
        assert await store.complete(job.id, claimed.handoff_id or uuid.uuid4(), "ok")
        assert await store.next_run_at(modes=ALL_MODES) is None
    finally:
        for conn in held:
            await conn.close()
        await store.close()


@pytest.mark.parametrize("field", ["pool_size", "hot_pool_size"])
def test_pool_sizes_must_be_positive(field: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=field):
        SQLAlchemyAdapter(f"sqlite+aiosqlite:///{tmp_path / 'x.db'}", **{field: 0})  # type: ignore[arg-type]


async def test_a_closed_store_closes_again_quietly_and_can_be_used_again(
    store_url: tuple[str, str | None],
) -> None:
    """As SQLAlchemy's engine after ``dispose()``: the main closes its store on stop,
    and an owner that closes it too (or keeps using it) must not fail."""
    store = await _open(*store_url, FakeClock(START))
    job = (await store.enqueue(JobSpec(task="t"))).job
    assert await store.mark_handed_off(job.id, uuid.uuid4(), "w") is not None
    await store.close()
    await store.close()
    try:
        claimed = await store.mark_handed_off(
            (await store.enqueue(JobSpec(task="t"))).job.id, uuid.uuid4(), "w"
        )
        assert claimed is not None
    finally:
        await store.close()


async def test_jobs_of_one_key_with_different_limits_are_each_held_to_their_own(
    store_url: tuple[str, str | None],
) -> None:
    """The grant rule goes job by job in claim order: a job fits while the key's active
    count plus the slots this claim already took is below *its* limit. So with one slot
    held, a limit-1 job stays out and the limit-2 job after it gets in."""
    store = await _open(*store_url, FakeClock(START))
    try:

        async def keyed(limit: int) -> uuid.UUID:
            spec = JobSpec(task="t", concurrency_key="m", concurrency_limit=limit)
            return (await store.enqueue(spec)).job.id

        held = await keyed(2)
        assert await store.mark_handed_off(held, uuid.uuid4(), "w") is not None
        one, two, also_two = await keyed(1), await keyed(2), await keyed(2)
        claimed = await store.mark_handed_off_many(
            [Claim(job_id, uuid.uuid4(), "w") for job_id in (one, two, also_two)]
        )
        assert [j.id for j in claimed] == [two]
    finally:
        await store.close()
