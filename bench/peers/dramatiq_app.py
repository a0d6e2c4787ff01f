"""Dramatiq's actors on the Redis broker (``dramatiq bench.peers.dramatiq_app``)."""

from __future__ import annotations

import dramatiq
from dramatiq.brokers.redis import RedisBroker

from bench import jobs
from bench.systems import redis_url

QUEUE = "bench"

broker = RedisBroker(url=redis_url())
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name=QUEUE, max_retries=0)
def noop(tag: int = -1) -> None:
    jobs.noop(tag)


@dramatiq.actor(queue_name=QUEUE, max_retries=0)
def cpu(rounds: int) -> int:
    return jobs.cpu(rounds)
