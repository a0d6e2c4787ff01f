"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.e2e.test_e2e import Cluster, sqlite_url


@pytest.fixture
async def sqlite_cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    """A main and workers as processes on a SQLite file; every process is killed after."""
    cluster = Cluster(tmp_path, sqlite_url(tmp_path))
    try:
        yield cluster
    finally:
        await cluster.close()
