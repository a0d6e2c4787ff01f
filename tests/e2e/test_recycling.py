"""Recycling pooled children off the hot path, with real child processes: no job-count
limit unless one is set, and make-before-break (the successor is ready before the old
child stops taking jobs, and jobs keep running on the old one meanwhile)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

import tests.pool_app  # noqa: F401  (registers the tasks in this process too)
from broker.jobs import ExecutionMode
from broker.ops import cli
from broker.ops.composition import RunnerOptions
from broker.tasks.registry import default_registry
from broker.tasks.runner import Assignment, Completed
from runners.pooled import PooledRunner
from tests.support import until

pytestmark = pytest.mark.slow

APP = "tests.pool_app"


def _job(task: str = "whoami", *args: Any) -> Assignment:
    return Assignment(
        uuid.uuid4(),
        uuid.uuid4(),
        f"{APP}.{task}",
        args,
        {},
        ExecutionMode.POOLED,
        1,
        1,
        None,
        "default",
    )


async def _pid_of(pool: PooledRunner, job: Assignment) -> int:
    outcome = await pool.run(job)
    assert isinstance(outcome, Completed), outcome
    assert isinstance(outcome.result, int)
    return outcome.result


def _children(pool: PooledRunner) -> list[dict[str, Any]]:
    children: list[dict[str, Any]] = pool.status().details["children"]  # type: ignore[assignment]
    return children


def test_no_job_count_limit_by_default() -> None:
    assert RunnerOptions().pooled_max_jobs is None
    args = cli.worker_parser().parse_args(["--app", APP])
    assert args.pooled_max_jobs is None


async def test_a_child_runs_past_the_old_hundred_job_limit_without_recycling() -> None:
    pool = PooledRunner([APP], registry=default_registry, count=1, concurrency=10)
    await pool.start()
    try:
        pids: set[int] = set()
        for _ in range(15):  # 150 jobs, ten at a time
            pids |= set(await asyncio.gather(*(_pid_of(pool, _job()) for _ in range(10))))
        assert len(pids) == 1, f"{len(pids)} children served 150 jobs"
        [child] = _children(pool)
        assert child["jobs_run"] == 150 and not child["retiring"]
    finally:
        await pool.stop(grace=1)


async def test_a_retiring_child_serves_until_its_successor_is_ready() -> None:
    pool = PooledRunner([APP], registry=default_registry, count=1, concurrency=1, max_jobs=2)
    await pool.start()
    gaps: list[list[dict[str, Any]]] = []

    async def watch() -> None:
        """Every millisecond: a ready child must hold the place (no dip in capacity)."""
        while True:
            kids = _children(pool)
            if not any(k["ready"] and not k["retiring"] and not k["successor"] for k in kids):
                gaps.append(kids)
            await asyncio.sleep(0.001)

    try:
        await until(lambda: _children(pool)[0]["ready"])
        watcher = asyncio.create_task(watch())
        old = await _pid_of(pool, _job())
        assert await _pid_of(pool, _job()) == old
        # Two jobs: the child is due. Its successor is starting, and the old child still
        # takes the next job at once instead of it waiting for the start.
        kids = _children(pool)
        assert [(k["ready"], k["successor"]) for k in kids] == [(True, False), (False, True)]
        assert pool.free_slots() == 1
        assert await _pid_of(pool, _job()) == old, "jobs keep flowing on the old child"

        async def taken_over() -> int | None:
            kids = _children(pool)
            serving = [k for k in kids if k["ready"] and not k["successor"] and not k["retiring"]]
            return serving[0]["pid"] if serving and serving[0]["pid"] != old else None

        new = await until(taken_over)
        assert await _pid_of(pool, _job()) == new
        watcher.cancel()
        assert not gaps, f"the pool had no ready child in its place: {gaps[0]}"
    finally:
        await pool.stop(grace=1)


async def test_jobs_keep_flowing_through_a_recycle_under_load() -> None:
    pool = PooledRunner([APP], registry=default_registry, count=2, concurrency=2, max_jobs=5)
    await pool.start()
    try:
        await until(lambda: all(k["ready"] for k in _children(pool)))
        pids: list[int] = []

        async def recycled() -> bool:
            # Every round finds every slot free: a child due for recycling keeps its slots
            # until its successor is ready, so capacity never dips while one starts.
            assert pool.free_slots() == 4
            pids.extend(await asyncio.gather(*(_pid_of(pool, _job()) for _ in range(4))))
            return len(set(pids)) > 2

        await until(recycled, timeout=30)
        first_two = set(pids[:4])
        assert len([p for p in pids if p in first_two]) > 10, "the due children kept serving"
        assert pool.status().busy == 0
        assert len([k for k in _children(pool) if not k["retiring"] and not k["successor"]]) == 2
    finally:
        await pool.stop(grace=1)
