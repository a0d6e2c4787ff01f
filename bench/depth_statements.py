"""What each dispatcher statement costs PostgreSQL per job, over an empty table and over a
due backlog (issue 35 item 2; bench/README.md, "Flat in backlog depth: where a due
backlog's time goes").

    .venv/bin/python -m bench.depth_statements [--due 1000000] [--jobs 20000]
        [--claim 20] [--read 200] [--postgres-url URL]

For each shape (no backlog, then ``--due`` jobs due now at priority -1, made as
``bench.scale`` makes them: one job enqueued, ``INSERT ... SELECT`` of the copies,
``VACUUM ANALYZE`` and a ``CHECKPOINT``), a fresh database gets ``--jobs`` measured jobs
(priority 0) through ``enqueue_many``; then one session drains them with the main's own
statements (``HotSql``: the eligible read of ``--read``, claims and completions of
``--claim`` jobs), each run under ``EXPLAIN (ANALYZE, BUFFERS, WAL)`` with the hot pool's
session settings (generic plans, no JIT). Printed per job and statement: buffers hit,
read (not in shared_buffers), dirtied, written, WAL records, full-page images and bytes,
execution ms; and per index of ``broker_jobs`` its blocks read and hit
(``pg_statio_user_indexes``, read after the session closed, so its counters are
flushed). These are the server's figures for this session's statements alone, which
the whole-server CPU of ``bench.scale`` (other sessions' queries included) is not.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import time
import uuid
from typing import Any

import asyncpg  # type: ignore[import-untyped]

from adapters.sql import SQLAlchemyAdapter
from adapters.sql.postgres_sql import HotSql
from bench.scale import _copy_rows
from bench.storage_bench import DEFAULT_PG_URL
from bench.systems import DATABASE_SUFFIX
from broker.jobs import JobSpec

FILL = 5000
"""Measured jobs per ``enqueue_many`` call."""
IO = (
    "SELECT indexrelname, idx_blks_read, idx_blks_hit FROM pg_statio_user_indexes "
    "WHERE relname = 'broker_jobs'"
)
COUNTED = re.compile(r"\b(hit|read|dirtied|written|records|fpi|bytes)=(\d+)")


def _plain(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://", 1)


async def _fresh(url: str, name: str) -> str:
    """Database ``name`` on ``url``'s server, dropped first if it was there."""
    admin = await asyncpg.connect(_plain(url))
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    return url.rsplit("/", 1)[0] + "/" + name


async def _fill(url: str, due: int, jobs: int) -> None:
    """The schema, ``due`` backlog jobs (priority -1) as bench.scale makes them, the
    ``VACUUM ANALYZE`` and ``CHECKPOINT`` it ends with, then the measured jobs."""
    store = SQLAlchemyAdapter(url)
    await store.setup()
    conn = await asyncpg.connect(_plain(url))
    try:
        if due:
            await store.enqueue_many([JobSpec(task="bench.noop", args=[-1], priority=-1)])
            template = await conn.fetchval("SELECT id FROM broker_jobs")
            await _copy_rows(conn, "broker_jobs", template, due - 1, "gen_random_uuid()")
        await conn.execute("VACUUM ANALYZE broker_jobs")
        await conn.execute("CHECKPOINT")
        for start in range(0, jobs, FILL):
            size = min(FILL, jobs - start)
            await store.enqueue_many([JobSpec(task="bench.noop", args=[-1]) for _ in range(size)])
    finally:
        await conn.close()
        await store.close()


async def _index_io(url: str) -> dict[str, tuple[int, int]]:
    conn = await asyncpg.connect(_plain(url))
    try:
        await asyncio.sleep(1.5)  # other sessions' counters reach the shared stats
        return {r[0]: (r[1], r[2]) for r in await conn.fetch(IO)}
    finally:
        await conn.close()


async def _drain(url: str, claim: int, read: int) -> dict[str, Any]:
    """The measured jobs drained statement by statement, each explained; per job."""
    before = await _index_io(url)
    conn = await asyncpg.connect(
        _plain(url), server_settings={"plan_cache_mode": "force_generic_plan", "jit": "off"}
    )
    sql = HotSql(None)
    totals: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)

    async def explained(name: str, statement: str, *args: Any) -> None:
        rows = await conn.fetch("EXPLAIN (ANALYZE, BUFFERS, WAL) " + statement, *args)
        lines = [r[0] for r in rows]
        # The first Buffers and WAL lines are the top node's: the whole statement's.
        for kind in ("Buffers:", "WAL:"):
            line = next((text for text in lines if kind in text), "")
            prefix = "wal_" if kind == "WAL:" else ""
            for key, value in COUNTED.findall(line):
                totals[name][prefix + key] += int(value)
        ms = re.search(r"Execution Time: ([\d.]+)", lines[-1])
        totals[name]["us"] += int(float(ms.group(1)) * 1000) if ms else 0

    done = 0
    try:
        while True:
            now = int(time.time() * 1_000_000)
            await explained("eligible", sql.eligible, ["pooled"], now, read, [], None, None, None)
            ids = [
                r[0]
                for r in await conn.fetch(
                    "SELECT id FROM broker_jobs WHERE status = 'queued' AND priority = 0 "
                    "ORDER BY run_at_us, created_us, seq LIMIT $1",
                    read,
                )
            ]
            if not ids:
                break
            for start in range(0, len(ids), claim):
                part = sorted(ids[start : start + claim])
                leases = [uuid.uuid4() for _ in part]
                order = list(range(1, len(part) + 1))
                workers = ["w"] * len(part)
                await explained("claim", sql.claim, part, leases, workers, now, None, order)
                results = [None] * len(part)
                await explained(
                    "settle", sql.settle_completed, part, leases, results, now, None, 1.0
                )
                done += len(part)
    finally:
        await conn.close()
    after = await _index_io(url)
    per_job = {
        name: {key: round(value / done, 3) for key, value in sorted(counts.items())}
        for name, counts in totals.items()
    }
    index = {
        name: (
            round((after[name][0] - before[name][0]) / done, 3),
            round((after[name][1] - before[name][1]) / done, 2),
        )
        for name in after
    }
    return {"jobs": done, "statements": per_job, "index_read_hit": index}


async def main(args: argparse.Namespace) -> None:
    name = "bench_depth_statements" + os.environ.get(DATABASE_SUFFIX, "")
    for due in (0, args.due):
        url = await _fresh(args.postgres_url, name)
        await _fill(url, due, args.jobs)
        result = await _drain(url, args.claim, args.read)
        print(f"--- {due:,} due: {result['jobs']:,} jobs drained")
        for statement, figures in result["statements"].items():
            print(f"{statement:9} per job: {figures}")
        print("index blocks (read, hit) per job:", result["index_read_hit"])
    admin = await asyncpg.connect(_plain(args.postgres_url))
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.depth_statements")
    parser.add_argument("--due", type=int, default=1_000_000)
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--claim", type=int, default=20)
    parser.add_argument("--read", type=int, default=200)
    parser.add_argument("--postgres-url", default=DEFAULT_PG_URL)
    asyncio.run(main(parser.parse_args()))
