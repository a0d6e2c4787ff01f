"""Service after a leader's ``kill -9``: how soon the first job completes again, and where
the time goes.

    .venv/bin/python -m bench.failover [--rounds 10] [--failover-timeout 5] [--jobs 300]

Starts two real ``broker-main`` processes on a fresh PostgreSQL database
(``bench_failover``), the first the leader and the second a standby, and two real
``broker-worker`` processes (inline, 4 slots each) given both addresses. Each round
enqueues ``--jobs`` jobs of 20 ms, waits until the workers are into them, kills the
leader with ``kill -9`` and reads how long each step of the takeover took:

* **elected**: the kill to the standby's ``elected leader`` line (the election, plus
  loading the handoffs in flight);
* **workers**: the kill to the last worker's ``connected to main`` line naming the new
  leader (its reconnect, with the leases it holds adopted in the welcome);
* **first completion**: the kill to the first job the new leader settles as completed
  (the job row's ``updated_us``, written by the new leader's clock on this machine).

Then it waits for every job to complete (each exactly once is the e2e tests' business),
starts the killed main again as the next standby and goes on. Prints one line per round
and a JSON object with each step's median and maximum; not part of ``make test`` (a
benchmark, not an assertion: ``tests/e2e/test_failover.py`` asserts a generous bound).
Every process's log is kept in the work directory printed at the start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.peers.broker_peer import free_port
from bench.systems import database, drop_database, fresh_database, on_admin_database, postgres_dsn
from broker.tasks.registry import task

DATABASE = database("bench_failover")
APP = "bench.failover"


@task(retries=0)
async def work() -> None:
    """A short job: slots stay busy, and the leases in flight at the kill are adopted."""
    await asyncio.sleep(0.02)


@dataclass
class Proc:
    name: str
    process: asyncio.subprocess.Process
    log: Path

    def lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()

    async def wait_for(self, text: str, within: float = 60.0) -> None:
        deadline = time.monotonic() + within
        while True:
            if any(text in line for line in self.lines()):
                return
            if self.process.returncode is not None or time.monotonic() > deadline:
                tail = "\n".join(self.lines()[-20:])
                raise RuntimeError(f"{self.name} did not log {text!r}:\n{tail}")
            await asyncio.sleep(0.02)


def _log_time(line: str) -> float:
    return datetime.fromisoformat(line.split(" ", 1)[0]).timestamp()


async def _spawn(workdir: Path, name: str, *argv: str) -> Proc:
    log = workdir / f"{name}.log"
    with log.open("ab") as out:
        process = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).parent / argv[0]),
            *argv[1:],
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
        )
    return Proc(name, process, log)


class Completions:
    """The jobs completed in the store, read on the benchmark's own connection."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def _read(self, since_us: int) -> tuple[int, int | None]:
        import sqlalchemy as sa

        query = sa.text(
            "SELECT count(*) FILTER (WHERE status = 'completed'),"
            " min(updated_us) FILTER (WHERE status = 'completed' AND updated_us > :since)"
            " FROM broker_jobs"
        )
        async with self.engine.connect() as conn:
            row = (await conn.execute(query, {"since": since_us})).one()
        return int(row[0]), row[1]

    async def reach(self, count: int) -> None:
        """Once ``count`` jobs have completed in all."""
        while True:
            if (await self._read(0))[0] >= count:
                return
            await asyncio.sleep(0.01)

    async def first_after(self, since: float) -> float:
        """When (the settling main's clock) the first job completed after ``since``."""
        while True:
            first = (await self._read(int(since * 1e6)))[1]
            if first is not None:
                return float(first) / 1e6
            if time.time() - since > 120:
                raise RuntimeError("no job completed within 120 s of the kill")
            await asyncio.sleep(0.01)


async def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from sqlalchemy.ext.asyncio import create_async_engine

    from broker.client.client import Client
    from broker.jobs import JobSpec

    await on_admin_database(*fresh_database(DATABASE))
    url = postgres_dsn(DATABASE).replace("postgresql://", "postgresql+asyncpg://")
    ports = [free_port(), free_port()]
    addresses = ",".join(f"127.0.0.1:{port}" for port in ports)
    jobs = Completions(create_async_engine(url))
    procs: list[Proc] = []
    starts = 0

    async def start_main(index: int) -> Proc:
        nonlocal starts
        starts += 1
        argv = ["broker-main", "--database-url", url, "--port", str(ports[index])]
        argv += ["--failover-timeout", str(args.failover_timeout)]
        proc = await _spawn(workdir, f"main-{index}-{starts}", *argv)
        procs.append(proc)
        await proc.wait_for("broker-main listening on")
        return proc

    rounds: list[dict[str, float]] = []
    try:
        mains = [await start_main(0)]
        await mains[0].wait_for("elected leader")
        mains.append(await start_main(1))
        workers = []
        for i in range(2):
            argv = ["broker-worker", "--main", addresses, "--app", APP, "--worker-id", f"w{i}"]
            workers.append(await _spawn(workdir, f"worker-{i}", *argv, "--inline-concurrency", "4"))
        procs.extend(workers)
        for worker in workers:
            await worker.wait_for("connected to main")
        leader = mains[0]
        client = Client(addresses, timeout=60, retry_timeout=60)
        async with client:
            total = 0
            for round_ in range(args.rounds):
                await client.enqueue_many([JobSpec(task=f"{APP}.work") for _ in range(args.jobs)])
                total += args.jobs
                await jobs.reach(total - args.jobs * 3 // 4)  # a quarter into the backlog
                killed_at = time.time()
                leader.process.kill()
                await leader.process.wait()
                successor = next(m for m in mains if m is not leader)
                first = await jobs.first_after(killed_at)
                await successor.wait_for("elected leader")
                elected = next(x for x in successor.lines() if "elected leader" in x)
                found = re.search(r"main_id=(\S+)", elected)
                assert found is not None, elected
                main_id = found[1]
                for worker in workers:
                    await worker.wait_for(f"connected to main {main_id} ")
                followed = max(
                    _log_time(next(x for x in w.lines() if f"connected to main {main_id} " in x))
                    for w in workers
                )
                step = {
                    "elected_s": _log_time(elected) - killed_at,
                    "workers_s": followed - killed_at,
                    "first_completion_s": first - killed_at,
                }
                rounds.append(step)
                print(
                    f"round {round_}: " + ", ".join(f"{k[:-2]} {v:.2f} s" for k, v in step.items()),
                    flush=True,
                )
                await jobs.reach(total)
                index = mains.index(leader)
                mains[index] = await start_main(index)
                leader = successor
    finally:
        for proc in procs:
            if proc.process.returncode is None:
                proc.process.kill()
                await proc.process.wait()
        await jobs.engine.dispose()
        await on_admin_database(drop_database(DATABASE))

    def summary(key: str) -> dict[str, float]:
        values = [r[key] for r in rounds]
        return {"median": round(statistics.median(values), 3), "max": round(max(values), 3)}

    return {
        "rounds": len(rounds),
        "failover_timeout_s": args.failover_timeout,
        **{key: summary(key) for key in rounds[0]},
        "within_5_s": sum(r["first_completion_s"] <= 5.0 for r in rounds),
        "per_round": [{k: round(v, 3) for k, v in r.items()} for r in rounds],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--failover-timeout", type=float, default=5.0)
    parser.add_argument("--jobs", type=int, default=300)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-failover-"))
    print(f"logs in {workdir}", file=sys.stderr, flush=True)
    print(json.dumps(asyncio.run(measure(args, workdir)), indent=2))


if __name__ == "__main__":
    main()
