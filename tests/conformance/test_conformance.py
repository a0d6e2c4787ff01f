"""Runs the public conformance suite on every store this repo ships, with the same ids."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from adapters.memory import MemoryAdapter
from broker.jobs import Clock
from broker.storage import StorageAdapter
from broker.testing.conformance import CHECKS, Check, CheckSkipped, StoreHarness, run_check
from tests.conftest import drop_schema, fresh_schema_name, require_postgres


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


class SQLHarness:
    """Each handle is its own engine on one store, as separate processes would have."""

    def __init__(self, url: str, schema: str | None = None) -> None:
        self.url = url
        self.schema = schema

    async def open(self, clock: Clock) -> StorageAdapter:
        from adapters.sql import SQLAlchemyAdapter

        store = SQLAlchemyAdapter(self.url, clock=clock, schema=self.schema)
        await store.setup()
        return store

    async def close(self) -> None:
        if self.schema is not None:
            await drop_schema(self.schema)


def _sqlite(tmp_path: Path) -> StoreHarness:
    return SQLHarness(f"sqlite+aiosqlite:///{tmp_path / 'conformance.db'}")


def _postgres(tmp_path: Path) -> StoreHarness:
    return SQLHarness(require_postgres(), schema=fresh_schema_name())


HARNESSES: dict[str, Callable[[Path], StoreHarness]] = {
    "memory": lambda _: MemoryHarness(),
    "sqlite": _sqlite,
    "postgres": _postgres,
}


@pytest.mark.parametrize("check", CHECKS, ids=[c.name for c in CHECKS])
@pytest.mark.parametrize("store", list(HARNESSES))
async def test_conformance(store: str, check: Check, tmp_path: Path) -> None:
    harness = HARNESSES[store](tmp_path)
    try:
        await run_check(check, harness)
    except CheckSkipped as skipped:
        pytest.skip(str(skipped))
