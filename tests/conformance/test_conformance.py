"""Runs the public conformance suite on every store this repo ships, with the same ids."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from adapters.memory import MemoryAdapter
from broker.jobs import Clock
from broker.storage import StorageAdapter, payload_digest
from broker.testing.conformance import CHECKS, Check, CheckSkipped, StoreHarness, run_check
from tests.conftest import POSTGRES_URL


class MemoryHarness:
    """Every handle is the same in-process store, as for one process sharing it."""

    def __init__(self) -> None:
        self._store: MemoryAdapter | None = None

    async def open(self, clock: Clock) -> StorageAdapter:
        if self._store is None:
            self._store = MemoryAdapter(clock=clock)
        return self._store

    async def close(self) -> None:
        self._store = None

    async def tamper_payload(
        self, job_id: uuid.UUID, kind: str, edit: Callable[[str], str], *, rehash: bool = False
    ) -> None:
        assert self._store is not None
        text, digest = self._store._payloads[(job_id, kind)]
        text = edit(text)
        self._store._payloads[(job_id, kind)] = (text, payload_digest(text) if rehash else digest)


class SQLHarness:
    """Each handle is its own engine on one store, as separate processes would have."""

    def __init__(self, url: str, schema: str | None = None) -> None:
        self.url = url
        self.schema = schema
        """PostgreSQL: this test process's schema, emptied before each check (``pg_schema``)."""

    async def open(self, clock: Clock) -> StorageAdapter:
        from adapters.sql import SQLAlchemyAdapter

        store = SQLAlchemyAdapter(self.url, clock=clock, schema=self.schema)
        await store.setup()
        return store

    async def close(self) -> None:
        pass  # handles close themselves; the next check's pg_schema empties the store

    async def tamper_payload(
        self, job_id: uuid.UUID, kind: str, edit: Callable[[str], str], *, rehash: bool = False
    ) -> None:
        """Edit the row of ``broker_payloads`` on an engine of its own, as another process."""
        from adapters.sql.schema import payloads

        engine = create_async_engine(self.url)
        options = {} if self.schema is None else {"schema_translate_map": {None: self.schema}}
        where = (payloads.c.job_id == job_id) & (payloads.c.kind == kind)
        try:
            async with engine.begin() as conn:
                conn = await conn.execution_options(**options)
                text = edit(
                    (await conn.execute(sa.select(payloads.c.body).where(where))).scalar_one()
                )
                values = {"body": text, **({"digest": payload_digest(text)} if rehash else {})}
                await conn.execute(sa.update(payloads).where(where).values(**values))
        finally:
            await engine.dispose()


def _sqlite(request: pytest.FixtureRequest) -> StoreHarness:
    tmp_path: Path = request.getfixturevalue("tmp_path")
    return SQLHarness(f"sqlite+aiosqlite:///{tmp_path / 'conformance.db'}")


def _postgres(request: pytest.FixtureRequest) -> StoreHarness:
    return SQLHarness(POSTGRES_URL, schema=request.getfixturevalue("pg_schema"))


HARNESSES: dict[str, Callable[[pytest.FixtureRequest], StoreHarness]] = {
    "memory": lambda _: MemoryHarness(),
    "sqlite": _sqlite,
    "postgres": _postgres,
}


@pytest.fixture
def harness(store: str, request: pytest.FixtureRequest) -> StoreHarness:
    """An empty store of the kind the test is for: a sync fixture, so that it can take
    the fixtures of that kind only (``pg_schema`` for PostgreSQL)."""
    return HARNESSES[store](request)


@pytest.mark.parametrize("check", CHECKS, ids=[c.name for c in CHECKS])
@pytest.mark.parametrize("store", list(HARNESSES))
async def test_conformance(store: str, check: Check, harness: StoreHarness) -> None:
    try:
        await run_check(check, harness)
    except CheckSkipped as skipped:
        pytest.skip(str(skipped))
