"""The SHA-256 beside each offloaded value in the SQL stores (schema version 14), on a
SQLite file and on PostgreSQL: a store written before it gets its digests from the
migration, a row left without one fails its check, and the digest is the text's."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from adapters.sql import SQLAlchemyAdapter
from broker.jobs import Claim, JobSpec, JobStatus
from broker.payload import DEFAULT_OFFLOAD_BYTES
from broker.storage import INTEGRITY_ERROR, PayloadIntegrityError, payload_digest
from tests.conftest import drop_schema, fresh_schema_name, require_postgres

BIG = "z" * (DEFAULT_OFFLOAD_BYTES + 1)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def store_at(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[str, str | None]]:
    """A store's URL and schema (``None`` on SQLite), dropped afterwards."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'broker.db'}", None
        return
    url, schema = require_postgres(), fresh_schema_name()
    try:
        yield url, schema
    finally:
        await drop_schema(schema)


def _sql(store: SQLAlchemyAdapter, text: str) -> sa.TextClause:
    return sa.text(text.format(s=f'"{store._schema}".' if store._schema else ""))


async def _digests(store: SQLAlchemyAdapter) -> list[tuple[str, str | None]]:
    async with store._read("test") as conn:
        rows = await conn.execute(_sql(store, "SELECT body, digest FROM {s}broker_payloads"))
        return [(body, digest) for body, digest in rows]


async def test_a_store_written_before_digests_gets_them_from_its_migration(
    store_at: tuple[str, str | None],
) -> None:
    url, schema = store_at
    old = SQLAlchemyAdapter(url, schema=schema)
    await old.setup()
    job = (await old.enqueue(JobSpec(task="t", args=[BIG], kwargs={"k": BIG}))).job
    await old.enqueue_many([JobSpec(task="t", args=[BIG, i]) for i in range(19)])  # 2 rounds

    # The store as version 13 left it: no digest column (nor the later trace context and
    # rate key).
    async def in_transaction(conn: AsyncConnection) -> None:
        await conn.execute(_sql(old, "ALTER TABLE {s}broker_payloads DROP COLUMN digest"))
        await conn.execute(_sql(old, "ALTER TABLE {s}broker_jobs DROP COLUMN trace_context"))
        await conn.execute(_sql(old, "ALTER TABLE {s}broker_jobs DROP COLUMN rate_key"))
        await conn.execute(_sql(old, "UPDATE {s}broker_schema SET version = 13"))

    await old._write("test", in_transaction)
    await old.close()

    store = SQLAlchemyAdapter(url, schema=schema)
    try:
        await store.setup()  # migrates 13 -> 15
        stored = await _digests(store)
        assert len(stored) == 21
        assert all(digest == payload_digest(body) for body, digest in stored), "backfilled"
        claimed = await store.mark_handed_off(job.id, uuid.uuid4(), "w")
        assert claimed is not None and claimed.args == (BIG,) and claimed.kwargs == {"k": BIG}
        assert claimed.trace_context is None, "a row from before version 15 carries none"
        carried = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
        after = await store.enqueue(JobSpec(task="t", trace_context=carried))
        stored_job = await store.get_job(after.job.id)
        assert stored_job is not None and stored_job.trace_context == carried
    finally:
        await store.close()


async def test_a_payload_without_its_digest_fails_its_check(
    store_at: tuple[str, str | None],
) -> None:
    url, schema = store_at
    store = SQLAlchemyAdapter(url, schema=schema)
    await store.setup()
    try:
        job = (await store.enqueue(JobSpec(task="t", args=[BIG]))).job
        [(body, digest)] = await _digests(store)
        assert digest == payload_digest(body), "every writer stores the digest"

        await store._write(
            "test",
            lambda conn: conn.execute(_sql(store, "UPDATE {s}broker_payloads SET digest = NULL")),
        )
        with pytest.raises(PayloadIntegrityError, match="has no SHA-256"):
            await store.get_job(job.id)
        lease = uuid.uuid4()
        assert await store.mark_handed_off_many([Claim(job.id, lease, "w")]) == []
        [dead] = (await store.list_jobs(include_payload=False)).jobs
        assert dead.status is JobStatus.FAILED and dead.handoff_id == lease
        assert dead.last_error is not None and dead.last_error.startswith(INTEGRITY_ERROR)
    finally:
        await store.close()


async def test_a_main_starts_beside_a_running_job_whose_payload_fails_its_check(
    store_at: tuple[str, str | None],
) -> None:
    """A handed-off job's offloaded value edited while the main was down: the restarted
    main loads its handoffs without their payloads, so it starts and holds the lease."""
    from broker.main.main import Main, MainSettings
    from tests.support import FAST

    url, schema = store_at
    store = SQLAlchemyAdapter(url, schema=schema)
    await store.setup()
    job = (await store.enqueue(JobSpec(task="t", args=[BIG]))).job
    lease = uuid.uuid4()
    assert await store.mark_handed_off(job.id, lease, "away") is not None

    await store._write(
        "test", lambda conn: conn.execute(_sql(store, "UPDATE {s}broker_payloads SET body = '[1]'"))
    )
    main = Main(store, MainSettings(**{**FAST.__dict__, "orphan_grace": 30}), retention=None)
    try:
        await main.start()
        assert main.handoff.orphans[lease].id == job.id
    finally:
        await main.stop()
        await store.close()
