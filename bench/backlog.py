"""Cost against backlog depth and key count, at the store (issue 35, items 2 and 3).

    .venv/bin/python -m bench.backlog [--stores postgres,sqlite] [--due 0,100000,300000]
        [--future 300000] [--drain 3000] [--keys 1000,30000] [--plans]

For each store (a throwaway PostgreSQL schema, a SQLite file in a temporary directory)
and each depth, the backlog is enqueued first through ``enqueue_many`` (the direct path
another process takes: the dispatcher gets no hand-over), then measured:

- ``drain /s``: the dispatcher's store work per job, one pass after another as fast as
  they go: ``select_eligible`` (limit 50), ``mark_handed_off_many``, ``settle_many``
  (complete), for ``--drain`` jobs;
- ``pass ms``: an idle dispatcher's pass after one job is enqueued (the enqueue →
  start latency the store adds): ``next_run_at``, ``select_eligible``, the claim;
  median of 50;
- ``start-up ms``: the store reads of a main starting over that backlog (``setup`` on
  a new adapter, the orphans' read, ``next_run_at``, the first ``select_eligible``);
- with ``--future``: the same with that many jobs scheduled a day ahead besides.

``--keys``: drains of ``--drain`` jobs with a concurrency key (limit 1) spread over that
many distinct keys, and an enqueue of ``--drain`` jobs with unique keys while that many
other unique keys are held.

``--plans`` prints the PostgreSQL plans (``EXPLAIN ANALYZE``) of the eligible read, the
next-run read and the orphans' read at each depth.

This runs the store alone, not the main and its workers: it isolates what grows with
the backlog. There is no PgQueuer column here; PgQueuer's depth curve is in issue 35
(flat from 0 to 1M). Figures on the shared 2-core machine vary by tens of percent
between runs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import asyncpg  # type: ignore[import-untyped]

from adapters.sql import SQLAlchemyAdapter
from bench.storage_bench import DEFAULT_PG_URL
from broker.jobs import Claim, ExecutionMode, JobSpec, JobStatus, Outcome, Settlement
from broker.storage import JobFilter

BATCH = 50
FILL = 5000
WORKER = "bench-worker"
POOLED = [ExecutionMode.POOLED]


async def _fill(store: SQLAlchemyAdapter, n: int, *, run_at: datetime | None = None) -> None:
    for start in range(0, n, FILL):
        specs = [
            JobSpec(task="bench.noop", args=[i], run_at=run_at)
            for i in range(start, min(n, start + FILL))
        ]
        await store.enqueue_many(specs)


async def _drain(store: SQLAlchemyAdapter, n: int) -> float:
    """Jobs per second through the dispatcher's store calls, ``n`` jobs."""
    done = 0
    started = time.perf_counter()
    while done < n:
        jobs = await store.select_eligible(modes=POOLED, limit=min(BATCH, n - done))
        if not jobs:
            break
        claimed = await store.mark_handed_off_many(
            [Claim(j.id, uuid.uuid4(), WORKER) for j in jobs]
        )
        await store.settle_many(
            [
                Settlement(j.id, j.handoff_id or uuid.uuid4(), Outcome.COMPLETE, None)
                for j in claimed
            ]
        )
        done += len(claimed)
    return done / (time.perf_counter() - started)


async def _pass_ms(store: SQLAlchemyAdapter, rounds: int = 50) -> float:
    """Median ms of an idle dispatcher's pass for one fresh job (settled after)."""
    times = []
    for _ in range(rounds):
        job = (await store.enqueue(JobSpec(task="bench.noop", priority=5))).job
        started = time.perf_counter()
        await store.next_run_at(modes=POOLED)
        jobs = await store.select_eligible(modes=POOLED, limit=BATCH)
        assert any(j.id == job.id for j in jobs)
        [claimed] = await store.mark_handed_off_many([Claim(job.id, uuid.uuid4(), WORKER)])
        times.append(time.perf_counter() - started)
        await store.settle_many(
            [Settlement(job.id, claimed.handoff_id or uuid.uuid4(), Outcome.COMPLETE, None)]
        )
    return statistics.median(times) * 1000


async def _start_up_ms(url: str, schema: str | None) -> float:
    """The store reads of a main starting: a new adapter's setup, the orphans, the
    next run time and the first eligible read."""
    started = time.perf_counter()
    store = SQLAlchemyAdapter(url, schema=schema) if schema else SQLAlchemyAdapter(url)
    try:
        await store.setup()
        cursor = None
        while True:
            page = await store.list_jobs(
                JobFilter(statuses=[JobStatus.HANDED_OFF]),
                limit=1000,
                cursor=cursor,
                include_payload=False,
            )
            cursor = page.next_cursor
            if cursor is None:
                break
        await store.next_run_at(modes=POOLED)
        await store.select_eligible(modes=POOLED, limit=BATCH)
        return (time.perf_counter() - started) * 1000
    finally:
        await store.close()


async def _analyze(url: str, schema: str) -> None:
    """What autovacuum would have done by now in a running system."""
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://", 1))
    try:
        await conn.execute(f'ANALYZE "{schema}".broker_jobs')
    finally:
        await conn.close()


async def _plans(url: str, schema: str) -> None:
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://", 1))
    try:
        await conn.execute(f'SET search_path = "{schema}"')
        await conn.execute("SET plan_cache_mode = force_generic_plan")
        await conn.execute("SET jit = off")  # as the hot pool's sessions (HotPool)
        from adapters.sql.postgres_sql import HotSql

        sql = HotSql(schema)
        now = int(time.time() * 1_000_000)
        reads = {
            "eligible": (sql.eligible, ["pooled"], now, BATCH, [], None),
            "next_run": (sql.next_run, ["pooled"]),
            "orphans": (
                "SELECT id FROM broker_jobs WHERE status IN ('handed_off') "
                "ORDER BY created_us DESC, id DESC LIMIT 1001",
            ),
        }
        for name, (statement, *args) in reads.items():
            rows = await conn.fetch("EXPLAIN (ANALYZE, BUFFERS) " + statement, *args)
            print(f"--- {name}")
            print("\n".join(r[0] for r in rows))
    finally:
        await conn.close()


async def _depth_row(
    url: str, schema: str | None, due: int, future: int, drain: int, plans: bool
) -> dict[str, float]:
    store = SQLAlchemyAdapter(url, schema=schema) if schema else SQLAlchemyAdapter(url)
    try:
        await store.setup()
        await _fill(store, due + drain)
        if future:
            await _fill(store, future, run_at=datetime.now(UTC) + timedelta(days=1))
        if schema is not None:
            await _analyze(url, schema)
        row = {"drain /s": await _drain(store, drain)}
        if plans and schema is not None:
            await _plans(url, schema)  # after the drain: what an idle dispatcher's pass reads
        row["pass ms"] = await _pass_ms(store)
    finally:
        await store.close()
    row["start-up ms"] = await _start_up_ms(url, schema)
    return row


async def _keys_row(url: str, schema: str | None, keys: int, drain: int) -> dict[str, float]:
    store = SQLAlchemyAdapter(url, schema=schema) if schema else SQLAlchemyAdapter(url)
    try:
        await store.setup()
        specs = [
            JobSpec(task="bench.noop", concurrency_key=f"k{i % keys}", concurrency_limit=1)
            for i in range(drain)
        ]
        for start in range(0, drain, FILL):
            await store.enqueue_many(specs[start : start + FILL])
        rate = await _drain(store, drain)
        held = [JobSpec(task="bench.noop", queue="held", unique_key=f"h{i}") for i in range(keys)]
        await _fill_specs(store, held)
        fresh = [JobSpec(task="bench.noop", unique_key=f"u{i}") for i in range(drain)]
        started = time.perf_counter()
        await _fill_specs(store, fresh, batch=BATCH)
        unique = drain / (time.perf_counter() - started)
        return {"keyed drain /s": rate, "unique enqueue /s": unique}
    finally:
        await store.close()


async def _fill_specs(
    store: SQLAlchemyAdapter, specs: Sequence[JobSpec], batch: int = FILL
) -> None:
    for start in range(0, len(specs), batch):
        await store.enqueue_many(specs[start : start + batch])


class _Target:
    def __init__(self, kind: str, pg_url: str) -> None:
        self.kind = kind
        self.pg_url = pg_url
        self._dirs: list[tempfile.TemporaryDirectory[str]] = []
        self._schemas: list[str] = []

    def fresh(self) -> tuple[str, str | None]:
        if self.kind == "sqlite":
            tmp = tempfile.TemporaryDirectory()
            self._dirs.append(tmp)
            return f"sqlite+aiosqlite:///{tmp.name}/bench.db", None
        schema = f"broker_backlog_{uuid.uuid4().hex[:10]}"
        self._schemas.append(schema)
        return self.pg_url, schema

    async def cleanup(self) -> None:
        for tmp in self._dirs:
            tmp.cleanup()
        if self._schemas:
            dsn = self.pg_url.replace("postgresql+asyncpg://", "postgresql://", 1)
            conn = await asyncpg.connect(dsn)
            try:
                for schema in self._schemas:
                    await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            finally:
                await conn.close()


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default="postgres,sqlite")
    parser.add_argument("--postgres-url", default=DEFAULT_PG_URL)
    parser.add_argument("--due", type=_ints, default=[0, 100_000, 300_000])
    parser.add_argument("--future", type=int, default=300_000)
    parser.add_argument("--drain", type=int, default=3000)
    parser.add_argument("--keys", type=_ints, default=[1000, 30_000])
    parser.add_argument("--plans", action="store_true")
    args = parser.parse_args(argv)
    for kind in args.stores.split(","):
        target = _Target(kind, args.postgres_url)
        try:
            print(f"\n## {kind}\n")
            print("| backlog | drain /s | pass ms | start-up ms |\n|---|---:|---:|---:|")
            shapes = [(d, 0) for d in args.due] + ([(0, args.future)] if args.future else [])
            for due, future in shapes:
                url, schema = target.fresh()
                label = f"{due:,} due" + (f" + {future:,} future" if future else "")
                if args.plans:
                    print(f"\n<!-- {label} -->")
                row = await _depth_row(url, schema, due, future, args.drain, args.plans)
                print(
                    f"| {label} | {row['drain /s']:,.0f} | {row['pass ms']:.2f} "
                    f"| {row['start-up ms']:,.0f} |",
                    flush=True,
                )
            print("\n| distinct keys | keyed drain /s | unique enqueue /s |\n|---|---:|---:|")
            for keys in args.keys:
                url, schema = target.fresh()
                row = await _keys_row(url, schema, keys, args.drain)
                print(
                    f"| {keys:,} | {row['keyed drain /s']:,.0f} "
                    f"| {row['unique enqueue /s']:,.0f} |",
                    flush=True,
                )
        finally:
            await target.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
