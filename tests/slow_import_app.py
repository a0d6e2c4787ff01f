"""A task module that takes 0.6 s to import, like an app with heavy imports: a forked or
pooled child is not ready until that time has passed."""

from __future__ import annotations

import asyncio
import os
import time

from broker.tasks.registry import task

IMPORT_SECONDS = 0.6

time.sleep(IMPORT_SECONDS)


@task(mode="forked")
async def quick() -> int:
    """Far under a 0.3 s timeout once its process is running."""
    return os.getpid()


@task(mode="forked")
async def sleepy(seconds: float) -> None:
    await asyncio.sleep(seconds)
