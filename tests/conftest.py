"""Shared fixtures: where the test PostgreSQL is, and stores to run tests against."""

from __future__ import annotations

import asyncio
import concurrent.futures
import graphlib
import os
import threading
import uuid
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest

_T = TypeVar("_T")

POSTGRES_URL = os.environ.get(
    "BROKER_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
)


def _asyncpg_dsn() -> str:
    return POSTGRES_URL.replace("postgresql+asyncpg://", "postgresql://", 1)


def _postgres_unreachable_reason() -> str | None:
    async def probe() -> None:
        import asyncpg

        conn = await asyncio.wait_for(asyncpg.connect(_asyncpg_dsn()), timeout=5)
        await conn.close()

    try:
        # A thread of its own: callers may already be inside a running event loop.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, probe()).result()
    except Exception as exc:
        return f"PostgreSQL at {POSTGRES_URL} is unreachable: {exc!r}"
    return None


_reason: list[str | None] = []


def require_postgres() -> str:
    """The test PostgreSQL URL; skips the test if it is down (fails under CI=true)."""
    if not _reason:
        _reason.append(_postgres_unreachable_reason())
    reason = _reason[0]
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason} (CI=true: PostgreSQL tests must run, not skip)")
        pytest.skip(reason)
    return POSTGRES_URL


def fresh_schema_name() -> str:
    return f"broker_test_{uuid.uuid4().hex[:12]}"


async def drop_schema(schema: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(_asyncpg_dsn())
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


class WorkerSchema:
    """One migrated schema for this test process (an xdist worker), emptied before each test
    that takes it: migrating a fresh schema costs about 0.75 s (1.3 s on a loaded machine)
    and dropping it 0.2 s, emptying it a few milliseconds, and the PostgreSQL conformance
    run alone takes a store 73 times. ``TRUNCATE`` would cost 0.2 s of fsyncs: ``DELETE``
    in foreign-key order and restarting the sequences leave the same empty store.

    The connection lives on a loop of its own in a thread, so that sync tests, async tests
    and fixtures (each test has its own loop) can all empty it.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="pg-schema", daemon=True
        )
        self._thread.start()
        self._tables: list[str] = []
        self._sequences: list[str] = []
        self._conn: Any = None
        try:
            self._run(self._create())
        except BaseException:
            self.close()
            raise

    def _run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _qualified(self, name: str) -> str:
        return f'"{self.name}"."{name}"'

    async def _create(self) -> None:
        import asyncpg

        from adapters.sql import SQLAlchemyAdapter

        store = SQLAlchemyAdapter(POSTGRES_URL, schema=self.name)
        try:
            await store.setup()
        finally:
            await store.close()
        self._conn = await asyncpg.connect(_asyncpg_dsn())
        # A table left locked by a test (a transaction it never ended) fails the next one
        # here, in these words, rather than hanging it.
        await self._conn.execute("SET lock_timeout = '10s'")
        rows = await self._conn.fetch(
            """
            SELECT c.relname, c.relkind::text AS relkind, array(
                SELECT f.relname FROM pg_constraint k JOIN pg_class f ON f.oid = k.confrelid
                WHERE k.conrelid = c.oid AND k.contype = 'f' AND k.confrelid <> c.oid
            ) AS refers_to
            FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE n.nspname = $1 AND c.relkind IN ('r', 'p', 'S')
            """,
            self.name,
        )
        # A table is emptied before the tables it refers to; broker_schema keeps its row.
        order: graphlib.TopologicalSorter[str] = graphlib.TopologicalSorter()
        for row in rows:
            if row["relkind"] == "S":
                self._sequences.append(row["relname"])
            elif row["relname"] != "broker_schema":
                order.add(row["relname"])
                for referred in row["refers_to"]:
                    order.add(referred, row["relname"])
        self._tables = list(order.static_order())

    async def _empty(self) -> None:
        from broker.storage import SCHEMA_VERSION

        async with self._conn.transaction():
            version = await self._conn.fetchval(
                f"SELECT version FROM {self._qualified('broker_schema')}"
            )
            assert version == SCHEMA_VERSION, (
                f"a test left the shared schema {self.name} at version {version}: a test "
                "that changes the schema itself needs a fresh one (fresh_schema_name)"
            )
            for table in self._tables:
                await self._conn.execute(f"DELETE FROM {self._qualified(table)}")
            await self._conn.execute(
                "SELECT setval(seqrelid, seqstart, false) FROM pg_sequence"
                " WHERE seqrelid = ANY($1::regclass[])",
                [self._qualified(sequence) for sequence in self._sequences],
            )

    def empty(self) -> str:
        """Empty every table (but the schema's version row); the schema's name."""
        self._run(self._empty())
        return self.name

    async def _drop(self) -> None:
        if self._conn is not None:
            await self._conn.execute(f'DROP SCHEMA IF EXISTS "{self.name}" CASCADE')
            await self._conn.close()

    def close(self) -> None:
        try:
            self._run(self._drop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()


@pytest.fixture(scope="session")
def worker_schema() -> Iterator[WorkerSchema]:
    """This test process's schema (see :class:`WorkerSchema`); dropped when it ends."""
    require_postgres()
    schema = WorkerSchema(f"broker_test_{os.getpid()}_{uuid.uuid4().hex[:6]}")
    try:
        yield schema
    finally:
        schema.close()


@pytest.fixture
def pg_schema(worker_schema: WorkerSchema) -> str:
    """An empty, migrated PostgreSQL schema at :data:`POSTGRES_URL`, for tests that use the
    store as it is (a test that migrates or alters the schema takes a fresh one)."""
    return worker_schema.empty()


@pytest.fixture(scope="session")
def migrated_database() -> Iterator[str]:
    """The name of a PostgreSQL database holding the broker's schema at its current
    version, for ``CREATE DATABASE ... TEMPLATE`` (40 ms, where a main's migration of an
    empty database costs 0.6-1.3 s). Never connected to after its migration (a template
    must not be); dropped when this test process ends."""
    from sqlalchemy.engine import make_url

    base = make_url(require_postgres())
    admin = base.set(drivername="postgresql", database="postgres").render_as_string(False)
    name = f"broker_template_{os.getpid()}_{uuid.uuid4().hex[:6]}"

    async def admin_execute(sql: str) -> None:
        import asyncpg

        conn = await asyncpg.connect(admin)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    async def create() -> None:
        from adapters.sql import SQLAlchemyAdapter

        await admin_execute(f'CREATE DATABASE "{name}"')
        store = SQLAlchemyAdapter(base.set(database=name).render_as_string(False))
        try:
            await store.setup()
        finally:
            await store.close()

    def run(coro: Coroutine[Any, Any, None]) -> None:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a test's loop may be running
            pool.submit(asyncio.run, coro).result()

    try:
        run(create())
        yield name
    finally:
        run(admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(autouse=True)
def no_hooks_in_the_test_process() -> None:
    """No test leaves hooks in the process-wide registry: every in-process worker of a
    later test would run them (an app module imported for a constant once stopped them
    all, see ``tests/app_env.py``)."""
    from broker.tasks.registry import default_registry

    hooks = default_registry.hooks
    assert not (hooks.startup or hooks.shutdown or hooks.middleware), (
        "hooks were declared in the test process's default registry before this test"
    )
