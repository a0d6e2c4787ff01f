"""Storage micro-benchmark: how fast the SQL adapter enqueues, claims and completes.

    .venv/bin/python bench/storage_bench.py [--postgres-url URL] [--n 2000] [--no-postgres]

Runs on a SQLite file in a temporary directory and, when reachable, on PostgreSQL (in a
throwaway schema that is dropped afterwards), then prints a Markdown table of
operations per second. "one at a time" awaits each call before the next, as a single
dispatcher would; "batch of 50" uses ``enqueue_many`` / ``mark_handed_off_many`` with
50 items per call; batched completions use ``settle_many``, the group commit the
main uses for worker reports.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlalchemy as sa

from adapters.sql import SQLAlchemyAdapter
from broker.jobs import Claim, ExecutionMode, Job, JobSpec, Outcome, Settlement

BATCH = 50
DEFAULT_PG_URL = os.environ.get(
    "BROKER_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
)
ROWS = [
    "enqueue, one at a time",
    f"enqueue, batch of {BATCH}",
    "claim, one at a time",
    f"claim, batch of {BATCH}",
    "fenced complete, one at a time",
    f"fenced complete, batch of {BATCH} (settle_many)",
    f"select_eligible(limit={BATCH})",
]


def _specs(n: int, tag: str) -> list[JobSpec]:
    return [JobSpec(task="bench.noop", args=[i], queue=tag) for i in range(n)]


async def _timed(n: int, body: Callable[[], Awaitable[None]]) -> float:
    started = time.perf_counter()
    await body()
    return n / (time.perf_counter() - started)


async def _enqueued(store: SQLAlchemyAdapter, n: int, tag: str) -> list[Job]:
    jobs: list[Job] = []
    specs = _specs(n, tag)
    for i in range(0, n, 500):
        jobs.extend(r.job for r in await store.enqueue_many(specs[i : i + 500]))
    return jobs


async def _bench_enqueue(store: SQLAlchemyAdapter, n: int, out: dict[str, float]) -> None:
    async def single() -> None:
        for spec in _specs(n, "e1"):
            await store.enqueue(spec)

    async def batched() -> None:
        specs = _specs(n, "eb")
        for i in range(0, n, BATCH):
            await store.enqueue_many(specs[i : i + BATCH])

    out[ROWS[0]] = await _timed(n, single)
    out[ROWS[1]] = await _timed(n, batched)


async def _bench_claims(
    store: SQLAlchemyAdapter, n: int, out: dict[str, float]
) -> tuple[list[Job], list[Job]]:
    """Claims on jobs made for them (their own queues keep the phases apart)."""
    single_jobs = await _enqueued(store, n, "c1")
    batch_jobs = await _enqueued(store, n, "cb")
    one: list[Job] = []
    many: list[Job] = []

    async def single() -> None:
        for job in single_jobs:
            got = await store.mark_handed_off(job.id, uuid.uuid4(), "bench-worker")
            assert got is not None
            one.append(got)

    async def batched() -> None:
        for i in range(0, n, BATCH):
            chunk = batch_jobs[i : i + BATCH]
            got = await store.mark_handed_off_many(
                [Claim(j.id, uuid.uuid4(), "bench-worker") for j in chunk]
            )
            assert len(got) == len(chunk)
            many.extend(got)

    out[ROWS[2]] = await _timed(n, single)
    out[ROWS[3]] = await _timed(n, batched)
    return one, many


async def _bench_completions(
    store: SQLAlchemyAdapter, one: list[Job], many: list[Job], out: dict[str, float]
) -> None:
    async def single() -> None:
        for job in one:
            assert await store.complete(job.id, job.handoff_id or uuid.uuid4(), None)

    async def batched() -> None:
        for i in range(0, len(many), BATCH):
            done = await store.settle_many(
                [
                    Settlement(j.id, j.handoff_id or uuid.uuid4(), Outcome.COMPLETE, {"i": 1})
                    for j in many[i : i + BATCH]
                ]
            )
            assert all(done)

    out[ROWS[4]] = await _timed(len(one), single)
    out[ROWS[5]] = await _timed(len(many), batched)


async def _bench_select(store: SQLAlchemyAdapter, n: int, out: dict[str, float]) -> None:
    """Selection with 2n queued jobs in the store (left by the enqueue phase).

    On PostgreSQL the table is ANALYZEd first, as autovacuum would have done by now in
    a running system; on a never-analyzed table the planner guesses it is empty.
    """
    selects = max(50, n // 10)
    if store.capabilities.skip_locked:  # PostgreSQL
        await store._write(
            "analyze", lambda conn: conn.execute(sa.text(f'ANALYZE "{store._schema}".broker_jobs'))
        )

    async def select() -> None:
        for _ in range(selects):
            await store.select_eligible(modes=[ExecutionMode.POOLED], limit=BATCH)

    out[ROWS[6]] = await _timed(selects, select)


async def _run(store: SQLAlchemyAdapter, n: int) -> dict[str, float]:
    out: dict[str, float] = {}
    await _bench_enqueue(store, n, out)
    one, many = await _bench_claims(store, n, out)
    await _bench_completions(store, one, many, out)
    await _bench_select(store, n, out)
    return out


async def _bench_sqlite(n: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        store = SQLAlchemyAdapter(f"sqlite+aiosqlite:///{tmp}/bench.db")
        try:
            await store.setup()
            return await _run(store, n)
        finally:
            await store.close()


async def _bench_postgres(url: str, n: int) -> dict[str, float]:
    schema = f"broker_bench_{uuid.uuid4().hex[:10]}"
    store = SQLAlchemyAdapter(url, schema=schema)
    try:
        await store.setup()
        return await _run(store, n)
    finally:
        await store.close()
        import asyncpg

        dsn = url.replace("postgresql+asyncpg://", "postgresql://", 1)
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await conn.close()


def _table(columns: dict[str, dict[str, float] | str]) -> str:
    names = list(columns)
    lines = [
        "| operation | " + " | ".join(f"{name} (ops/s)" for name in names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for row in ROWS:
        cells = []
        for name in names:
            result = columns[name]
            cells.append(result if isinstance(result, str) else f"{result[row]:,.0f}")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--postgres-url", default=DEFAULT_PG_URL)
    parser.add_argument("--n", type=int, default=2000, help="operations per measurement")
    parser.add_argument("--no-postgres", action="store_true", help="SQLite only")
    args = parser.parse_args(argv)
    n = max(BATCH, args.n // BATCH * BATCH)
    columns: dict[str, dict[str, float] | str] = {}
    columns["SQLite (WAL, synchronous=FULL)"] = await _bench_sqlite(n)
    if not args.no_postgres:
        try:
            columns["PostgreSQL"] = await _bench_postgres(args.postgres_url, n)
        except Exception as exc:
            print(f"PostgreSQL skipped: {type(exc).__name__}: {exc}", file=sys.stderr)
            columns["PostgreSQL"] = "n/a"
    print(f"n = {n} operations per row, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs\n")
    print(_table(columns))


if __name__ == "__main__":
    asyncio.run(main())
