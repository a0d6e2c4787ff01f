"""Tasks for the dashboard and metrics tests (``--app tests.web_app``)."""

from __future__ import annotations

import asyncio
import os

from broker.tasks.registry import task


@task(mode="inline")
async def greet(name: str) -> str:
    return f"hello {name}"


@task(mode="pooled")
def square(n: int) -> int:
    return n * n


@task(mode="inline", retries=0)
async def explode(reason: str) -> None:
    """Always fails, with no retry: the job dies at once, with a traceback as its error."""
    raise RuntimeError(f"exploded: {reason}")


@task(mode="inline")
async def wait_for(gate: str, limit: float = 60.0) -> str:
    """Runs until the file ``gate`` exists, so a test decides when the job ends."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not os.path.exists(gate):
        if loop.time() > deadline:
            raise TimeoutError(f"gate {gate} did not open within {limit} s")
        await asyncio.sleep(0.02)
    return "opened"
