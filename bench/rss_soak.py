"""The main's memory over a long run: enqueue and drain many no-op jobs on PostgreSQL.

    .venv/bin/python -m bench.rss_soak [--jobs 1000000] [--interval 5] [--out bench/results]

Starts a real ``broker-main`` on a fresh PostgreSQL database (``bench_broker_soak``) and
one real ``broker-worker`` with the flags of the ``broker-postgres`` row of ``make
bench`` (``bench/peers/broker_peer.py``), then enqueues ``--jobs`` no-op jobs in
batches of 1,000 through ``broker.Client``, keeping at most ``--backlog`` of them
outstanding, until all are complete. Every ``--interval`` seconds it reads the main's
resident memory from ``/proc/PID/status`` (VmRSS), and writes the series and a summary
to ``rss-soak.json`` and ``rss-soak.md`` in ``--out``: first, last, min, max, max - min,
and the slope over the second half of the run (after warm-up) in MB per minute.

Why this shape: issue 10 asks that the main's RSS stay flat (within 30 MB) over a
1,000,000-job enqueue and drain. A bounded backlog keeps the store's size, not the
main, from growing with the run, so what grows in the main is the main's own doing.
The whole run takes about 1,000,000 / (drain rate) seconds: 20 minutes at 850 jobs/s.
Not part of ``make test`` or CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg

from bench.harness import ROOT, Workers
from bench.peers.broker_peer import (
    CHUNK,
    MAIN_FLAGS,
    OUTSTANDING,
    SETUPS,
    TASKS,
    main_on_fresh_database,
)
from bench.systems import (
    database,
    drop_database,
    on_admin_database,
    postgres_dsn,
)

DATABASE = database("bench_broker_soak")
ROW = "broker-postgres"
"""The ``make bench`` row whose worker flags the soak uses."""


def rss_mb(pid: int) -> float | None:
    """Resident memory of one process, from ``/proc/PID/status``; ``None`` once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def slope_mb_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of ``(seconds, MB)`` points, in MB per minute."""
    if len(points) < 2:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_m = sum(m for _, m in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return None
    cov = sum((t - mean_t) * (m - mean_m) for t, m in points)
    return 60 * cov / var


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    values = [s["main_rss_mb"] for s in samples if s["main_rss_mb"] is not None]
    if not values:
        return {}
    half = samples[len(samples) // 2 :]
    return {
        "first_mb": values[0],
        "last_mb": values[-1],
        "min_mb": min(values),
        "max_mb": max(values),
        "max_minus_min_mb": max(values) - min(values),
        "second_half_slope_mb_per_min": slope_mb_per_min(
            [(s["t_s"], s["main_rss_mb"]) for s in half if s["main_rss_mb"] is not None]
        ),
    }


async def soak(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from broker.client.client import Client
    from broker.jobs import ExecutionMode, JobSpec

    row = SETUPS[ROW]
    main, port, _ = await main_on_fresh_database(DATABASE, workdir / "rss-soak-main.log")
    bin_dir = Path(sys.executable).parent
    worker_command = [
        str(bin_dir / "broker-worker"),
        "--main",
        f"127.0.0.1:{port}",
        "--app",
        TASKS,
        "--log-level",
        "WARNING",
        *row.flags,
    ]
    workers: Workers | None = None
    reader: asyncpg.Connection | None = None
    client = Client("127.0.0.1", port, timeout=120)
    samples: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + 30
        while True:
            main.check()
            try:
                await client.connect()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
        reader = await asyncpg.connect(postgres_dsn(DATABASE))
        workers = Workers([worker_command] * row.workers, {}, workdir / "rss-soak-worker.log")
        mode = ExecutionMode(row.mode)

        def spec() -> JobSpec:  # a fresh one per job: a spec carries its job's id
            return JobSpec(task=f"{TASKS}.noop", args=(-1,), max_attempts=1, execution_mode=mode)

        started = time.monotonic()
        enqueued, outstanding = 0, 0
        next_sample = started

        async def sample() -> None:
            nonlocal outstanding, next_sample
            assert reader is not None
            outstanding = int(await reader.fetchval(OUTSTANDING))
            now = time.monotonic()
            point = {
                "t_s": round(now - started, 2),
                "enqueued": enqueued,
                "done": enqueued - outstanding,
                "main_rss_mb": rss_mb(main.pids[0]),
            }
            samples.append(point)
            print(json.dumps(point), file=sys.stderr, flush=True)
            next_sample = now + args.interval

        await sample()
        while enqueued < args.jobs or outstanding > 0:
            main.check()
            assert workers is not None
            workers.check()
            if enqueued < args.jobs and outstanding + CHUNK <= args.backlog:
                batch = min(CHUNK, args.jobs - enqueued)
                await client.enqueue_many([spec() for _ in range(batch)])
                enqueued += batch
                outstanding += batch
            else:
                await asyncio.sleep(0.2)
                assert reader is not None
                outstanding = int(await reader.fetchval(OUTSTANDING))
            if time.monotonic() >= next_sample:
                await sample()
        await sample()
        elapsed = time.monotonic() - started
    finally:
        await client.close()
        if reader is not None:
            await reader.close()
        if workers is not None:
            workers.stop(grace=10)
        main.stop(grace=10)
        await on_admin_database(drop_database(DATABASE))
    return {
        "generated": datetime.now(UTC).isoformat(timespec="seconds"),
        "jobs": args.jobs,
        "backlog": args.backlog,
        "interval_s": args.interval,
        "seconds": elapsed,
        "jobs_per_s": args.jobs / elapsed if elapsed else None,
        "setup": f"broker-main {' '.join(MAIN_FLAGS)} + {row.workers} broker-worker "
        f"{' '.join(row.flags)}; PostgreSQL with fsync on",
        "loadavg_end": os.getloadavg(),
        "summary": summarize(samples),
        "samples": samples,
    }


def markdown(data: dict[str, Any]) -> str:
    s = data["summary"]

    def mb(key: str) -> str:
        value = s.get(key)
        return "-" if value is None else f"{value:.1f}"

    slope = s.get("second_half_slope_mb_per_min")
    lines = [
        "# broker-main RSS over a long enqueue and drain",
        "",
        f"Generated by `python -m bench.rss_soak --jobs {data['jobs']}` on {data['generated']}: "
        f"{data['jobs']:,} no-op jobs enqueued in batches of {CHUNK:,} (at most "
        f"{data['backlog']:,} outstanding) and drained in {data['seconds'] / 60:.1f} min "
        f"({data['jobs_per_s']:,.0f} jobs/s); {data['setup']}. RSS = VmRSS of broker-main "
        f"from /proc, every {data['interval_s']:g} s ({len(data['samples'])} samples).",
        "",
        "| first MB | last MB | min MB | max MB | max - min MB | slope, second half, MB/min |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {mb('first_mb')} | {mb('last_mb')} | {mb('min_mb')} | {mb('max_mb')} | "
        f"{mb('max_minus_min_mb')} | {'-' if slope is None else f'{slope:+.3f}'} |",
        "",
        "The series (seconds, jobs enqueued, jobs done, MB) is in `rss-soak.json`.",
        "",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.rss_soak", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--jobs", type=int, default=1_000_000, help="no-op jobs to enqueue and drain")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--backlog", type=int, default=20_000, help="most jobs outstanding at once")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="where to write")
    args = p.parse_args(argv)
    if args.jobs < 1 or args.interval <= 0 or args.backlog < CHUNK:
        p.error(f"--jobs must be at least 1, --interval above 0, --backlog at least {CHUNK}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="broker-rss-soak-"))
    print(f"logs of broker-main and broker-worker in {logs}", file=sys.stderr)
    data = asyncio.run(soak(args, logs))
    (args.out / "rss-soak.json").write_text(json.dumps(data, indent=1))
    (args.out / "rss-soak.md").write_text(markdown(data))
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
