"""Fan-in on PostgreSQL: how soon the continuation of 10,000 members starts once the last
member has completed.

    .venv/bin/python -m bench.fan_in [--groups 10] [--members 1000] [--concurrency 50]

A group has at most 1,000 members (``MAX_GROUP_MEMBERS``: a fan-in's arguments hold one
result per parent, within a message's container bound), so 10,000 members are a tree:
``--groups`` groups of ``--members`` members, each group's fan-in (:func:`partial`), and
one final job that depends on every fan-in (:func:`final`, ``depends_on`` with
``parent_results="list_arg"``). Everything is enqueued before the worker starts, so the
members run as a drain.

Starts a real ``broker-main`` on a fresh PostgreSQL database (``bench_fan_in``) and one
real ``broker-worker`` (inline). Every member returns the wall clock as it ends; each
fan-in and the final job note the clock as they start (same machine, same clock).
Reported:

* **last member -> final start**: the final job's start minus the latest member's end
  (two fan-ins deep: the last member's report and settle, its group's fan-in made due,
  handed off, run, reported and settled, the final made due and handed off);
* **last member settled -> final start**: the same from the latest member's ``updated_at``
  in the store (its settle);
* **one level (a fan-in of ``--members``)**: a group's fan-in start minus the latest end
  among its own members: for the group whose member ended last (nothing else queued by
  then), and p50 and max over the other groups, whose fan-in is made due while later
  groups' members are still queued ahead of it (the queue is first in, first out), so
  it waits its turn.

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
from pathlib import Path
from typing import Any

from bench.harness import Workers
from bench.peers.broker_peer import main_on_fresh_database
from bench.systems import database, drop_database, on_admin_database
from broker.tasks.registry import task

DATABASE = database("bench_fan_in")
APP = "bench.fan_in"


@task(name=f"{APP}.member", retries=0, mode="inline")
async def member() -> float:
    """Ends at once, saying when (the worker's wall clock)."""
    return time.time()


@task(name=f"{APP}.partial", retries=0, mode="inline")
async def partial(ends: list[float]) -> list[float]:
    """A group's fan-in: when it started, and its members' latest end."""
    return [time.time(), max(ends)]


@task(name=f"{APP}.final", retries=0, mode="inline")
async def final(partials: list[list[float]]) -> dict[str, Any]:
    """The continuation of every group: when it started, and what each fan-in said."""
    return {"started": time.time(), "partials": partials}


async def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import adapters
    from broker import group
    from broker.client.client import Client
    from broker.jobs import ExecutionMode, JobSpec, JobStatus, ParentResults
    from broker.storage import JobFilter

    main, port, url = await main_on_fresh_database(DATABASE, workdir / "fan-in-main.log")
    bin_dir = Path(sys.executable).parent
    client = Client("127.0.0.1", port, timeout=120, retry_timeout=30, allow_unknown_tasks=True)
    worker: Workers | None = None
    try:
        await client.connect()
        fan_ins = []
        for _ in range(args.groups):
            flow = await client.enqueue_workflow(
                group(member.bind() for _ in range(args.members)).then(partial.bind())
            )
            assert flow.final_job_id is not None
            fan_ins.append(flow.final_job_id)
        (last,) = await client.enqueue_many(
            [
                JobSpec(
                    task=final.name,
                    execution_mode=ExecutionMode.INLINE,
                    depends_on=tuple(fan_ins),
                    parent_results=ParentResults.LIST_ARG,
                )
            ]
        )
        worker = Workers(
            [
                [
                    str(bin_dir / "broker-worker"),
                    *("--main", f"127.0.0.1:{port}", "--app", APP, "--log-level", "WARNING"),
                    *("--inline-concurrency", str(args.concurrency)),
                    *("--pooled-runner-count", "0", "--forked-concurrency", "0"),
                ]
            ],
            {},
            workdir / "fan-in-worker.log",
        )
        began = time.time()
        done = await client.wait(last.job_id, timeout=args.timeout)
        assert done["status"] == JobStatus.COMPLETED.value, done
    finally:
        await client.close()
        if worker is not None:
            worker.stop(grace=10)
        main.stop(grace=10)
    store = adapters.open_store(url)
    try:
        settled: list[float] = []
        cursor: str | None = None
        while True:
            page = await store.list_jobs(JobFilter(tasks=[member.name]), limit=1000, cursor=cursor)
            settled.extend(j.updated_at.timestamp() for j in page.jobs)
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
    finally:
        await store.close()
        await on_admin_database(drop_database(DATABASE))
    result = done["result"]
    started = float(result["started"])
    partials = [(float(s), float(e)) for s, e in result["partials"]]
    last_end = max(e for _, e in partials)
    last_group = max(partials, key=lambda p: p[1])
    others = [(s - e) * 1000 for s, e in partials if (s, e) != last_group]
    return {
        "members": args.groups * args.members,
        "shape": f"{args.groups} groups x {args.members} members, a fan-in each, one final",
        "drain_s": round(last_end - began, 2),
        "last_member_to_final_start_ms": round((started - last_end) * 1000, 1),
        "last_member_settled_to_final_start_ms": round((started - max(settled)) * 1000, 1),
        f"one_level_fan_in_of_{args.members}_ms": {
            "last_group": round((last_group[0] - last_group[1]) * 1000, 1),
            "other_groups_p50": round(statistics.median(others), 1) if others else None,
            "other_groups_max": round(max(others), 1) if others else None,
        },
        "store": "PostgreSQL (fsync on), broker-main and one broker-worker (inline)",
        "loadavg": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=10)
    parser.add_argument("--members", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="fan-in-"))
    print(f"logs in {workdir}", file=sys.stderr, flush=True)
    print(json.dumps(asyncio.run(measure(args, workdir)), indent=2))


if __name__ == "__main__":
    main()
