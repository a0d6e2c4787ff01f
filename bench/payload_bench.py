"""What a large argument costs end to end: enqueue to completion, one job at a time.

    .venv/bin/python bench/payload_bench.py [--sizes 1,10] [--runs 3] [--no-postgres]

A real ``broker-main`` and a real worker with one pooled child run ``echo_blob`` from
``tests/pool_app.py``: it receives an argument of the given size (MiB) and returns a
result of the same size. Each run enqueues one job through ``Client`` and waits for
its completion with a summary listing (which never carries the payload, so the wait
adds no payload traffic). Reported per size and store: wall time (median), and the CPU
seconds per job of the main and of the worker with its child (from ``/proc``). Runs on
a SQLite file in a temporary directory and, unless ``--no-postgres``, on PostgreSQL in a
throwaway database. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.harness import usage  # noqa: E402
from broker.client.client import Client  # noqa: E402

MiB = 1 << 20
DEFAULT_PG_URL = os.environ.get(
    "BROKER_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _spawn(log: Path, *argv: str) -> asyncio.subprocess.Process:
    with log.open("wb") as out:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "broker.ops.cli",
            *argv,
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


async def _until_logged(log: Path, needle: str) -> None:
    """Wait (30 s at most) until ``log`` holds ``needle``."""
    deadline = time.monotonic() + 30.0
    while needle not in (text := await asyncio.to_thread(log.read_text, errors="replace")):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{log.name} never logged {needle!r}:\n{text}")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def _broker(url: str, work: Path) -> AsyncIterator[tuple[int, int, int]]:
    """A main and a worker on ``url``; yields (port, main pid, worker pid)."""
    port = _free_port()
    main = await _spawn(work / "main.log", "main", "--database-url", url, "--port", str(port))
    worker = None
    try:
        await _until_logged(work / "main.log", "broker-main listening on")
        worker = await _spawn(
            work / "worker.log",
            *("worker", "--main", f"127.0.0.1:{port}", "--app", "tests.pool_app"),
            *("--inline-concurrency", "0", "--forked-concurrency", "0"),
            *("--pooled-runner-count", "1"),
        )
        await _until_logged(work / "worker.log", "connected to main")
        yield port, main.pid, worker.pid
    finally:
        for proc in (worker, main):
            if proc is not None and proc.returncode is None:
                proc.terminate()
                await proc.wait()


async def _one(client: Client, blob: str, size: int) -> float:
    started = time.perf_counter()
    made = await client.enqueue("tests.pool_app.echo_blob", [blob, size])
    while True:
        page = await client.list_jobs(limit=1)
        [job] = [j for j in page.jobs if j["id"] == str(made.job_id)] or [None]
        if job is not None and job["status"] == "completed":
            return time.perf_counter() - started
        if job is not None and job["status"] not in ("queued", "handed_off"):
            raise RuntimeError(f"the job ended {job['status']}: {job.get('last_error')}")
        await asyncio.sleep(0.01)


async def measure(url: str, sizes: list[int], runs: int) -> dict[int, tuple[float, float, float]]:
    """Per size: median wall seconds, main CPU s per job, worker+child CPU s per job."""
    out: dict[int, tuple[float, float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        async with (
            _broker(url, Path(tmp)) as (port, main_pid, worker_pid),
            Client("127.0.0.1", port) as client,
        ):
            await _one(client, "warm-up", 10)
            for size in sizes:
                blob = os.urandom(size * MiB // 2).hex()
                walls = []
                main0, worker0 = usage([main_pid]).tree_cpu, usage([worker_pid]).tree_cpu
                for _ in range(runs):
                    walls.append(await _one(client, blob, size * MiB))
                main1, worker1 = usage([main_pid]).tree_cpu, usage([worker_pid]).tree_cpu
                out[size] = (
                    statistics.median(walls),
                    (main1 - main0) / runs,
                    (worker1 - worker0) / runs,
                )
    return out


@contextlib.asynccontextmanager
async def _pg_database(base_url: str) -> AsyncIterator[str]:
    import asyncpg  # type: ignore[import-untyped]
    from sqlalchemy.engine import make_url

    base = make_url(base_url)
    admin = base.set(drivername="postgresql", database="postgres").render_as_string(False)
    name = f"broker_bench_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(admin)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    try:
        yield base.set(database=name).render_as_string(False)
    finally:
        conn = await asyncpg.connect(admin)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()


async def amain(args: argparse.Namespace) -> None:
    sizes = [int(s) for s in args.sizes.split(",")]
    results: dict[str, dict[int, tuple[float, float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        results["SQLite"] = await measure(f"sqlite+aiosqlite:///{tmp}/bench.db", sizes, args.runs)
    if not args.no_postgres:
        async with _pg_database(args.postgres_url) as url:
            results["PostgreSQL"] = await measure(url, sizes, args.runs)
    print(f"{args.runs} runs per size, one job at a time, Python {sys.version.split()[0]}\n")
    print(
        "| store | argument and result | enqueue to completion (median) | main CPU / job "
        "| worker + child CPU / job |"
    )
    print("|---|---:|---:|---:|---:|")
    for store, by_size in results.items():
        for size, (wall, main_cpu, worker_cpu) in by_size.items():
            print(
                f"| {store} | {size} MiB each | {wall * 1000:.0f} ms | {main_cpu * 1000:.0f} ms "
                f"| {worker_cpu * 1000:.0f} ms |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,10", help="MiB, comma-separated")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--postgres-url", default=DEFAULT_PG_URL)
    parser.add_argument("--no-postgres", action="store_true")
    asyncio.run(amain(parser.parse_args()))


if __name__ == "__main__":
    main()
