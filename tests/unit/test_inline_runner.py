"""The inline runner: outcomes, slots, timeouts and error text, with no worker around it."""

from __future__ import annotations

import asyncio
import datetime
import math
import threading
import uuid
from typing import Any

import pytest

from broker.exceptions import ConfigurationError
from broker.jobs import ExecutionMode
from broker.tasks.registry import TaskRegistry, task
from broker.tasks.runner import Assignment, Completed, Failed, Reschedule, Rescheduled, Runner
from runners.inline import MAX_ERROR_CHARS, InlineRunner


def assignment(name: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Assignment:
    return Assignment(
        job_id=uuid.uuid4(),
        handoff_id=uuid.uuid4(),
        task=name,
        args=args,
        kwargs=kwargs,
        execution_mode=ExecutionMode.INLINE,
        attempt=1,
        max_attempts=3,
        timeout=timeout,
        queue="default",
    )


@pytest.fixture
def registry() -> TaskRegistry:
    return TaskRegistry()


def test_is_a_runner(registry: TaskRegistry) -> None:
    runner: Runner = InlineRunner(registry)
    assert runner.mode is ExecutionMode.INLINE


@pytest.mark.parametrize("concurrency", [0, -1, True, 1.5, "4"])
def test_concurrency_must_be_a_positive_int(registry: TaskRegistry, concurrency: Any) -> None:
    with pytest.raises(ConfigurationError, match="concurrency"):
        InlineRunner(registry, concurrency=concurrency)


@pytest.mark.parametrize("timeout", [0, -1.0, math.inf, math.nan])
def test_default_timeout_must_be_positive(registry: TaskRegistry, timeout: float) -> None:
    with pytest.raises(ConfigurationError, match="default_timeout"):
        InlineRunner(registry, default_timeout=timeout)


async def test_async_task_runs_on_the_loop(registry: TaskRegistry) -> None:
    @task(name="add", registry=registry, mode="inline")
    async def add(a: int, b: int = 0) -> dict[str, Any]:
        return {"sum": a + b, "thread": threading.get_ident()}

    outcome = await InlineRunner(registry).run(assignment("add", 2, b=3))

    assert outcome == Completed({"sum": 5, "thread": threading.get_ident()})


async def test_sync_task_runs_in_a_thread(registry: TaskRegistry) -> None:
    @task(name="where", registry=registry, mode="inline")
    def where(tag: str) -> list[Any]:
        return [tag, threading.get_ident()]

    outcome = await InlineRunner(registry).run(assignment("where", "x"))

    assert isinstance(outcome, Completed)
    assert outcome.result[0] == "x"
    assert outcome.result[1] != threading.get_ident()


async def test_slots_are_taken_on_entry_and_bounded(registry: TaskRegistry) -> None:
    gate = asyncio.Event()

    @task(name="wait", registry=registry, mode="inline")
    async def wait() -> str:
        await gate.wait()
        return "ok"

    freed: list[int] = []
    runner = InlineRunner(registry, concurrency=2)
    runner.set_capacity_listener(lambda: freed.append(runner.free_slots()))  # never: see below
    assert runner.free_slots() == 2

    first = asyncio.ensure_future(runner.run(assignment("wait")))
    second = asyncio.ensure_future(runner.run(assignment("wait")))
    await asyncio.sleep(0)
    assert runner.free_slots() == 0
    assert runner.status().busy == 2
    with pytest.raises(RuntimeError, match="no free inline slot"):
        await runner.run(assignment("wait"))

    gate.set()
    assert await asyncio.gather(first, second) == [Completed("ok"), Completed("ok")]
    assert runner.free_slots() == 2
    # Each slot freed with its outcome, which tells the caller: no listener call.
    assert freed == []


async def test_async_timeout_cancels_the_job(registry: TaskRegistry) -> None:
    cancelled = asyncio.Event()

    @task(name="slow", registry=registry, mode="inline")
    async def slow() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    runner = InlineRunner(registry)
    outcome = await asyncio.wait_for(runner.run(assignment("slow", timeout=0.05)), 2)

    assert outcome == Failed("timed out after 0.05 s")
    await asyncio.wait_for(cancelled.wait(), 1)
    await asyncio.sleep(0)
    assert runner.free_slots() == 4


async def test_timeout_falls_back_to_the_task_then_the_runner(registry: TaskRegistry) -> None:
    @task(name="slow_with_default", registry=registry, mode="inline", timeout=0.05)
    async def slow_with_default() -> None:
        await asyncio.sleep(30)

    @task(name="slow_plain", registry=registry, mode="inline")
    async def slow_plain() -> None:
        await asyncio.sleep(30)

    runner = InlineRunner(registry, default_timeout=0.1)
    assert await runner.run(assignment("slow_with_default")) == Failed("timed out after 0.05 s")
    assert await runner.run(assignment("slow_plain")) == Failed("timed out after 0.1 s")


async def test_sync_timeout_keeps_the_slot_busy_until_the_thread_returns(
    registry: TaskRegistry,
) -> None:
    release = threading.Event()

    @task(name="stuck", registry=registry, mode="inline")
    def stuck() -> str:
        release.wait(5)
        return "late"

    freed = asyncio.Event()
    runner = InlineRunner(registry, concurrency=2)
    runner.set_capacity_listener(freed.set)

    outcome = await asyncio.wait_for(runner.run(assignment("stuck", timeout=0.05)), 2)

    assert isinstance(outcome, Failed)
    assert outcome.error.startswith("timed out after 0.05 s")
    assert "slot stays busy" in outcome.error
    assert runner.free_slots() == 1
    assert runner.status().details["stuck"] == 1
    release.set()
    await asyncio.wait_for(freed.wait(), 2)
    assert runner.free_slots() == 2


def _inner(message: str) -> None:
    raise ValueError(message)


async def test_exception_becomes_type_message_and_the_jobs_frames(registry: TaskRegistry) -> None:
    @task(name="broken", registry=registry, mode="inline")
    def broken(message: str) -> None:
        _inner(message)

    outcome = await InlineRunner(registry).run(assignment("broken", "boom"))

    assert isinstance(outcome, Failed)
    assert outcome.retry is True
    assert outcome.error.startswith("ValueError: boom\n")
    assert "in _inner" in outcome.error
    assert "in broken" in outcome.error
    assert "runners/inline.py" not in outcome.error


async def test_error_text_is_bounded(registry: TaskRegistry) -> None:
    @task(name="loud", registry=registry, mode="inline")
    async def loud() -> None:
        raise RuntimeError("x" * 100_000)

    outcome = await InlineRunner(registry).run(assignment("loud"))

    assert isinstance(outcome, Failed)
    assert outcome.error.startswith("RuntimeError: xxx")
    assert len(outcome.error) <= MAX_ERROR_CHARS
    assert "in loud" in outcome.error


async def test_bad_arguments_fail_the_job_not_the_runner(registry: TaskRegistry) -> None:
    @task(name="one_arg", registry=registry, mode="inline")
    async def one_arg(a: int) -> int:
        return a

    outcome = await InlineRunner(registry).run(assignment("one_arg", 1, 2))

    assert isinstance(outcome, Failed)
    assert outcome.error.startswith("TypeError:")


@pytest.mark.parametrize("is_async", [True, False])
async def test_reschedule(registry: TaskRegistry, is_async: bool) -> None:
    if is_async:

        @task(name="later", registry=registry, mode="inline")
        async def later() -> None:
            raise Reschedule(30)
    else:

        @task(name="later", registry=registry, mode="inline")
        def later_sync() -> None:
            raise Reschedule(2.5)

    outcome = await InlineRunner(registry).run(assignment("later"))

    assert outcome == Rescheduled(30 if is_async else 2.5)


async def test_reschedule_with_a_bad_delay_fails(registry: TaskRegistry) -> None:
    @task(name="never", registry=registry, mode="inline")
    async def never() -> None:
        raise Reschedule(math.nan)

    outcome = await InlineRunner(registry).run(assignment("never"))

    assert isinstance(outcome, Failed)
    assert "delay" in outcome.error


@pytest.mark.parametrize(
    "value", [object(), {1, 2}, math.nan, {"k": datetime.datetime(2026, 1, 1)}]
)
async def test_result_must_be_json(registry: TaskRegistry, value: object) -> None:
    """A value with no JSON form that reads back as it was (bytes and aware datetimes
    have one: docs/reference/arguments.md)."""

    @task(name="odd", registry=registry, mode="inline")
    async def odd() -> object:
        return value

    outcome = await InlineRunner(registry).run(assignment("odd"))

    assert isinstance(outcome, Failed)
    assert outcome.retry is False
    assert "not JSON-serialisable" in outcome.error


async def test_unknown_task_fails_without_retry(registry: TaskRegistry) -> None:
    runner = InlineRunner(registry)

    outcome = await runner.run(assignment("os.system", "true"))

    assert isinstance(outcome, Failed)
    assert outcome.retry is False
    assert "'os.system' is not registered" in outcome.error
    assert runner.free_slots() == 4


async def test_cancel_stops_an_async_job(registry: TaskRegistry) -> None:
    started = asyncio.Event()

    @task(name="forever", registry=registry, mode="inline")
    async def forever() -> None:
        started.set()
        await asyncio.sleep(30)

    runner = InlineRunner(registry)
    job = assignment("forever")
    running = asyncio.ensure_future(runner.run(job))
    await started.wait()

    assert await runner.cancel(uuid.uuid4()) is False
    assert await runner.cancel(job.job_id) is True
    assert await asyncio.wait_for(running, 2) == Failed("cancelled")
    await asyncio.sleep(0)
    assert runner.free_slots() == 4


async def test_stop_cancels_what_outlives_the_grace(registry: TaskRegistry) -> None:
    started = asyncio.Event()

    @task(name="forever", registry=registry, mode="inline")
    async def forever() -> None:
        started.set()
        await asyncio.sleep(30)

    runner = InlineRunner(registry)
    running = asyncio.ensure_future(runner.run(assignment("forever")))
    await started.wait()

    await runner.stop(grace=0.05)

    assert await asyncio.wait_for(running, 2) == Failed("cancelled")
    assert runner.free_slots() == 0


async def test_run_takes_the_slot_before_it_returns_a_future(registry: TaskRegistry) -> None:
    """The worker counts slots right after ``run`` returns, in the same step, and settles
    the job by a callback on the future: no task of its own per job."""

    @task(name="noop", registry=registry, mode="inline")
    async def noop() -> None:
        return None

    runner = InlineRunner(registry, concurrency=2)
    outcome = runner.run(assignment("noop"))
    assert isinstance(outcome, asyncio.Future) and not outcome.done()
    assert runner.free_slots() == 1
    assert await outcome == Completed(None)
    assert runner.free_slots() == 2
