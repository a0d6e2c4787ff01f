"""Schema version 3: the key indexes leave keyless rows out, and a version-2 store is
carried forward with its jobs and its keys still enforced (SQLite and PostgreSQL)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from adapters.sql import SQLAlchemyAdapter
from adapters.sql import schema as _sql_schema
from adapters.sql.rows import new_row
from broker.jobs import Job, JobSpec, new_job_fields
from broker.storage import SCHEMA_VERSION
from tests.conftest import drop_schema, fresh_schema_name, require_postgres

KEY_INDEXES = (_sql_schema.IDEMPOTENCY_INDEX, _sql_schema.UNIQUE_ACTIVE_INDEX)


@pytest.fixture(params=["sqlite", "postgres"])
async def target(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[str, str | None]]:
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'v2.db'}", None
        return
    schema = fresh_schema_name()
    yield require_postgres(), schema
    await drop_schema(schema)


async def _index_sql(store: SQLAlchemyAdapter) -> dict[str, str]:
    """Each key index's definition as the database itself reports it."""
    if store._schema is None:
        query = sa.text("SELECT name, sql FROM sqlite_master WHERE type = 'index'")
    else:
        query = sa.text(
            "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = :s"
        ).bindparams(s=store._schema)
    async with store._read("test") as conn:
        rows = (await conn.execute(query)).all()
    return {name: sql for name, sql in rows if name in KEY_INDEXES}


async def test_a_version_2_store_is_carried_to_version_3(target: tuple[str, str | None]) -> None:
    url, schema = target
    old = SQLAlchemyAdapter(url, schema=schema)

    def create_v2(conn: sa.Connection) -> None:
        if schema is not None:
            conn.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
        _sql_schema._v1_initial(conn, schema)
        _sql_schema._v2_unique_key(conn, schema)
        conn.execute(_sql_schema.schema_version.update().values(version=2))

    try:
        await old._write("test", lambda conn: conn.run_sync(create_v2))
        before = await _index_sql(old)
        assert before and not any("NOT NULL" in sql.upper() for sql in before.values())
    finally:
        await old.close()
    # A version-2 store with jobs of every kind of key in it, written the version-2 way
    # (only the columns version 2 has: later versions add their own).
    v2_jobs = _sql_schema._define(sa.MetaData(), 2)[0]
    now = datetime.now(UTC).replace(microsecond=0)
    specs = [
        JobSpec(task="t", idempotency_key="idem-1"),
        JobSpec(task="t", unique_key="u-1"),
        JobSpec(task="t"),
    ]
    v2 = SQLAlchemyAdapter(url, schema=schema)
    try:

        async def in_transaction(conn: AsyncConnection) -> None:
            for spec in specs:
                row = new_row(new_job_fields(spec, now))
                await conn.execute(
                    v2_jobs.insert().values(
                        {c.name: row.get(c.name) for c in v2_jobs.c if c.name != "seq"}
                    )
                )

        await v2._write("test", in_transaction)
    finally:
        await v2.close()
    keyed, unique, plain = (Job.from_spec(spec, now) for spec in specs)

    store = SQLAlchemyAdapter(url, schema=schema)
    try:
        await store.setup()  # migrates 2 -> 3 (and on to the current version)
        async with store._read("test") as conn:
            version = (await conn.execute(sa.select(_sql_schema.schema_version.c.version))).scalar()
        assert version == SCHEMA_VERSION >= 3
        after = await _index_sql(store)
        assert set(after) == set(KEY_INDEXES)
        assert all("NOT NULL" in sql.upper() for sql in after.values()), after
        for job in (keyed, unique, plain):
            assert await store.get_job(job.id) == job
        again = await store.enqueue(JobSpec(task="t", idempotency_key="idem-1"))
        assert again.duplicate and again.job.id == keyed.id
        held = await store.enqueue(JobSpec(task="t", unique_key="u-1"))
        assert held.duplicate and held.job.id == unique.id
        fresh = await store.enqueue_many([JobSpec(task="t"), JobSpec(task="t")])
        assert not any(r.duplicate for r in fresh), "keyless jobs never collide"
        await store.setup()  # already current: nothing runs twice
    finally:
        await store.close()


async def test_the_raw_unique_index_still_refuses_a_second_active_holder(
    target: tuple[str, str | None],
) -> None:
    url, schema = target
    store = SQLAlchemyAdapter(url, schema=schema)
    try:
        await store.setup()
        first = (await store.enqueue(JobSpec(task="t", unique_key="u"))).job
        other = (await store.enqueue(JobSpec(task="t"))).job
        jobs = _sql_schema.jobs
        with pytest.raises(sa.exc.IntegrityError):
            async with store._engine.begin() as conn:
                await conn.execute(
                    sa.update(jobs).where(jobs.c.id == other.id).values(unique_key="u")
                )
        assert (await store.get_job(first.id)) == first
    finally:
        await store.close()
