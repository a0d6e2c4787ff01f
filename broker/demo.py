"""``make demo``: a main on SQLite, one worker, a batch of example jobs, a summary.

This module is also the worker's task module (``--app broker.demo``), so the tasks
below are registered in the worker process exactly as an application's would be.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from broker.client.client import Client
from broker.main.main import Main
from broker.main.settings import MainSettings
from broker.ops import composition
from broker.tasks.registry import task

JOBS = 60


@task(retries=0)
async def add(a: int, b: int) -> int:
    """Pooled (the default mode): runs in one of the worker's warm child processes."""
    await asyncio.sleep(0.01)
    return a + b


@task(mode="inline", retries=0)
def checksum(text: str) -> str:
    """A sync task: the inline runner runs it in a thread, off the worker's loop."""
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:16]


@task(mode="forked", retries=0)
def refuse(reason: str) -> None:
    """Forked: a fresh process of its own, for work that must share nothing."""
    raise ValueError(reason)


async def _demo(db_dir: Path) -> int:
    url = f"sqlite+aiosqlite:///{db_dir / 'demo.db'}"
    main = Main(composition.open_store(url), MainSettings(port=0))
    await main.start()
    print(f"main listening on 127.0.0.1:{main.port}, store {url}")
    worker: asyncio.subprocess.Process | None = None
    try:
        async with Client("127.0.0.1", main.port) as client:
            # Every job is stored before the worker starts, so what the worker prints
            # always comes after "enqueued", as the tutorial shows (started first, it
            # could run and log a failure while the enqueues went on).
            ids = []
            for i in range(JOBS):
                if i % 20 == 19:
                    ids.append(
                        (await client.enqueue(refuse, [f"job {i} refuses on purpose"])).job_id
                    )
                elif i % 2:
                    ids.append((await client.enqueue(checksum, [f"payload {i}"])).job_id)
                else:
                    ids.append((await client.enqueue(add, [i, i * 10])).job_id)
            print(f"enqueued {len(ids)} jobs")
            worker = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "broker.ops.cli",
                "worker",
                "--main",
                f"127.0.0.1:{main.port}",
                "--app",
                "broker.demo",
                "--worker-id",
                "demo-worker",
                "--pooled-runner-count",
                "2",
                "--log-level",
                "WARNING",
            )
            started = time.monotonic()
            while True:
                jobs = [await client.get_job(job_id) for job_id in ids]
                statuses = Counter(str(job["status"]) for job in jobs if job)
                print("  " + ", ".join(f"{k}={v}" for k, v in sorted(statuses.items())))
                if statuses["completed"] + statuses["failed"] == len(ids):
                    break
                if time.monotonic() - started > 60:
                    print("jobs did not finish within 60 s", file=sys.stderr)
                    return 1
                await asyncio.sleep(0.25)
            elapsed = time.monotonic() - started
            print(f"\nall {len(ids)} jobs settled {elapsed:.2f} s after the worker started")
            for job in jobs[:3]:
                assert job is not None
                print(
                    f"  [{job['execution_mode']}] {job['task']}{tuple(job['args'])}"
                    f" -> {job['result']!r}"
                )
            for job in jobs:
                if job and job["status"] == "failed":
                    print(f"  {job['task']} failed: {str(job['last_error']).splitlines()[0]}")
                    break
            print(f"summary: {dict(statuses)}")
        return 0
    finally:
        if worker is not None and worker.returncode is None:
            worker.send_signal(signal.SIGTERM)
            await asyncio.wait_for(worker.wait(), 30)
        await main.stop()


def run() -> int:
    with tempfile.TemporaryDirectory(prefix="broker-demo-") as tmp:
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        return asyncio.run(_demo(Path(tmp)))


if __name__ == "__main__":
    raise SystemExit(run())
