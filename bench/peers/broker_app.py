"""The broker's benchmark tasks (``broker-worker --app bench.peers.broker_app``)."""

from __future__ import annotations

from bench import jobs
from broker.tasks.registry import task


@task(retries=0)
async def noop(tag: int = -1) -> None:
    jobs.noop(tag)


@task(retries=0)
def cpu(rounds: int) -> int:
    return jobs.cpu(rounds)
