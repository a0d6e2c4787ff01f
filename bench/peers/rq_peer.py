"""RQ: two worker processes, the default forking ``Worker`` or ``SimpleWorker`` (no fork).

Completion is RQ's own ``FinishedJobRegistry`` (a sorted set, so ``ZCARD`` counts it);
the completion time is the job hash's ``ended_at``.
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from typing import Any

import redis
from rq import Queue
from rq.registry import FinishedJobRegistry

from bench.harness import Driver
from bench.peers.rq_app import cpu, noop
from bench.systems import redis_url

QUEUE = "bench"
FUNCS = {"noop": noop, "cpu": cpu}


class RQDriver(Driver):
    label = "RQ (2 forking workers)"
    setup_text = "2 x `rq worker` (default Worker: forks a work horse per job), defaults otherwise"
    durability = "Redis as shipped here (no RDB or AOF persistence): a Redis restart loses jobs"
    packages = ("rq", "redis")
    bulk_text = "Queue.enqueue_many in one pipeline"
    server = "redis-server"
    worker_class = "rq.worker.Worker"
    drain_jobs = 1000
    cpu_jobs = 300

    def setup(self) -> None:
        self.redis = redis.Redis.from_url(redis_url())
        self.queue = Queue(QUEUE, connection=self.redis)
        self.finished = FinishedJobRegistry(QUEUE, connection=self.redis)

    def reset(self) -> None:
        self.redis.flushdb()
        self.enqueued = 0

    def enqueue_one(self, kind: str, arg: int) -> Any:
        self.enqueued += 1
        return self.queue.enqueue(FUNCS[kind], arg).id

    def enqueue_bulk(self, kind: str, args: list[int]) -> None:
        data = [Queue.prepare_data(FUNCS[kind], (a,)) for a in args]
        with self.redis.pipeline() as pipe:
            self.queue.enqueue_many(data, pipeline=pipe)
            pipe.execute()
        self.enqueued += len(args)

    def done_count(self) -> int:
        return int(self.redis.zcard(self.finished.key))

    def completion_times(self, handles: list[Any]) -> list[float | None] | None:
        with self.redis.pipeline() as pipe:
            for h in handles:
                pipe.hget(f"rq:job:{h}", "ended_at")
            raw = pipe.execute()
        out: list[float | None] = []
        for value in raw:
            if not value:
                out.append(None)
                continue
            text = value.decode().replace("Z", "+00:00")
            ended = datetime.fromisoformat(text)
            if ended.tzinfo is None:
                ended = ended.replace(tzinfo=UTC)
            out.append(ended.timestamp())
        return out

    def worker_commands(self) -> list[list[str]]:
        command = [
            sys.executable,
            "-m",
            "rq.cli",
            "worker",
            "--url",
            redis_url(),
            "--worker-class",
            self.worker_class,
            "--logging_level",
            "WARNING",
            QUEUE,
        ]
        return [command, command]


class RQSimpleDriver(RQDriver):
    label = "RQ (2 SimpleWorkers, no fork)"
    setup_text = "2 x `rq worker --worker-class rq.worker.SimpleWorker` (jobs run in the worker)"
    worker_class = "rq.worker.SimpleWorker"
    drain_jobs = None
    cpu_jobs = None


DRIVERS = {"rq": RQDriver, "rq-simple": RQSimpleDriver}
