"""Enqueues from many client connections at once, through a real main over real TCP onto
real SQLite and PostgreSQL stores: they are group-committed (far fewer transactions than
requests), and the idempotency and unique keys hold across callers that share a
transaction."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from adapters.sql import SQLAlchemyAdapter
from broker.client.client import Client
from broker.jobs import EnqueueResult, JobSpec
from tests.conftest import drop_schema, fresh_schema_name, require_postgres
from tests.support import running_main

CLIENTS = 60


class CountedEnqueues(SQLAlchemyAdapter):
    calls = 0

    async def enqueue_many(self, specs: Sequence[JobSpec]) -> list[EnqueueResult]:
        self.calls += 1
        return await super().enqueue_many(specs)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[CountedEnqueues]:
    if request.param == "sqlite":
        adapter = CountedEnqueues(f"sqlite+aiosqlite:///{tmp_path / 'group.db'}")
        yield adapter
        return
    schema = fresh_schema_name()
    adapter = CountedEnqueues(require_postgres(), schema=schema)
    try:
        yield adapter
    finally:
        await drop_schema(schema)


async def test_concurrent_clients_share_transactions_and_keys_still_hold(
    store: CountedEnqueues,
) -> None:
    async with running_main(store) as main:
        clients = [Client(port=main.port) for _ in range(CLIENTS)]
        await asyncio.gather(*(c.connect() for c in clients))
        store.calls = 0
        try:
            # Pairs of clients share an idempotency key, and pairs a unique key.
            replies = await asyncio.gather(
                *(
                    c.enqueue(
                        "app.t",
                        [i // 2 if i < 20 else i],  # a key's two callers ask for one job
                        idempotency_key=f"idem-{i // 2}" if i < 20 else None,
                        unique_key=f"uniq-{i // 2}" if 20 <= i < 40 else None,
                    )
                    for i, c in enumerate(clients)
                )
            )
        finally:
            await asyncio.gather(*(c.close() for c in clients))
        total = sum(c.count for c in await store.count_jobs())
    ids = [reply.job_id for reply in replies]
    assert store.calls < CLIENTS // 2  # grouped: far fewer transactions than requests
    for pair in range(20):
        assert ids[2 * pair] == ids[2 * pair + 1]  # the same job for both callers
        assert sorted(r.duplicate for r in replies[2 * pair : 2 * pair + 2]) == [False, True]
    assert len(set(ids)) == 20 + (CLIENTS - 40)
    assert total == len(set(ids))
