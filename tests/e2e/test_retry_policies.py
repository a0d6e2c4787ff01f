"""Retry policies behind a real main, a real worker and real pooled child processes: a
``dont_retry_on`` exception, an exception outside ``retry_on`` and arguments that do not
fit the function each end the job dead after one run; other failures use the retries."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest

import tests.retry_app  # noqa: F401
from adapters.memory import MemoryAdapter
from broker.jobs import Job, JobSpec, JobStatus
from broker.main.main import Main
from broker.main.settings import MainSettings
from broker.ops.composition import RunnerOptions, build_runners
from broker.tasks.registry import default_registry
from broker.worker.worker import Worker
from tests.support import until

pytestmark = pytest.mark.slow

APP = "tests.retry_app"


@contextlib.asynccontextmanager
async def cluster() -> AsyncIterator[tuple[Main, MemoryAdapter]]:
    store = MemoryAdapter()
    main = Main(
        store,
        MainSettings(port=0, ping_interval=0.5, liveness_timeout=5),
        retry_delay_fn=lambda n: timedelta(0),
    )
    await main.start()
    options = RunnerOptions(apps=(APP,), pooled_runner_count=1, startup_timeout=20.0)
    worker = Worker(
        "127.0.0.1",
        main.port,
        worker_id="retry-worker",
        runners=build_runners(options, default_registry),
        registry=default_registry,
    )
    running = asyncio.create_task(worker.run())
    try:
        yield main, store
    finally:
        worker.request_stop(fast=True)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(running, 20)
        await main.stop()


async def _run(main: Main, store: MemoryAdapter, task: str, *args: Any, **kw: Any) -> Job:
    """Enqueue by name (as the CLI does: nothing bound at the call site) and wait until
    the job is terminal."""
    [result] = await store.enqueue_many([JobSpec(task=f"{APP}.{task}", args=args, **kw)])
    main.wake()

    async def done() -> Job | None:
        job = await store.get_job(result.job.id)
        return job if job is not None and job.status.is_terminal else None

    job: Job = await until(done, 30)
    return job


async def test_policies_decide_which_failures_are_retried() -> None:
    async with cluster() as (main, store):
        declined = await _run(main, store, "charge", 10, max_attempts=6)
        assert (declined.status, declined.attempts) == (JobStatus.FAILED, 1)
        assert declined.last_error is not None
        assert "tests.retry_app.PaymentDeclined: card declined for 10" in declined.last_error
        assert (
            "not retried: the task's retry policy excludes PaymentDeclined" in declined.last_error
        )

        outside = await _run(main, store, "only_network", 3, max_attempts=6)
        assert (outside.status, outside.attempts) == (JobStatus.FAILED, 1)

        unreachable = await _run(main, store, "flaky_charge", 5, max_attempts=3)
        assert (unreachable.status, unreachable.attempts) == (JobStatus.FAILED, 3), (
            "an exception the policy allows uses every retry"
        )

        wrong = await _run(main, store, "add", 1, 2, 3, max_attempts=6)
        assert (wrong.status, wrong.attempts) == (JobStatus.FAILED, 1)
        assert wrong.last_error is not None and "too many positional arguments" in wrong.last_error
        assert "not retried" in wrong.last_error

        right = await _run(main, store, "add", 1, 2)
        assert (right.status, right.result) == (JobStatus.COMPLETED, 3)


async def test_every_runner_ends_a_dont_retry_failure_and_bad_arguments_at_once() -> None:
    """Inline, pooled and forked alike: the worker judges the failure from the runner's
    report (a child process's, for pooled and forked), so none of them retries it. A job
    of a task the worker did not declare never reaches it (routing by task): it waits,
    queued, with no attempt used."""
    async with cluster() as (main, store):
        [unknown] = await store.enqueue_many([JobSpec(task=f"{APP}.no_such_task")])
        for mode in ("inline", "pooled", "forked"):
            declined = await _run(main, store, "charge", 10, max_attempts=6, execution_mode=mode)
            assert (declined.status, declined.attempts) == (JobStatus.FAILED, 1), mode
            assert declined.last_error is not None
            assert "excludes PaymentDeclined" in declined.last_error, mode
            wrong = await _run(main, store, "add", 1, max_attempts=6, execution_mode=mode)
            assert (wrong.status, wrong.attempts) == (JobStatus.FAILED, 1), mode
            assert wrong.last_error is not None
            assert "missing a required argument: 'b'" in wrong.last_error, mode
        waiting = await store.get_job(unknown.job.id)
        assert waiting is not None and (waiting.status, waiting.attempts) == (JobStatus.QUEUED, 0)


async def test_a_callable_backoff_sets_the_wait_and_a_bad_one_is_refused() -> None:
    async with cluster() as (main, store):
        [result] = await store.enqueue_many(
            [JobSpec(task=f"{APP}.patient", args=[1], max_attempts=4)]
        )
        main.wake()

        async def failed_once() -> Job | None:
            job = await store.get_job(result.job.id)
            return job if job is not None and job.attempts == 1 else None

        waiting: Job = await until(failed_once, 30)
        assert waiting.status is JobStatus.QUEUED
        wait = (waiting.run_at - waiting.updated_at).total_seconds()
        assert 3599 <= wait <= 3601, f"the task's backoff asked for an hour, got {wait} s"

        # A backoff returning -5 s: refused, the main's backoff (none, in this cluster)
        # applies, the job runs its retry and its error says why.
        refused = await _run(main, store, "badly_backed_off", 1, max_attempts=2)
        assert (refused.status, refused.attempts) == (JobStatus.FAILED, 2)
        assert refused.last_error is not None
        assert "the task's backoff after 2 failures must be a number of seconds" in (
            refused.last_error
        ), refused.last_error
        assert "the main's backoff applies" in refused.last_error
