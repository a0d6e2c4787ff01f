"""Tasks for ``tests/e2e/test_json_logs.py``: one job of each ending (completed, failed
then retried, dead, timed out in a child), loaded by a real worker with ``--app``."""

from __future__ import annotations

import time

from broker.tasks.registry import task


@task(mode="inline", queue="logs")
async def ok() -> int:
    return 1


@task(mode="inline", queue="logs", retries=1, backoff=lambda failures: 0.05)
async def boom() -> None:
    raise ValueError("refused on purpose")


@task(mode="pooled", queue="logs", retries=0, timeout=0.5)
def stuck() -> None:
    time.sleep(60)
