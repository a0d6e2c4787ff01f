"""After a bulk insert the PostgreSQL store refreshes planner statistics, so dispatch
reads its index in order instead of sorting every queued row."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import asyncpg

from adapters.sql import SQLAlchemyAdapter
from broker.jobs import ExecutionMode, JobSpec
from tests.conftest import drop_schema, fresh_schema_name, require_postgres


async def test_a_bulk_enqueue_refreshes_statistics_and_dispatch_uses_the_index() -> None:
    url = require_postgres()
    schema = fresh_schema_name()
    store = SQLAlchemyAdapter(url, schema=schema)
    dsn = url.replace("postgresql+asyncpg://", "postgresql://", 1)
    conn = await asyncpg.connect(dsn)
    try:
        await store.setup()
        await store.enqueue_many([JobSpec(task="t.x") for _ in range(600)])

        async def analyzed() -> bool:
            count = await conn.fetchval(
                "SELECT analyze_count FROM pg_stat_user_tables "
                "WHERE schemaname = $1 AND relname = 'broker_jobs'",
                schema,
            )
            return bool(count)

        for _ in range(100):
            if await analyzed():
                break
            await asyncio.sleep(0.05)
        assert await analyzed(), "no ANALYZE after a bulk insert"
        from adapters.sql.postgres_sql import HotSql

        # Dispatch's own read (modes, now, limit, skipped ids, tasks), as its session
        # plans it: with any task, and with the tasks the connected workers declared.
        await conn.execute("SET plan_cache_mode = force_generic_plan")
        explain = "EXPLAIN " + HotSql(schema).eligible
        for tasks in (None, ["t.x", "u"]):
            found = await conn.fetch(explain, ["pooled"], 2**62, 20, [], tasks, None, None)
            plan = "\n".join(r[0] for r in found)
            assert "Index Scan using ix_broker_jobs_dispatch" in plan, plan
        # Each mode's rows come from the index in order, under their own limit: only
        # those few are sorted (above it), never the queued rows.
        per_mode = plan.split("Index Scan using ix_broker_jobs_dispatch")[0].rsplit("Limit", 1)
        assert len(per_mode) == 2 and "Sort" not in per_mode[1], plan
    finally:
        await conn.close()
        await store.close()
        await drop_schema(schema)


async def test_a_read_for_a_mode_without_queued_jobs_walks_no_other_modes_rows() -> None:
    """Dispatch reads each mode with free slots; a mode with nothing queued must come
    back empty from the index alone, not after walking the other modes' backlog."""
    async with _planning_store() as (store, conn, schema):
        await store.enqueue_many([JobSpec(task="t.x") for _ in range(600)])  # all pooled
        await conn.execute(f'ANALYZE "{schema}".broker_jobs')
        eligible = store._dialect._sql.eligible
        statement = await conn.prepare("EXPLAIN (ANALYZE, COSTS OFF) " + eligible)
        lines = [r[0] for r in await statement.fetch(["forked"], 2**62, 20, [], None, None, None)]
        plan = "\n".join(lines)
        assert "Index Cond: ((execution_mode = m.mode)" in plan, plan
        # The one row a filter may remove is the priority levels' walk ending (its NULL
        # level, in the recursive CTE's work table), never a job of another mode.
        nodes = [line for line in lines if "->" in line or "Rows Removed by Filter" in line]
        removed_under = [
            nodes[i - 1] for i, line in enumerate(nodes) if "Rows Removed by Filter" in line
        ]
        assert all("WorkTable Scan on lv" in node for node in removed_under), plan
        everything = await store.select_eligible(
            modes=[ExecutionMode.FORKED, ExecutionMode.POOLED], limit=5
        )
        assert [j.execution_mode for j in everything] == [ExecutionMode.POOLED] * 5


async def test_the_eligible_read_walks_only_the_priority_levels_it_needs() -> None:
    """Jobs at 200 priority levels, 5 due at each: a read of 20 probes the top levels
    until it holds 20 jobs (4 levels, and the next one's probe), not all 200 at every
    pass, and returns the best 20 in dispatch order."""
    async with _planning_store() as (store, conn, schema):
        specs = [JobSpec(task="t.x", priority=level) for level in range(200) for _ in range(5)]
        await store.enqueue_many(specs)
        await conn.execute(f'ANALYZE "{schema}".broker_jobs')
        eligible = store._dialect._sql.eligible
        statement = await conn.prepare("EXPLAIN (ANALYZE, COSTS OFF) " + eligible)
        lines = [r[0] for r in await statement.fetch(["pooled"], 2**62, 20, [], None, None, None)]
        walked = [line for line in lines if "Recursive Union" in line]
        assert len(walked) == 1, lines
        levels = int(walked[0].split("rows=")[1].split()[0])
        assert levels <= 6, "\n".join(lines)
        read = await store.select_eligible(modes=[ExecutionMode.POOLED], limit=20)
        assert [job.priority for job in read] == [p for p in (199, 198, 197, 196) for _ in range(5)]


@contextlib.asynccontextmanager
async def _planning_store() -> AsyncIterator[tuple[SQLAlchemyAdapter, asyncpg.Connection, str]]:
    """A store in a schema of its own, set up, and a connection that plans as the main's
    hot pool does (generic plans); both closed and the schema dropped after."""
    url = require_postgres()
    schema = fresh_schema_name()
    store = SQLAlchemyAdapter(url, schema=schema)
    dsn = url.replace("postgresql+asyncpg://", "postgresql://", 1)
    conn = await asyncpg.connect(dsn, server_settings={"plan_cache_mode": "force_generic_plan"})
    try:
        await store.setup()
        yield store, conn, schema
    finally:
        await conn.close()
        await store.close()
        await drop_schema(schema)
