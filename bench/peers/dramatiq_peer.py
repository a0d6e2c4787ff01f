"""Dramatiq: two worker processes of one thread each, Redis broker.

Dramatiq keeps no record of finished messages; its own bookkeeping is the
``<queue>.msgs`` hash, which holds every message until it is acked, so a job is
complete once it has left that hash. No completion time is recorded.
"""

from __future__ import annotations

import sys
from typing import Any

import redis

from bench.harness import Driver
from bench.peers.dramatiq_app import QUEUE, cpu, noop
from bench.systems import redis_url

ACTORS = {"noop": noop, "cpu": cpu}


class DramatiqDriver(Driver):
    label = "Dramatiq (2 processes x 1 thread, Redis)"
    setup_text = "dramatiq --processes 2 --threads 1, default middleware (retries off for the test)"
    durability = "Redis as shipped here (no RDB or AOF persistence): a Redis restart loses jobs"
    packages = ("dramatiq", "redis")
    has_bulk = False
    bulk_text = "no bulk API: send in a loop"
    server = "redis-server"

    def setup(self) -> None:
        self.redis = redis.Redis.from_url(redis_url())
        self.msgs = f"dramatiq:{QUEUE}.msgs"

    def reset(self) -> None:
        self.redis.flushdb()
        self.enqueued = 0

    def enqueue_one(self, kind: str, arg: int) -> Any:
        self.enqueued += 1
        return ACTORS[kind].send(arg).message_id

    def done_count(self) -> int:
        return self.enqueued - int(self.redis.hlen(self.msgs))

    def worker_commands(self) -> list[list[str]]:
        return [
            [
                sys.executable,
                "-m",
                "dramatiq",
                "bench.peers.dramatiq_app",
                "--processes",
                "2",
                "--threads",
                "1",
                "--queues",
                QUEUE,
            ]
        ]


DRIVERS = {"dramatiq": DramatiqDriver}
