"""``Client.enqueue_batches`` over real TCP against a real main: many jobs in batches,
several requests under way, results in order; a refused batch stops the sending."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from adapters.memory import MemoryAdapter
from broker.client.client import Client
from broker.exceptions import IdempotencyConflictError
from broker.jobs import JobSpec
from broker.main.main import Main
from broker.main.settings import MainSettings
from tests.support import FAST


@pytest.fixture
async def main() -> AsyncIterator[Main]:
    main = Main(MemoryAdapter(), MainSettings(**FAST.__dict__))
    await main.start()
    try:
        yield main
    finally:
        await main.stop()


async def test_batches_in_flight_store_every_job_and_answer_in_order(main: Main) -> None:
    specs = [JobSpec(task="t", args=(i,)) for i in range(2_500)]
    async with Client("127.0.0.1", main.port, allow_unknown_tasks=True) as client:
        results = await client.enqueue_batches(iter(specs), batch_size=1_000, in_flight=3)
    assert [r.job_id for r in results] == [s.id for s in specs]
    assert not any(r.duplicate for r in results)
    for spec in specs[::499]:
        job = await main.store.get_job(spec.id)
        assert job is not None and job.args == spec.args


async def test_a_refused_batch_stops_the_sending_and_is_raised(main: Main) -> None:
    """One request at a time: the first batch is stored, the second is refused whole
    (its two jobs share an idempotency key with different arguments), and the third is
    never sent."""
    first = [JobSpec(task="t", args=(1,)), JobSpec(task="t", args=(2,))]
    refused = [
        JobSpec(task="t", args=(3,), idempotency_key="k"),
        JobSpec(task="t", args=(4,), idempotency_key="k"),
    ]
    last = [JobSpec(task="t", args=(5,))]
    async with Client("127.0.0.1", main.port, allow_unknown_tasks=True) as client:
        with pytest.raises(IdempotencyConflictError):
            await client.enqueue_batches(first + refused + last, batch_size=2, in_flight=1)
    stored = [await main.store.get_job(s.id) for s in first + refused + last]
    assert [job is not None for job in stored] == [True, True, False, False, False]


async def test_a_batch_size_below_one_is_refused(main: Main) -> None:
    async with Client("127.0.0.1", main.port) as client:
        with pytest.raises(ValueError, match="batch_size and in_flight"):
            await client.enqueue_batches([JobSpec(task="t")], batch_size=0)
