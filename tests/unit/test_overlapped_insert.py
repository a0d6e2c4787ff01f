"""A big PostgreSQL enqueue is written a chunk at a time, each chunk built while the one
before is written (``adapters.sql.enqueue.overlapped``): one statement at a time on the
connection, and none left running when the enqueue fails or is cancelled."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from adapters.sql.enqueue import overlapped
from adapters.sql.rows import Payload

IDS = [uuid.uuid4() for _ in range(3)]


def _batches(log: list[str], n: int) -> Iterator[tuple[list[dict[str, Any]], list[Payload]]]:
    for i in range(n):
        log.append(f"build {i}")
        yield [{"n": i}], []


async def test_each_batch_is_built_while_the_one_before_is_written() -> None:
    log: list[str] = []
    gates = [asyncio.Event() for _ in IDS]

    async def insert(rows: list[dict[str, Any]], moved: list[Payload]) -> set[uuid.UUID]:
        n = rows[0]["n"]
        log.append(f"send {n}")
        await gates[n].wait()
        log.append(f"done {n}")
        return {IDS[n]}

    task = asyncio.create_task(overlapped(insert, _batches(log, 3)))
    while "build 1" not in log:
        await asyncio.sleep(0)
    assert log == ["build 0", "send 0", "build 1"]  # built while 0 is being written
    for gate in gates:
        gate.set()
    assert await task == set(IDS)
    assert log.index("done 0") < log.index("send 1") < log.index("done 1") < log.index("send 2")


async def test_a_cancelled_enqueue_cancels_the_statement_in_flight() -> None:
    started = asyncio.Event()
    cancelled: list[int] = []

    async def insert(rows: list[dict[str, Any]], moved: list[Payload]) -> set[uuid.UUID]:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(rows[0]["n"])
            raise
        return set()

    task = asyncio.create_task(overlapped(insert, _batches([], 2)))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cancelled == [0]


async def test_an_error_building_a_batch_waits_for_the_statement_in_flight() -> None:
    gate = asyncio.Event()
    finished: list[int] = []

    async def insert(rows: list[dict[str, Any]], moved: list[Payload]) -> set[uuid.UUID]:
        await gate.wait()
        finished.append(rows[0]["n"])
        return set()

    def batches() -> Iterator[tuple[list[dict[str, Any]], list[Payload]]]:
        yield [{"n": 0}], []
        gate.set()  # the statement can end now, but has not yet
        raise ValueError("a row that cannot be built")

    with pytest.raises(ValueError, match="cannot be built"):
        await overlapped(insert, batches())
    assert finished == [0]  # it ended before the error left: the connection is free
