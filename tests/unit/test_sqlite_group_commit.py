"""Group commit on SQLite's hot connection (:meth:`adapters.sql.sqlite_thread.SqliteHot.write`):
writes that come while a transaction is under way share the next one, one write's error
undoes that write alone and reaches its caller alone, and a caller that gave up before its
transaction started has nothing written."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from adapters.sql.sqlite_thread import SqliteHot


class Hot:
    """A :class:`SqliteHot` on a file with one table, counting its commits."""

    def __init__(self, path: Path) -> None:
        self.commits = 0
        self.gate = threading.Event()

        def prepare(conn: sqlite3.Connection, _record: Any) -> None:
            conn.isolation_level = None
            conn.execute("CREATE TABLE IF NOT EXISTS t (n INTEGER)")
            conn.set_trace_callback(self._traced)

        self.hot = SqliteHot(((str(path),), {}), lambda: None, prepare, "test-sqlite-hot")

    def _traced(self, statement: str) -> None:
        self.commits += statement == "COMMIT"

    def insert(self, n: int, *, fail: bool = False) -> Callable[[sqlite3.Connection], int]:
        def write(conn: sqlite3.Connection) -> int:
            conn.execute("INSERT INTO t (n) VALUES (?)", (n,))
            if fail:
                raise ValueError(f"write {n} refused")
            return n

        return write

    def held(self, started: asyncio.Event) -> Callable[[sqlite3.Connection], int]:
        """A write that holds its transaction until the gate opens."""
        loop = asyncio.get_running_loop()

        def write(conn: sqlite3.Connection) -> int:
            loop.call_soon_threadsafe(started.set)
            self.gate.wait()
            return self.insert(0)(conn)

        return write

    async def stored(self) -> list[int]:
        rows = await self.hot.run(lambda conn: conn.execute("SELECT n FROM t").fetchall())
        return sorted(n for (n,) in rows)


@pytest.fixture
async def hot(tmp_path: Path) -> AsyncIterator[Hot]:
    made = Hot(tmp_path / "hot.db")
    yield made
    made.gate.set()
    await made.hot.close()


async def test_writes_that_arrive_during_a_commit_share_the_next_and_fail_alone(hot: Hot) -> None:
    started = asyncio.Event()
    first = asyncio.ensure_future(hot.hot.write(hot.held(started)))
    await started.wait()
    queued = [
        asyncio.ensure_future(hot.hot.write(hot.insert(1))),
        asyncio.ensure_future(hot.hot.write(hot.insert(2, fail=True))),
        asyncio.ensure_future(hot.hot.write(hot.insert(3))),
    ]
    # Opened once the queued writes have reached the writer (the tasks run first).
    asyncio.get_running_loop().call_soon(hot.gate.set)
    assert await first == 0
    outcomes = await asyncio.gather(*queued, return_exceptions=True)
    assert outcomes[0] == 1 and outcomes[2] == 3
    assert isinstance(outcomes[1], ValueError)
    assert await hot.stored() == [0, 1, 3]
    assert hot.commits == 2  # the held write's, then one for the three queued


async def test_a_lone_write_that_fails_is_rolled_back(hot: Hot) -> None:
    with pytest.raises(ValueError):
        await hot.hot.write(hot.insert(1, fail=True))
    assert await hot.hot.write(hot.insert(2)) == 2
    assert await hot.stored() == [2]


async def test_a_write_given_up_before_its_transaction_is_not_written(hot: Hot) -> None:
    started = asyncio.Event()
    first = asyncio.ensure_future(hot.hot.write(hot.held(started)))
    await started.wait()
    dropped = asyncio.ensure_future(hot.hot.write(hot.insert(1)))
    kept = asyncio.ensure_future(hot.hot.write(hot.insert(2)))
    asyncio.get_running_loop().call_soon(dropped.cancel)
    asyncio.get_running_loop().call_soon(hot.gate.set)
    assert await first == 0
    assert await kept == 2
    assert dropped.cancelled()
    assert await hot.stored() == [0, 2]
