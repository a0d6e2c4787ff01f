"""The election and the epoch fence on a real PostgreSQL: one leader row, a takeover only
once its lease has run out, and a deposed main's claims and settles refused in the
statement itself (``DeposedError``, nothing changed), while the new leader adopts its
leases. A lease of 0 s runs out at once, which stands for a paused or partitioned leader
without any waiting."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from adapters.sql import SQLAlchemyAdapter
from broker.exceptions import DeposedError
from broker.jobs import Claim, JobSpec, JobStatus
from tests.conftest import drop_schema, fresh_schema_name, require_postgres

pytestmark = pytest.mark.postgres


@pytest.fixture
async def pair() -> AsyncIterator[tuple[SQLAlchemyAdapter, SQLAlchemyAdapter]]:
    url = require_postgres()
    schema = fresh_schema_name()
    old, new = SQLAlchemyAdapter(url, schema=schema), SQLAlchemyAdapter(url, schema=schema)
    await old.setup()
    await new.setup()
    try:
        yield old, new
    finally:
        await old.close()
        await new.close()
        await drop_schema(schema)


async def test_one_leader_until_its_lease_runs_out(
    pair: tuple[SQLAlchemyAdapter, SQLAlchemyAdapter],
) -> None:
    a, b = pair
    first = await a.elect("main-a", "hosta:7600", 60)
    assert first is not None and (first.holder, first.epoch, first.live) == ("main-a", 1, True)
    seen = await b.elect("main-b", "hostb:7600", 60)
    assert seen == first, "a live lease is not taken over; the answer names the leader"
    assert await a.renew("main-a", 1, 60)
    assert not await b.renew("main-b", 1, 60), "only the holder renews"
    await a.resign("main-a", 1)
    taken = await b.elect("main-b", "hostb:7600", 60)
    assert taken is not None and (taken.holder, taken.epoch) == ("main-b", 2)
    assert not await a.renew("main-a", 1, 60), "the deposed main learns it at its renewal"


async def test_a_deposed_leader_changes_nothing(
    pair: tuple[SQLAlchemyAdapter, SQLAlchemyAdapter],
) -> None:
    old, new = pair
    elected = await old.elect("main-old", "old:1", 0)  # a lease that has already run out
    assert elected is not None and elected.epoch == 1
    old.fence(1)
    claimed = (await old.enqueue(JobSpec(task="t"))).job
    keyed = (await old.enqueue(JobSpec(task="t", concurrency_key="k", concurrency_limit=2))).job
    waiting = (await old.enqueue(JobSpec(task="t"))).job
    lease = uuid.uuid4()
    [job] = await old.mark_handed_off_many([Claim(claimed.id, lease, "w1")])
    assert job.handoff_id == lease, "the leader's own claims pass its fence"

    takeover = await new.elect("main-new", "new:1", 60)
    assert takeover is not None and (takeover.holder, takeover.epoch) == ("main-new", 2)
    new.fence(2)

    with pytest.raises(DeposedError, match="epoch fence"):
        await old.mark_handed_off_many([Claim(waiting.id, uuid.uuid4(), "w1")])
    with pytest.raises(DeposedError):
        await old.mark_handed_off_many([Claim(keyed.id, uuid.uuid4(), "w1")])
    with pytest.raises(DeposedError):
        await old.complete(claimed.id, lease, "stale")
    with pytest.raises(DeposedError):
        await old.return_to_queue(claimed.id, lease)
    spec = JobSpec(task="t")
    with pytest.raises(DeposedError):
        await old.enqueue_handed_off([spec], [Claim(spec.id, uuid.uuid4(), "w1")])

    assert await new.get_job(spec.id) is None, "the fenced enqueue stored nothing"
    for job_id, status in ((waiting.id, JobStatus.QUEUED), (keyed.id, JobStatus.QUEUED)):
        stored = await new.get_job(job_id)
        assert stored is not None and stored.status is status and stored.handoff_id is None
    held = await new.get_job(claimed.id)
    assert held is not None and held.status is JobStatus.HANDED_OFF and held.handoff_id == lease
    # The new leader adopts the lease the worker still holds: its report is accepted.
    assert await new.complete(claimed.id, lease, "done")
    done = await new.get_job(claimed.id)
    assert done is not None and done.status is JobStatus.COMPLETED and done.result == "done"
    # A plain enqueue is not a leader's act: any main may store a job.
    assert not (await old.enqueue(JobSpec(task="t"))).duplicate
