"""arq's worker settings (``arq bench.peers.arq_app.WorkerSettings``).

``BENCH_ARQ_POLL`` overrides the poll delay (arq's default is 0.5 s).
"""

from __future__ import annotations

import os
from typing import Any

from arq.connections import RedisSettings

from bench import jobs
from bench.systems import REDIS_DB, REDIS_HOST, REDIS_PORT

REDIS = RedisSettings(host=REDIS_HOST, port=REDIS_PORT, database=REDIS_DB)


async def noop(ctx: dict[str, Any], tag: int = -1) -> None:
    jobs.noop(tag)


async def cpu(ctx: dict[str, Any], rounds: int) -> int:
    return jobs.cpu(rounds)


class WorkerSettings:
    functions = (noop, cpu)
    redis_settings = REDIS
    max_jobs = 10
    max_tries = 1
    poll_delay = float(os.environ.get("BENCH_ARQ_POLL", "0.5"))
