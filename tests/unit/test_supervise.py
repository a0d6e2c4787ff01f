"""The supervised-retry helper: a failing step is logged, waited on and tried again until
it succeeds; a cancellation always gets through."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import pytest

from broker.main.loops import retrying

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
