"""The main's loops (:mod:`broker.main.loops`): a failing step is logged, waited on and
tried again until it succeeds; a cancellation always gets through; a batch writer retries
while transient and isolates a poison item alone by halving."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import pytest

from broker.exceptions import StorageError, StorageRejectedError
from broker.main.loops import BatchWriter, retrying

logger = logging.getLogger("tests.supervise")


def _flaky(failures: int) -> tuple[list[int], Callable[[], Awaitable[str]]]:
    calls: list[int] = []

    async def attempt() -> str:
        calls.append(len(calls) + 1)
        if len(calls) <= failures:
            raise OSError(f"down #{len(calls)}")
        return "done"

    return calls, attempt


async def test_failures_are_logged_and_retried_until_the_step_succeeds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="tests.supervise")
    calls, attempt = _flaky(failures=3)
    errors: list[None] = []

    result = await retrying(
        "the step", attempt, interval=0.001, logger=logger, on_error=lambda: errors.append(None)
    )

    assert result == "done" and calls == [1, 2, 3, 4]
    assert len(errors) == 3
    assert [r.getMessage() for r in caplog.records] == [
        f"the step failed, retrying error=OSError('down #{n}')" for n in (1, 2, 3)
    ]
    assert all(r.levelno == logging.WARNING for r in caplog.records)


async def test_a_step_that_succeeds_at_once_is_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="tests.supervise")
    calls, attempt = _flaky(failures=0)
    assert await retrying("the step", attempt, interval=60, logger=logger) == "done"
    assert calls == [1] and caplog.records == []


async def test_cancellation_ends_the_retries_while_waiting() -> None:
    calls, attempt = _flaky(failures=1_000)
    task = asyncio.create_task(retrying("the step", attempt, interval=60, logger=logger))
    while not calls:
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert calls == [1]


async def test_a_step_cancelled_from_inside_is_not_retried() -> None:
    calls: list[int] = []

    async def attempt() -> None:
        calls.append(1)
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await retrying("the step", attempt, interval=0.001, logger=logger)
    assert calls == [1]


async def test_a_wake_cuts_one_wait_short() -> None:
    calls, attempt = _flaky(failures=2)
    wake = asyncio.Event()
    task = asyncio.create_task(
        retrying("the step", attempt, interval=3600, logger=logger, wake=wake)
    )
    while len(calls) < 1:
        await asyncio.sleep(0)
    wake.set()  # the second attempt comes now, not in an hour
    while len(calls) < 2:
        await asyncio.sleep(0)
    assert not wake.is_set(), "a wake-up is used up by the wait it shortened"
    for _ in range(100):  # many turns of the loop: nothing is due for an hour
        await asyncio.sleep(0)
    assert calls == [1, 2], "the third attempt waits for the interval again"
    wake.set()
    assert await asyncio.wait_for(task, 10) == "done"
    assert calls == [1, 2, 3]


async def test_a_failure_retrying_cannot_help_is_raised_unlogged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="tests.supervise")
    calls, attempt = _flaky(failures=1)
    with pytest.raises(OSError, match="down #1"):
        await retrying("the step", attempt, interval=60, logger=logger, retry_if=lambda _: False)
    assert calls == [1] and caplog.records == []


async def test_a_stopping_main_gives_up_after_logging_the_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="tests.supervise")
    calls, attempt = _flaky(failures=1)
    with pytest.raises(OSError):
        await retrying(
            "the step", attempt, interval=60, logger=logger, stopping=lambda: True, fields={"n": 2}
        )
    assert calls == [1]
    assert [r.getMessage() for r in caplog.records] == [
        "the step failed, retrying n=2 error=OSError('down #1')"
    ]


# ----------------------------------------------------------------------------- BatchWriter


class FakeStore:
    """Writes batches of item names: ``down`` transient failures first, then any batch
    holding a ``poison`` item fails for good (as a value the store refuses would)."""

    def __init__(self, *, down: int = 0, poison: frozenset[str] = frozenset()) -> None:
        self.down = down
        self.poison = poison
        self.attempts: list[list[str]] = []
        self.stored: list[str] = []

    async def write(self, batch: list[str]) -> list[str]:
        self.attempts.append(list(batch))
        if self.down:
            self.down -= 1
            raise StorageError("the store is down")
        if self.poison & set(batch):
            raise StorageRejectedError("refused")
        self.stored += batch
        return [f"ok:{item}" for item in batch]


class Recorder:
    def __init__(self, store: FakeStore, *, stopping: bool = False) -> None:
        self.written: list[tuple[list[str], list[str]]] = []
        self.unstorable: list[tuple[str, str]] = []
        self.sleeps: list[float] = []
        self.stopping = stopping

        async def sleep(seconds: float) -> None:
            self.sleeps.append(seconds)

        async def unstorable(item: str, exc: Exception) -> None:
            self.unstorable.append((item, type(exc).__name__))

        self.writer: BatchWriter[str, list[str]] = BatchWriter(
            "writing items",
            write=store.write,
            written=lambda batch, answer: self.written.append((batch, answer)),
            unstorable=unstorable,
            batch=4,
            retry_interval=7.0,
            stopping=lambda: self.stopping,
            logger=logger,
            count_as="items",
            sleep=sleep,
        )


async def test_a_batch_is_retried_while_the_store_is_down_then_handed_on_once() -> None:
    store = FakeStore(down=2)
    rec = Recorder(store)
    await rec.writer.write(["a", "b"])
    assert store.attempts == [["a", "b"]] * 3
    assert rec.sleeps == [7.0, 7.0], "the injected sleep, the retry interval each time"
    assert rec.written == [(["a", "b"], ["ok:a", "ok:b"])]
    assert rec.unstorable == []


async def test_a_batch_failing_while_the_main_stops_is_left_unanswered() -> None:
    store = FakeStore(down=5)
    rec = Recorder(store, stopping=True)
    await rec.writer.write(["a"])
    assert store.attempts == [["a"]] and rec.sleeps == []
    assert rec.written == [] and rec.unstorable == []


async def test_a_poison_item_is_isolated_alone_by_halving_and_the_others_are_written(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="tests.supervise")
    store = FakeStore(poison=frozenset({"c"}))
    rec = Recorder(store)
    await rec.writer.write(["a", "b", "c", "d"])
    assert store.attempts == [["a", "b", "c", "d"], ["a", "b"], ["c", "d"], ["c"], ["d"]]
    assert rec.written == [(["a", "b"], ["ok:a", "ok:b"]), (["d"], ["ok:d"])]
    assert rec.unstorable == [("c", "StorageRejectedError")], "only the poison item, alone"
    assert store.stored == ["a", "b", "d"] and rec.sleeps == [], "nothing to wait for"
    assert [r.getMessage() for r in caplog.records] == [
        "writing items failed, splitting the batch to isolate the cause items=4 "
        "error=StorageRejectedError('refused')",
        "writing items failed, splitting the batch to isolate the cause items=2 "
        "error=StorageRejectedError('refused')",
    ]


async def test_the_run_loop_group_commits_what_was_queued_in_batches_and_goes_idle() -> None:
    store = FakeStore()
    rec = Recorder(store)
    for item in "abcdef":
        rec.writer.add(item)
    runner = asyncio.create_task(rec.writer.run())
    try:
        await asyncio.wait_for(rec.writer.wait_idle(), 10)
    finally:
        runner.cancel()
    assert store.attempts == [["a", "b", "c", "d"], ["e", "f"]], "up to the batch size each"
    assert rec.writer.queued == []
