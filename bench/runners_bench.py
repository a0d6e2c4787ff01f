"""Runner benchmark: throughput and per-job overhead of inline, pooled and forked runners.

Runs jobs straight through each runner (no main, no store, no network), so the
figures are the cost of the execution mode itself: a no-op job, and a job of about
5 ms of hashing. Each runner gets the same number of slots (two on this machine's
two cores by default). Per-job overhead is the no-op job's wall time per job per slot.

    .venv/bin/python bench/runners_bench.py [--jobs 400] [--slots 2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tests.pool_app  # noqa: F401 - registers the benchmark tasks
from broker.jobs import ExecutionMode
from broker.tasks.registry import default_registry
from broker.tasks.runner import Assignment, Completed, Runner
from runners.forked import ForkedRunner
from runners.inline import InlineRunner
from runners.pooled import PooledRunner

APP = "tests.pool_app"


def _assignment(task: str, mode: ExecutionMode) -> Assignment:
    return Assignment(
        uuid.uuid4(), uuid.uuid4(), f"{APP}.{task}", (), {}, mode, 1, 1, None, "default"
    )


async def _drive(runner: Runner, task: str, jobs: int) -> float:
    """Keeps every slot busy until ``jobs`` have run; returns the elapsed seconds."""
    done = 0
    started = time.perf_counter()

    async def lane() -> None:
        nonlocal done
        while done < jobs:
            done += 1
            outcome = await runner.run(_assignment(task, runner.mode))
            assert isinstance(outcome, Completed), outcome

    slots = runner.free_slots()
    await asyncio.gather(*(lane() for _ in range(slots)))
    return time.perf_counter() - started


async def _measure(make: Any, jobs: int, slots: int) -> dict[str, float]:
    runner: Runner = make()
    await runner.start()
    try:
        await _drive(runner, "noop", slots * 2)  # warm up: children started, imports done
        out = {}
        for task in ("noop", "hash_5ms"):
            elapsed = await _drive(runner, task, jobs)
            out[task] = jobs / elapsed
        out["overhead_ms"] = 1000 * slots / out["noop"]
        return out
    finally:
        await runner.stop(grace=5)


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=400)
    parser.add_argument("--slots", type=int, default=2)
    args = parser.parse_args(argv)
    apps = [APP]
    makers = {
        "inline (worker loop / threads)": lambda: InlineRunner(
            default_registry, concurrency=args.slots
        ),
        "pooled (warm children)": lambda: PooledRunner(
            apps, registry=default_registry, count=args.slots, max_jobs=10**9
        ),
        "forked (a process per job)": lambda: ForkedRunner(
            apps, registry=default_registry, concurrency=args.slots
        ),
    }
    rows = []
    for name, make in makers.items():
        jobs = args.jobs if "forked" not in name else max(20, args.jobs // 10)
        figures = await _measure(make, jobs, args.slots)
        rows.append((name, jobs, figures))
    print(f"{args.slots} slots per runner, Python {sys.version.split()[0]}\n")
    print("| runner | jobs | no-op jobs/s | 5 ms CPU jobs/s | overhead per job (ms) |")
    print("|---|---:|---:|---:|---:|")
    for name, jobs, f in rows:
        print(
            f"| {name} | {jobs} | {f['noop']:,.0f} | {f['hash_5ms']:,.0f} "
            f"| {f['overhead_ms']:.2f} |"
        )


if __name__ == "__main__":
    asyncio.run(main())
