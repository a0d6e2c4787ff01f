"""arq: two worker processes of ``max_jobs`` 10, Redis.

A job leaves arq's queue (a sorted set) when it finishes, in the same transaction
that stores its result, so ``ZCARD`` counts the unfinished; the completion time is
the stored result's ``finish_time``.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from arq import create_pool
from arq.constants import default_queue_name
from arq.jobs import Job

from bench.harness import Driver
from bench.peers.arq_app import REDIS


class ArqDriver(Driver):
    label = "arq (2 x max_jobs 10, default 0.5 s poll)"
    setup_text = "2 x `arq WorkerSettings`, max_jobs 10, poll_delay 0.5 s (the default)"
    durability = "Redis as shipped here (no RDB or AOF persistence): a Redis restart loses jobs"
    packages = ("arq", "redis")
    has_bulk = False
    bulk_text = "no bulk API: enqueue_job in a loop"
    server = "redis-server"
    poll = "0.5"

    def setup(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.pool = self.loop.run_until_complete(create_pool(REDIS))

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def reset(self) -> None:
        self.run(self.pool.flushdb())
        self.enqueued = 0

    def enqueue_one(self, kind: str, arg: int) -> Any:
        job = self.run(self.pool.enqueue_job(kind, arg))
        self.enqueued += 1
        return job.job_id

    def done_count(self) -> int:
        return self.enqueued - int(self.run(self.pool.zcard(default_queue_name)))

    def completion_times(self, handles: list[Any]) -> list[float | None] | None:
        async def fetch() -> list[float | None]:
            out: list[float | None] = []
            for h in handles:
                info = await Job(h, self.pool).result_info()
                out.append(info.finish_time.timestamp() if info is not None else None)
            return out

        return self.run(fetch())

    def worker_env(self) -> dict[str, str]:
        return {"BENCH_ARQ_POLL": self.poll}

    def worker_commands(self) -> list[list[str]]:
        command = [sys.executable, "-m", "arq", "bench.peers.arq_app.WorkerSettings"]
        return [command, command]

    def teardown(self) -> None:
        self.run(self.pool.aclose())
        self.loop.close()


class ArqFastPollDriver(ArqDriver):
    label = "arq (0.01 s poll, not the default)"
    setup_text = "2 x `arq WorkerSettings`, max_jobs 10, poll_delay 0.01 s"
    poll = "0.01"


DRIVERS = {"arq": ArqDriver, "arq-fastpoll": ArqFastPollDriver}
