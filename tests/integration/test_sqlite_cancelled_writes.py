"""A caller cancelled while one of the SQL store's operator writes runs (a client gone
mid-request, the main stopping) never leaves the SQLite file locked.

aiosqlite runs a statement in its connection's thread: cancelling the await does not stop
it, and SQLAlchemy then drops the connection without the rollback reaching SQLite, so
the write transaction stayed open and every later write waited out the busy timeout and
failed with "database is locked" (found as a flaky retention test, whose end cancels the
retention loop while a prune batch runs). Each write now runs to its commit or rollback."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from adapters.sql import SQLAlchemyAdapter
from broker.jobs import JobSpec
from tests.support import until

LATER = datetime(2100, 1, 1, tzinfo=UTC)
"""Older than this: every finished job, for a prune."""

Write = Callable[[SQLAlchemyAdapter, Any], Coroutine[Any, Any, object]]

WRITES: dict[str, tuple[str, Write]] = {
    # name: (the statement the caller is cancelled at, the write). The hazard is a
    # statement that returns rows: one cancelled while it runs left the lock held.
    "cancel's read": ("SELECT BROKER_JOBS.ID", lambda s, job: s.cancel(job.id)),
    "cancel's update": ("UPDATE BROKER_JOBS", lambda s, job: s.cancel(job.id)),
    "retry_dead's read of a job not dead": (
        "SELECT BROKER_JOBS.ID",
        lambda s, job: s.retry_dead(job.id),
    ),
    "prune's read of a batch": (
        "SELECT BROKER_JOBS.ID",
        lambda s, job: s.prune(older_than=LATER, batch_size=5),
    ),
}


@pytest.mark.parametrize("name", sorted(WRITES))
async def test_a_write_whose_caller_is_cancelled_leaves_the_sqlite_file_writable(
    tmp_path: Path, name: str
) -> None:
    statement, write = WRITES[name]
    store = SQLAlchemyAdapter(f"sqlite+aiosqlite:///{tmp_path / 'cancelled.db'}")
    await store.setup()
    try:
        job = (await store.enqueue(JobSpec(task="t"))).job
        for i in range(12):  # finished jobs, for a prune
            done = (await store.enqueue(JobSpec(task="done", args=[i]))).job
            lease = uuid.uuid4()
            assert await store.mark_handed_off(done.id, lease, "w") is not None
            assert await store.complete(done.id, lease)
        loop = asyncio.get_running_loop()
        writing: list[asyncio.Task[object]] = []

        def cancel_there(conn: Any, cursor: Any, text: str, *rest: Any) -> None:
            if writing and text.lstrip().upper().startswith(statement):
                loop.call_soon(writing.pop().cancel)

        event.listen(store._engine.sync_engine, "before_cursor_execute", cancel_there)
        writing.append(asyncio.create_task(write(store, job)))
        [outcome] = await asyncio.gather(*writing, return_exceptions=True)
        assert isinstance(outcome, asyncio.CancelledError) and not writing, "cancelled there"
        made = (await store.enqueue(JobSpec(task="after"))).job
        assert (await store.get_job(made.id)) is not None
    finally:
        await store.close()


async def test_close_waits_for_a_cancelled_callers_write_but_not_forever(tmp_path: Path) -> None:
    """``close`` lets a write whose caller was cancelled finish (else the engine's dispose
    would cut its connection off), but one that never ends (a store gone unreachable
    mid-write) is cancelled after ``unfinished_wait``, so a main still stops."""
    store = SQLAlchemyAdapter(f"sqlite+aiosqlite:///{tmp_path / 'stuck.db'}")
    await store.setup()
    store.unfinished_wait = 0.2
    began, go, finished, never = asyncio.Event(), asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def quick(conn: Any) -> None:
        began.set()
        await go.wait()
        finished.set()

    async def stuck(conn: Any) -> None:
        await never.wait()

    callers = [asyncio.create_task(store._write("test", quick))]
    await asyncio.wait_for(began.wait(), 10)
    callers.append(asyncio.create_task(store._write("test", stuck)))  # behind the lock
    await until(lambda: len(store._unfinished) == 2)
    for caller in callers:
        caller.cancel()
    go.set()
    await store.close()
    assert finished.is_set(), "the write let run finished before the engine went"
    assert not store._unfinished, "the stuck one was cancelled"
