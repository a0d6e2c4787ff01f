"""Celery: Redis broker and Redis results, prefork pool of two children.

Completion is read from the result backend: one ``celery-task-meta-*`` key per
finished task in a Redis database of its own, so ``DBSIZE`` counts them.
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from typing import Any

import redis
from celery import Celery

from bench import jobs
from bench.harness import Driver
from bench.systems import REDIS_DB, redis_url

RESULTS_DB = REDIS_DB + 1

app = Celery("bench", broker=redis_url(), backend=redis_url(RESULTS_DB))
app.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@app.task(name="noop")
def noop(tag: int = -1) -> None:
    jobs.noop(tag)


@app.task(name="cpu")
def cpu(rounds: int) -> int:
    return jobs.cpu(rounds)


TASKS = {"noop": noop, "cpu": cpu}


class CeleryDriver(Driver):
    label = "Celery (prefork -c 2, Redis broker and results)"
    setup_text = (
        "celery worker -P prefork -c 2 (one parent, two pool children), defaults otherwise: "
        "prefetch multiplier 4, early ack, result backend on"
    )
    durability = "Redis as shipped here (no RDB or AOF persistence): a Redis restart loses jobs"
    packages = ("celery", "kombu", "redis")
    has_bulk = False
    bulk_text = "no bulk API: apply_async in a loop"
    server = "redis-server"

    def setup(self) -> None:
        self.redis = redis.Redis.from_url(redis_url())
        self.results = redis.Redis.from_url(redis_url(RESULTS_DB))

    def reset(self) -> None:
        self.redis.flushdb()
        self.results.flushdb()
        self.enqueued = 0

    def enqueue_one(self, kind: str, arg: int) -> Any:
        self.enqueued += 1
        return TASKS[kind].apply_async((arg,)).id

    def done_count(self) -> int:
        return int(self.results.dbsize())

    def completion_times(self, handles: list[Any]) -> list[float | None] | None:
        import json

        raw = self.results.mget([f"celery-task-meta-{h}" for h in handles])
        out: list[float | None] = []
        for value in raw:
            if value is None:
                out.append(None)
                continue
            meta = json.loads(value)
            done = datetime.fromisoformat(meta["date_done"])
            if done.tzinfo is None:
                done = done.replace(tzinfo=UTC)
            out.append(done.timestamp())
        return out

    def worker_commands(self) -> list[list[str]]:
        return [
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "bench.peers.celery_peer",
                "worker",
                "-P",
                "prefork",
                "-c",
                "2",
                "-l",
                "WARNING",
            ]
        ]


DRIVERS = {"celery": CeleryDriver}
