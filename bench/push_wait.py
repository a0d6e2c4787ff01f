"""Pushed results on PostgreSQL: how soon a waiter hears of its job's end, and what many
waiters cost the main.

    .venv/bin/python -m bench.push_wait [--jobs 300] [--concurrency 10] [--waiters 10000]

Starts a real ``broker-main`` on a fresh PostgreSQL database (``bench_push_wait``) and
one real ``broker-worker`` (inline) serving :func:`stamp`, which returns the wall clock
as it ends. Two measurements:

* **Push latency**: ``--jobs`` jobs, ``--concurrency`` at a time, each enqueued and then
  waited for with ``Client.wait``; the latency of one is the wall clock when the wait
  returns minus the clock the task returned (same machine, same clock): the worker's
  report, the main's settle in PostgreSQL, the notice, the read and the reply. p50, p99.
* **Waiters' memory**: the main's resident memory (``/proc/PID/status`` VmRSS) idle,
  then with ``--waiters`` waits outstanding on jobs due tomorrow (over two connections:
  the bound is 10,000 per connection), then after those connections closed (the main
  dropped their waiters).

Prints one JSON object. Not part of ``make test``; a benchmark, not an assertion.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench.harness import Workers
from bench.peers.broker_peer import main_on_fresh_database
from bench.rss_soak import rss_mb
from bench.systems import database, drop_database, on_admin_database
from broker.tasks.registry import task

DATABASE = database("bench_push_wait")
APP = "bench.push_wait"


@task(retries=0)
async def stamp() -> float:
    """Ends at once, saying when (the worker's wall clock)."""
    return time.time()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _cpu_ticks(pid: int) -> int:
    """User plus system CPU of ``pid`` so far, in clock ticks (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


async def _main_rss(pid: int, quiet_ticks: int = 2, limit: float = 120.0) -> float | None:
    """The main's RSS once it has gone quiet (at most ``quiet_ticks`` of CPU in each of two
    half-seconds running): each wait is a store read, and 10,000 of them take the main
    seconds on a loaded machine, so a fixed pause read the memory halfway."""
    deadline = time.monotonic() + limit
    before, calm = _cpu_ticks(pid), 0
    while calm < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        now = _cpu_ticks(pid)
        calm = calm + 1 if now - before <= quiet_ticks else 0
        before = now
    return rss_mb(pid)


async def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from broker.client.client import Client
    from broker.jobs import JobSpec
    from broker.wire.messages import Role

    main, port, _ = await main_on_fresh_database(DATABASE, workdir / "push-wait-main.log")
    bin_dir = Path(sys.executable).parent
    worker = Workers(
        [
            [
                str(bin_dir / "broker-worker"),
                *("--main", f"127.0.0.1:{port}", "--app", APP, "--log-level", "WARNING"),
                *("--inline-concurrency", str(args.concurrency)),
            ]
        ],
        {},
        workdir / "push-wait-worker.log",
    )
    clients = [Client("127.0.0.1", port, timeout=60, retry_timeout=30) for _ in range(2)]
    operator = Client("127.0.0.1", port, timeout=60, role=Role.OPERATOR)
    try:
        await clients[0].connect()
        # The worker has declared its task once an enqueue of it by name is accepted.
        deadline = time.monotonic() + 30
        while True:
            try:
                await clients[0].wait((await clients[0].enqueue(f"{APP}.stamp")).job_id)
                break
            except Exception as exc:
                print(f"not ready yet: {exc!r}", file=sys.stderr, flush=True)
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)

        latencies: list[float] = []
        slots = asyncio.Semaphore(args.concurrency)

        async def one() -> None:
            async with slots:
                job = await clients[0].enqueue(f"{APP}.stamp")
                done = await clients[0].wait(job.job_id, timeout=60)
                woken = time.time()
                assert done["status"] == "completed", done
                latencies.append(woken - float(done["result"]))

        await asyncio.gather(*(one() for _ in range(args.jobs)))

        idle = await _main_rss(main.pids[0])
        later = datetime.now(UTC) + timedelta(days=1)  # due tomorrow: they wait all along
        parked = await clients[0].enqueue_batches(
            JobSpec(task=f"{APP}.stamp", run_at=later) for _ in range(args.waiters)
        )
        await clients[1].connect()
        half = len(parked) // 2
        waits = [
            asyncio.create_task(clients[0 if i < half else 1].wait(p.job_id, timeout=600))
            for i, p in enumerate(parked)
        ]
        await clients[0].status()  # the waits were sent before this answer
        waiting = await _main_rss(main.pids[0])
        for waiting_task in waits:
            waiting_task.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        for client in clients:
            await client.close()  # the main drops the connections' waiters
        await operator.status()  # the closes were seen before this answer
        released = await _main_rss(main.pids[0])
    finally:
        for client in [*clients, operator]:
            await client.close()
        worker.stop(grace=10)
        main.stop(grace=10)
        await on_admin_database(drop_database(DATABASE))
    ms = [x * 1000 for x in latencies]
    return {
        "push_latency_ms": {
            "jobs": len(ms),
            "concurrency": args.concurrency,
            "p50": round(statistics.median(ms), 2),
            "p99": round(_percentile(ms, 0.99), 2),
            "max": round(max(ms), 2),
        },
        "main_rss_mb": {
            "idle": idle,
            f"with_{args.waiters}_waiters": waiting,
            "after_their_connections_closed": released,
        },
        "store": "PostgreSQL (fsync on), broker-main and one broker-worker (inline)",
        "loadavg": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--waiters", type=int, default=10_000)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="push-wait-"))
    print(f"logs in {workdir}", file=sys.stderr, flush=True)
    print(json.dumps(asyncio.run(measure(args, workdir)), indent=2))


if __name__ == "__main__":
    main()
