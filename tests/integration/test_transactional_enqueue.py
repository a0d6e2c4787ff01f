"""``broker.enqueue_in`` / ``enqueue_in_async``: jobs in the application's own transaction.

Real stores only: a SQLite file and PostgreSQL, each reached by the application through
its own SQLAlchemy engine (a sync driver for ``Session``/``Connection``, an async one for
``AsyncSession``/``AsyncConnection``), while the broker's store reads the same tables.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import (
    DeclarativeBase,
    Mapped,
    Session,
    mapped_column,
    scoped_session,
    sessionmaker,
)

import broker
from adapters.sql import SQLAlchemyAdapter
from broker.jobs import JobSpec, JobStatus
from broker.tasks.registry import TaskRegistry, task
from tests.conftest import POSTGRES_URL, drop_schema, fresh_schema_name, require_postgres

registry = TaskRegistry()


@task(name="shop.ship", queue="shipping", retries=2, registry=registry)
def ship(order_id: int) -> None: ...


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)


@dataclass
class AppDatabase:
    sync_url: str
    async_url: str
    connect_args: dict[str, object]
    schema: str | None
    """The PostgreSQL schema of the broker's tables (the app's are elsewhere)."""
    store: SQLAlchemyAdapter


@pytest.fixture(params=["sqlite", "postgresql"])
async def app_db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[AppDatabase]:
    if request.param == "sqlite":
        path = tmp_path / "app.db"
        store = SQLAlchemyAdapter(f"sqlite+aiosqlite:///{path}")
        await store.setup()
        db = AppDatabase(f"sqlite:///{path}", f"sqlite+aiosqlite:///{path}", {}, None, store)
        _create_app_tables(db)
        try:
            yield db
        finally:
            await store.close()
        return
    url = require_postgres()
    # The app's tables in one schema (its search_path), the broker's in another: the
    # broker's schema must reach its own statements only.
    app_schema, broker_schema = fresh_schema_name(), fresh_schema_name()
    store = SQLAlchemyAdapter(url, schema=broker_schema)
    await store.setup()
    plain = url.replace("postgresql+asyncpg://", "postgresql+psycopg://", 1)
    engine = sa.create_engine(plain)
    with engine.begin() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{app_schema}"')
    engine.dispose()
    db = AppDatabase(
        plain,
        POSTGRES_URL,
        {"options": f"-csearch_path={app_schema}"},
        broker_schema,
        store,
    )
    _create_app_tables(db)
    try:
        yield db
    finally:
        await store.close()
        await drop_schema(app_schema)
        await drop_schema(broker_schema)


def _create_app_tables(db: AppDatabase) -> None:
    engine = sa.create_engine(db.sync_url, connect_args=db.connect_args)
    Base.metadata.create_all(engine)
    engine.dispose()


def _orders(db: AppDatabase) -> list[int]:
    engine = sa.create_engine(db.sync_url, connect_args=db.connect_args)
    try:
        with Session(engine) as session:
            return list(session.scalars(sa.select(Order.id).order_by(Order.id)))
    finally:
        engine.dispose()


async def test_a_session_enqueue_commits_with_the_apps_rows_and_vanishes_with_a_rollback(
    app_db: AppDatabase,
) -> None:
    engine = sa.create_engine(app_db.sync_url, connect_args=app_db.connect_args)
    try:
        with Session(engine) as session, session.begin():
            kept = broker.enqueue_in(session, ship, [1], schema=app_db.schema)
            session.add(Order(id=1))  # after the enqueue: its schema did not stick
        with Session(engine) as session:
            session.begin()
            session.add(Order(id=2))
            session.flush()
            dropped = broker.enqueue_in(session, "shop.ship", [2], schema=app_db.schema)
            session.rollback()
    finally:
        engine.dispose()
    assert _orders(app_db) == [1]
    stored = await app_db.store.get_job(kept.job.id)
    assert stored is not None and stored.status is JobStatus.QUEUED
    # The task's defaults came along, as through the main.
    assert (stored.task, stored.args, stored.queue, stored.max_attempts) == (
        "shop.ship",
        (1,),
        "shipping",
        3,
    )
    assert await app_db.store.get_job(dropped.job.id) is None


async def test_a_connection_enqueue_follows_its_transaction_and_keeps_duplicate_rules(
    app_db: AppDatabase,
) -> None:
    engine = sa.create_engine(app_db.sync_url, connect_args=app_db.connect_args)
    try:
        with engine.begin() as conn:
            first = broker.enqueue_in(
                conn, ship, [3], idempotency_key=f"order-3-{uuid.uuid4()}", schema=app_db.schema
            )
            key = first.job.idempotency_key
            assert key is not None
            again = broker.enqueue_in(conn, ship, [3], idempotency_key=key, schema=app_db.schema)
            [a, b] = broker.enqueue_many_in(
                conn,
                [JobSpec(task="shop.ship", unique_key="u-3"), JobSpec(task="x", unique_key="u-3")],
                schema=app_db.schema,
            )
        with engine.begin() as conn:
            later = broker.enqueue_in(conn, ship, [3], idempotency_key=key, schema=app_db.schema)
    finally:
        engine.dispose()
    assert not first.duplicate
    assert again.duplicate and again.job.id == first.job.id
    assert later.duplicate and later.job.id == first.job.id
    assert not a.duplicate and b.duplicate and b.job.id == a.job.id


async def test_a_scoped_session_as_flask_sqlalchemy_gives_it_is_accepted(
    app_db: AppDatabase,
) -> None:
    engine = sa.create_engine(app_db.sync_url, connect_args=app_db.connect_args)
    session = scoped_session(sessionmaker(engine))
    try:
        session.add(Order(id=9))
        job = broker.enqueue_in(session, ship, [9], schema=app_db.schema)
        session.commit()
    finally:
        session.remove()
        engine.dispose()
    assert _orders(app_db) == [9]
    assert await app_db.store.get_job(job.job.id) is not None


async def test_an_async_session_enqueue_commits_and_rolls_back_with_it(
    app_db: AppDatabase,
) -> None:
    engine = create_async_engine(app_db.async_url, connect_args=_async_args(app_db))
    try:
        async with AsyncSession(engine) as session, session.begin():
            kept = await broker.enqueue_in_async(session, ship, [4], schema=app_db.schema)
            session.add(Order(id=4))
        async with AsyncSession(engine) as session:
            await session.begin()
            session.add(Order(id=5))
            await session.flush()
            dropped = await broker.enqueue_in_async(
                session, "shop.ship", [5], delay=60, schema=app_db.schema
            )
            await session.rollback()
        async with engine.connect() as conn:
            await conn.begin()
            via_conn = await broker.enqueue_in_async(conn, ship, [6], schema=app_db.schema)
            await conn.commit()
    finally:
        await engine.dispose()
    assert _orders(app_db) == [4]
    assert await app_db.store.get_job(kept.job.id) is not None
    assert await app_db.store.get_job(via_conn.job.id) is not None
    assert await app_db.store.get_job(dropped.job.id) is None


async def test_an_asyncpg_connection_enqueue_follows_its_transaction_or_commits_alone() -> None:
    """On asyncpg's own connection (the main's insert, no SQLAlchemy): a job enqueued in a
    transaction commits or rolls back with it, one outside commits at once, a batch goes
    in whole, and the duplicate rules are the main's."""
    import asyncpg

    url = require_postgres()
    schema = fresh_schema_name()
    store = SQLAlchemyAdapter(url, schema=schema)
    await store.setup()
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://", 1))
    try:
        async with conn.transaction():
            kept = await broker.enqueue_in_async(conn, ship, [1], schema=schema)
        with pytest.raises(RuntimeError):
            async with conn.transaction():
                dropped = await broker.enqueue_in_async(conn, "shop.ship", [2], schema=schema)
                raise RuntimeError("the application's transaction fails")
        alone = await broker.enqueue_in_async(conn, ship, [3], schema=schema, unique_key="u")
        again = await broker.enqueue_in_async(conn, ship, [4], schema=schema, unique_key="u")
        batch = await broker.enqueue_many_in_async(
            conn, [JobSpec(task="t", args=[i]) for i in range(3)], schema=schema
        )
        with pytest.raises(broker.PayloadTooLargeError):
            await broker.enqueue_many_in_async(
                conn,
                [JobSpec(task="ok"), JobSpec(task="big", args=["x" * 200])],
                schema=schema,
                max_payload_bytes=100,
            )
    finally:
        await conn.close()
        await store.close()
    try:
        store = SQLAlchemyAdapter(url, schema=schema)
        stored = await store.get_job(kept.job.id)
        assert stored is not None and stored.queue == "shipping"  # the task's defaults
        assert await store.get_job(dropped.job.id) is None
        assert await store.get_job(alone.job.id) is not None
        assert again.duplicate and again.job.id == alone.job.id
        assert all([await store.get_job(r.job.id) for r in batch])
        assert len((await store.list_jobs(limit=20)).jobs) == 5
    finally:
        await store.close()
        await drop_schema(schema)


async def test_one_job_on_an_asyncpg_connection_keeps_every_rule_of_the_batch_way() -> None:
    """``enqueue_in_async`` of one job on asyncpg goes straight to its insert (its row's
    values made once from the spec, the args encoded once for the size check and the
    row): a payload over the limit stores nothing, a repeated idempotency key finds its
    holder (or refuses a different job), a payload over the offload threshold moves out
    and reads back whole, and the job as stored is the job the enqueue returned."""
    import asyncpg

    url = require_postgres()
    schema = fresh_schema_name()
    store = SQLAlchemyAdapter(url, schema=schema)
    await store.setup()
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://", 1))
    try:
        with pytest.raises(broker.PayloadTooLargeError):
            await broker.enqueue_in_async(
                conn, "big", ["x" * 200], schema=schema, max_payload_bytes=100
            )
        first = await broker.enqueue_in_async(
            conn,
            "t",
            [1],
            {"a": [2]},
            schema=schema,
            idempotency_key="i",
            concurrency_key="k",
            concurrency_limit=2,
            priority=4,
            timeout=2.5,
        )
        again = await broker.enqueue_in_async(
            conn,
            "t",
            [1],
            {"a": [2]},
            schema=schema,
            idempotency_key="i",
            concurrency_key="k",
            concurrency_limit=2,
            priority=4,
            timeout=2.5,
        )
        with pytest.raises(broker.IdempotencyConflictError):
            await broker.enqueue_in_async(conn, "t", [9], schema=schema, idempotency_key="i")
        large = await broker.enqueue_in_async(conn, "t", ["y" * 70_000], schema=schema)
    finally:
        await conn.close()
        await store.close()
    try:
        store = SQLAlchemyAdapter(url, schema=schema)
        assert not first.duplicate and again.duplicate and again.job.id == first.job.id
        assert await store.get_job(first.job.id) == first.job
        stored = await store.get_job(large.job.id)
        assert stored is not None and stored.args == ("y" * 70_000,)
        assert len((await store.list_jobs(limit=20)).jobs) == 2
    finally:
        await store.close()
        await drop_schema(schema)


async def test_a_taken_id_on_an_asyncpg_connection_finds_its_job_in_or_out_of_a_transaction() -> (
    None
):
    """A job with no key goes in without ``ON CONFLICT`` outside a transaction (its insert
    fails on a taken id), with it inside one (a failure would abort the caller's
    transaction): either way a job whose id is taken comes back as the stored one,
    ``duplicate``, with or without a concurrency key, and the caller's transaction
    goes on."""
    import asyncpg

    url = require_postgres()
    schema = fresh_schema_name()
    store = SQLAlchemyAdapter(url, schema=schema)
    await store.setup()
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://", 1))
    plain = JobSpec(task="t", args=[1])
    keyed = JobSpec(task="t", args=[2], concurrency_key="k", concurrency_limit=1)
    try:
        for spec in (plain, keyed):
            [first] = await broker.enqueue_many_in_async(conn, [spec], schema=schema)
            [again] = await broker.enqueue_many_in_async(
                conn, [JobSpec(task="other", id=spec.id)], schema=schema
            )
            assert not first.duplicate and again.duplicate and again.job == first.job
        async with conn.transaction():
            [inside] = await broker.enqueue_many_in_async(
                conn, [JobSpec(task="other", id=plain.id)], schema=schema
            )
            after = await broker.enqueue_in_async(conn, "t", [3], schema=schema)
        assert inside.duplicate and inside.job.id == plain.id
        counters = await conn.fetchval(f'SELECT count(*) FROM "{schema}".broker_concurrency')
    finally:
        await conn.close()
        await store.close()
    try:
        store = SQLAlchemyAdapter(url, schema=schema)
        assert await store.get_job(after.job.id) == after.job
        assert len((await store.list_jobs(limit=20)).jobs) == 3
        assert counters == 1  # the keyed job's counter, made by its insert
    finally:
        await store.close()
        await drop_schema(schema)


def _async_args(db: AppDatabase) -> dict[str, object]:
    if "options" not in db.connect_args:
        return {}
    path = str(db.connect_args["options"]).removeprefix("-csearch_path=")
    return {"server_settings": {"search_path": path}}


async def test_a_bad_job_is_refused_before_anything_is_written(app_db: AppDatabase) -> None:
    engine = sa.create_engine(app_db.sync_url, connect_args=app_db.connect_args)
    try:
        with Session(engine) as session, session.begin():
            with pytest.raises(broker.PayloadTooLargeError):
                broker.enqueue_many_in(
                    session,
                    [JobSpec(task="ok"), JobSpec(task="big", args=["x" * 200])],
                    schema=app_db.schema,
                    max_payload_bytes=100,
                )
            with pytest.raises(broker.InvalidJobError):
                broker.enqueue_in(session, ship, [1], delay=5, run_at=None, queue="")
            with pytest.raises(TypeError, match="enqueue_in_async"):
                broker.enqueue_in(AsyncSession(), ship, [1])  # type: ignore[arg-type]
    finally:
        engine.dispose()
    page = await app_db.store.list_jobs(limit=10)
    assert page.jobs == []


async def test_enqueue_each_stores_the_jobs_enqueue_many_stores_by_column_or_one_by_one() -> None:
    """``enqueue_each_in_async`` (one task and its options, many argument sets) on asyncpg:
    by column outside a transaction (one statement, and more than one in a transaction of
    its own past 1,000 jobs), one spec each inside one or with a payload to offload; each
    way stores the jobs ``enqueue_many_in_async`` stores for the same specs. A payload
    over the limit or a key in the options stores nothing."""
    import asyncpg

    url = require_postgres()
    schema = fresh_schema_name()
    store = SQLAlchemyAdapter(url, schema=schema)
    await store.setup()
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://", 1))
    options = {"queue": "q", "priority": 3, "max_attempts": 2, "timeout": 5.0}
    try:
        wide = await broker.enqueue_each_in_async(
            conn,
            "t",
            [[i] for i in range(1001)],
            schema=schema,
            **options,  # type: ignore[arg-type]
        )
        keyed = await broker.enqueue_each_in_async(
            conn,
            "t",
            [[1], ["x" * 70_000]],  # the second's payload moves out of its row
            [{"a": 1}, {}],
            schema=schema,
            concurrency_key="k",
            concurrency_limit=2,
        )
        async with conn.transaction():
            inside = await broker.enqueue_each_in_async(conn, "t", [[1], [2]], schema=schema)
        by_task = await broker.enqueue_each_in_async(conn, ship, [[7], [8]], schema=schema)
        many = await broker.enqueue_many_in_async(
            conn,
            [JobSpec(task="t", args=[0], **options)],
            schema=schema,  # type: ignore[arg-type]
        )
        with pytest.raises(broker.PayloadTooLargeError):
            await broker.enqueue_each_in_async(
                conn, "t", [[1], ["x" * 200]], schema=schema, max_payload_bytes=100
            )
        for key in ("idempotency_key", "unique_key"):
            with pytest.raises(broker.InvalidJobError, match=key):
                await broker.enqueue_each_in_async(conn, "t", [[1]], schema=schema, **{key: "u"})  # type: ignore[arg-type]
        with pytest.raises(broker.InvalidJobError, match="keyword argument sets"):
            await broker.enqueue_each_in_async(conn, "t", [[1]], [{}, {}], schema=schema)
    finally:
        await conn.close()
    try:
        assert len(wide) == 1001 and len(set(wide)) == 1001
        page = await store.list_jobs(limit=2000)
        assert len(page.jobs) == 1001 + 2 + 2 + 2 + 1
        by_id = {job.id: job for job in page.jobs}
        reference = by_id[many[0].job.id]
        skip = {"id", "args", "run_at", "created_at", "updated_at"}
        for i, job_id in enumerate(wide):
            job = by_id[job_id]
            assert job.args == (i,) and job.run_at == job.created_at
            assert {k: v for k, v in job.to_dict().items() if k not in skip} == {
                k: v for k, v in reference.to_dict().items() if k not in skip
            }
        assert [by_id[i].kwargs for i in keyed] == [{"a": 1}, {}]
        assert by_id[keyed[1]].args == ("x" * 70_000,)
        assert {by_id[i].concurrency_key for i in keyed} == {"k"}
        assert [by_id[i].args for i in inside] == [(1,), (2,)]
        assert {by_id[i].queue for i in by_task} == {"shipping"}  # the task's defaults
    finally:
        await store.close()
        await drop_schema(schema)


async def test_enqueue_each_through_a_session_stores_one_spec_each(app_db: AppDatabase) -> None:
    engine = create_async_engine(app_db.async_url, connect_args=_async_args(app_db))
    try:
        async with AsyncSession(engine) as session, session.begin():
            ids = await broker.enqueue_each_in_async(
                session, "shop.ship", [[1], [2]], schema=app_db.schema, priority=4
            )
    finally:
        await engine.dispose()
    jobs = [await app_db.store.get_job(i) for i in ids]
    assert [(j.args, j.priority) for j in jobs if j is not None] == [((1,), 4), ((2,), 4)]
