"""The custom adapter shown in docs/adapters.md passes the full conformance suite.

This is the pytest wiring the document describes, run on the document's own example
(``docs/examples/logging_adapter.py``), so the example cannot drift from the contract.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from adapters.memory import MemoryAdapter
from adapters.sql import SQLAlchemyAdapter
from broker.jobs import Clock, JobSpec
from broker.ops import composition
from broker.storage import StorageAdapter, SupportsNotify
from broker.testing.conformance import CHECKS, Check, CheckSkipped, StoreHarness, run_check

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
sys.path.insert(0, str(EXAMPLES))

from logging_adapter import LoggingAdapter  # noqa: E402


class LoggingMemoryHarness:
    """Every handle wraps the same in-process store, as one process sharing it would."""

    def __init__(self) -> None:
        self._inner: MemoryAdapter | None = None

    async def open(self, clock: Clock) -> StorageAdapter:
        if self._inner is None:
            self._inner = MemoryAdapter(clock=clock)
        store = LoggingAdapter(self._inner)
        await store.setup()
        return store

    async def close(self) -> None:
        self._inner = None


class LoggingSQLiteHarness:
    """Each handle wraps its own engine on one SQLite file, as another process would."""

    def __init__(self, path: Path) -> None:
        self.url = f"sqlite+aiosqlite:///{path}"

    async def open(self, clock: Clock) -> StorageAdapter:
        store = LoggingAdapter(SQLAlchemyAdapter(self.url, clock=clock))
        await store.setup()
        return store

    async def close(self) -> None:
        pass  # the file lives in pytest's tmp_path


HARNESSES: dict[str, Callable[[Path], StoreHarness]] = {
    "memory": lambda _: LoggingMemoryHarness(),
    "sqlite": lambda tmp: LoggingSQLiteHarness(tmp / "conformance.db"),
}


@pytest.mark.parametrize("check", CHECKS, ids=[c.name for c in CHECKS])
@pytest.mark.parametrize("inner", list(HARNESSES))
async def test_logging_adapter_conforms(inner: str, check: Check, tmp_path: Path) -> None:
    try:
        await run_check(check, HARNESSES[inner](tmp_path))
    except CheckSkipped as skipped:
        pytest.skip(str(skipped))


def test_the_example_is_a_storage_adapter_structurally() -> None:
    store = LoggingAdapter(MemoryAdapter())
    assert isinstance(store, StorageAdapter)
    assert isinstance(store, SupportsNotify)
    assert store.capabilities == MemoryAdapter().capabilities


async def test_broker_main_can_load_it_with_the_adapter_option() -> None:
    store = composition.open_store("memory://", "logging_adapter:create")
    assert isinstance(store, LoggingAdapter)
    await store.setup()
    try:
        job = (await store.enqueue(JobSpec(task="app.tasks.noop"))).job
        assert await store.complete(job.id, uuid.uuid4()) is False, "not handed off: fenced"
        assert store.calls["enqueue"] == 1
        assert store.fenced_out["complete"] == 1
    finally:
        await store.close()
