"""A job store on SQLAlchemy Core (asyncio): SQLite through aiosqlite, PostgreSQL through asyncpg.

How the contract in :mod:`broker.storage` maps onto SQL:

* **Fencing** is a single ``UPDATE ... WHERE id = :id AND handoff_id = :lease AND
  status = 'handed_off'``; the row count is the answer.
* **Claims** lock their candidate rows first (PostgreSQL: ``FOR UPDATE SKIP LOCKED``,
  so concurrent claimers never wait on each other's jobs), then the concurrency
  counters in sorted key order, then hand off every granted row in one ``UPDATE``.
  Releases lock the job row (the fenced ``UPDATE``) and then its counter. Neither
  path waits on a job row while holding a counter, so the two cannot deadlock.
* **SQLite** has one writer at a time. Write transactions start with
  ``BEGIN IMMEDIATE`` so that two writers never deadlock upgrading a read lock, and
  writes inside one adapter queue on an ``asyncio.Lock`` instead of sleeping in
  SQLite's busy handler. Another process on the same file waits up to the busy
  timeout. The journal is WAL with ``synchronous=FULL``: a commit is on disk before
  the call returns, because the broker acknowledges only what is durable.
* **The hot path** (claims, settles, enqueues and selection) does
  not go through SQLAlchemy: PostgreSQL runs each as one asyncpg statement over arrays
  on a pool of its own (:mod:`adapters.sql.postgres`), SQLite as one thread hop to a
  connection of its own (:mod:`adapters.sql.sqlite`), writes group-committed. SQLAlchemy
  keeps the schema, migrations and everything else.
* **Time** is read from the adapter's clock, never the database's, and stored as
  integer microseconds since the epoch.

This module states what each call of the contract does; the :class:`Dialect` chosen at
construction (:class:`~adapters.sql.postgres.PostgresDialect` or
:class:`~adapters.sql.sqlite.SqliteDialect`) says how, for the hot path; errors become the
broker's at one door (:mod:`adapters.sql.errors`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import datetime
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from adapters import DEFAULT_HOT_POOL_SIZE, DEFAULT_POOL_SIZE
from adapters.sql.connect import MainLock, main_lock, redact, require_driver, resolve_url
from adapters.sql.enqueue import DriverEnqueue, Enqueue, SyncStatements, complete_now, statements
from adapters.sql.errors import StoreErrors
from adapters.sql.rows import (
    SUMMARY_COLUMNS,
    Bodies,
    bodies_missing,
    decode_cursor,
    encode_changes,
    encode_cursor,
    from_us,
    in_chunks,
    job_from_row,
    sa_bodies,
    to_us,
)
from adapters.sql.schema import (
    IS_ACTIVE,
    IS_HANDED_OFF,
    IS_TERMINAL,
    concurrency,
    jobs,
    migrate,
    payloads,
    schema_version,
    task_catalog,
)
from broker import settlement
from broker.exceptions import (
    ConfigurationError,
    SchemaVersionError,
    StorageError,
    UniqueKeyTakenError,
)
from broker.jobs import (
    TERMINAL_STATUSES,
    CheckpointSave,
    Claim,
    Clock,
    EnqueueResult,
    ExecutionMode,
    Job,
    JobSpec,
    JobStatus,
    JSONValue,
    Outcome,
    ProgressUpdate,
    Settlement,
    utcnow,
)
from broker.payload import DEFAULT_MAX_PAYLOAD_BYTES, DEFAULT_OFFLOAD_BYTES, check_all
from broker.storage import (
    SCHEMA_VERSION,
    Capabilities,
    JobFilter,
    JobPage,
    LeaderRecord,
    QueueCount,
    TaskRecord,
)

logger = logging.getLogger("adapters.sql")
_QUEUED = JobStatus.QUEUED.value
_READ_ROUNDS = 5
"""Reads of rows and their payloads before a payload that keeps vanishing between the
two is an error (see :meth:`SQLAlchemyAdapter._read_with_bodies`)."""


class Dialect(Protocol):
    """How one engine carries out the store's hot calls, and what it alone has (the
    election, ``LISTEN``, an application's driver connection). Chosen once, at
    construction; the adapter never asks which it has. Each call raises the driver's own
    errors, which the adapter translates at its door (:attr:`errors`)."""

    errors: StoreErrors
    capabilities: Capabilities
    engine: AsyncEngine
    write_engine: AsyncEngine
    """Write transactions (SQLite: ``BEGIN IMMEDIATE``)."""
    read_engine: AsyncEngine
    write_lock: AbstractAsyncContextManager[Any]
    """Held over each write transaction (SQLite's writers queue here, not in its busy
    handler)."""
    required_file: str | None
    """The file that must exist already for the store to (a SQLite store opened with
    ``create=False``)."""

    def insert(self, table: sa.Table) -> Any:
        """The dialect's ``INSERT`` construct (which knows ``ON CONFLICT DO NOTHING``)."""
        ...

    def before_migrate(self, conn: sa.Connection) -> None: ...
    def lock_rows(self, select: sa.Select[Any]) -> sa.Select[Any]: ...
    async def close(self) -> None: ...
    async def select_eligible(
        self,
        modes: Collection[ExecutionMode],
        queues: Collection[str] | None,
        limit: int,
        skip: Collection[uuid.UUID],
    ) -> list[Job]: ...
    async def next_run_at(
        self, modes: Collection[ExecutionMode], queues: Collection[str] | None
    ) -> datetime | None: ...
    async def claim(self, claims: list[Claim], epoch: int | None) -> list[Job]: ...
    async def settle(
        self, settlements: Sequence[Settlement], now_us: int, epoch: int | None
    ) -> list[bool]: ...
    async def save_checkpoints(
        self, saves: Sequence[CheckpointSave], now_us: int
    ) -> list[bool]: ...
    async def save_progress(self, updates: Sequence[ProgressUpdate]) -> list[bool]: ...
    async def enqueue(
        self, specs: Sequence[JobSpec], claims: Sequence[Claim | None], epoch: int | None
    ) -> list[EnqueueResult]: ...
    def driver_enqueue(self) -> DriverEnqueue: ...
    def note_inserts(self, count: int) -> None: ...
    async def elect(self, holder: str, address: str, ttl: float) -> LeaderRecord | None: ...
    async def renew(self, holder: str, epoch: int, ttl: float) -> bool: ...
    async def resign(self, holder: str, epoch: int) -> None: ...
    def listen(
        self, on_wake: Callable[[], None], where: object
    ) -> AbstractAsyncContextManager[None]: ...


def _open_dialect(
    resolved: URL,
    backend: str,
    *,
    schema: str | None,
    pool_size: int,
    hot_pool_size: int,
    echo: bool,
    create: bool,
    read_only: bool,
    single_main: bool,
    now: Callable[[], int],
    offload_threshold: int | None,
    enqueue: Enqueue,
) -> Dialect:
    """The dialect of ``backend``, its driver checked first (so a missing one is named);
    each dialect module is imported only when its store is used."""
    if backend == "postgresql":
        driver = require_driver("asyncpg", resolved)
        from adapters.sql.postgres import PostgresDialect

        return PostgresDialect(
            resolved,
            driver,
            schema=schema,
            pool_size=pool_size,
            hot_pool_size=hot_pool_size,
            echo=echo,
            read_only=read_only,
            single_main=single_main,
            now=now,
            offload_threshold=offload_threshold,
            enqueue=enqueue,
        )
    require_driver("aiosqlite", resolved)
    if schema is not None:
        raise ConfigurationError(
            "the schema option is for PostgreSQL only; a SQLite store is one file"
        )
    from adapters.sql.sqlite import SqliteDialect

    return SqliteDialect(
        resolved,
        pool_size=pool_size,
        echo=echo,
        create=create,
        read_only=read_only,
        now=now,
        offload_threshold=offload_threshold,
        enqueue=enqueue,
    )


class SQLAlchemyAdapter:
    """A :class:`~broker.storage.StorageAdapter` on SQLite (a file) or PostgreSQL.

    ``schema`` (PostgreSQL only) puts the tables in that schema, creating it if needed.
    ``max_payload_bytes`` caps a job's args and kwargs (as JSON) in
    :meth:`enqueue_in_transaction`, which does not pass through the main's own check;
    ``None`` turns the cap off. ``pool_size`` is the general pool (enqueues, listings,
    operator calls; up to 10 more connections under load); on PostgreSQL,
    ``hot_pool_size`` more connections serve claims, settles and selection alone (see
    :mod:`adapters.sql.postgres`), and up to ``pool_size`` more the main's enqueues (opened
    as needed; its group commit uses one at a time). Call :meth:`setup` before use and
    :meth:`close` when done.

    ``create=False`` opens only a store that exists (a SQLite file is never created) and
    ``read_only=True`` also refuses every write (PostgreSQL: read-only transactions);
    such a handle is checked with :meth:`check_schema`, never set up. The operator's
    command opens stores this way.

    ``single_main=True`` is for a broker-main: on a SQLite file, :meth:`setup` takes the
    file lock of :class:`adapters.sql.connect.MainLock` (a second main on the file is refused) and
    :meth:`close` drops it. On PostgreSQL, its enqueues then notify no listener: the
    main wakes its own dispatcher after each (other processes' inserts still notify).

    ``offload_threshold``: a job's args, kwargs, result or checkpoint longer than this many
    bytes (as stored JSON) is kept in ``broker_payloads`` instead of its ``broker_jobs``
    row, so the rows that claims and settles rewrite stay small; ``None`` keeps every
    value inline.
    """

    def __init__(
        self,
        url: str,
        *,
        clock: Clock = utcnow,
        schema: str | None = None,
        pool_size: int = DEFAULT_POOL_SIZE,
        hot_pool_size: int = DEFAULT_HOT_POOL_SIZE,
        echo: bool = False,
        max_payload_bytes: int | None = DEFAULT_MAX_PAYLOAD_BYTES,
        create: bool = True,
        read_only: bool = False,
        single_main: bool = False,
        offload_threshold: int | None = DEFAULT_OFFLOAD_BYTES,
    ) -> None:
        resolved, backend = resolve_url(url)
        create = create and not read_only
        for name, size in (("pool_size", pool_size), ("hot_pool_size", hot_pool_size)):
            if size < 1:
                raise ConfigurationError(f"{name} must be at least 1 (got {size})")
        if max_payload_bytes is not None and max_payload_bytes < 1:
            raise ConfigurationError(
                f"max_payload_bytes must be positive or None (got {max_payload_bytes})"
            )
        self._max_payload_bytes = max_payload_bytes
        if offload_threshold is not None and offload_threshold < 0:
            raise ConfigurationError(
                f"offload_threshold must not be negative, or None (got {offload_threshold})"
            )
        self._offload_threshold = offload_threshold
        self._clock = clock
        self._url_text = redact(resolved)
        self._schema = schema
        self._epoch: int | None = None
        """The leader's epoch every claim and settle is fenced with (see :meth:`fence`)."""
        self._enqueue = Enqueue(self._now, offload_threshold, self._url_text)
        self._dialect = _open_dialect(
            resolved,
            backend,
            schema=schema,
            pool_size=pool_size,
            hot_pool_size=hot_pool_size,
            echo=echo,
            create=create,
            read_only=read_only,
            single_main=single_main,
            now=self._now,
            offload_threshold=offload_threshold,
            enqueue=self._enqueue,
        )
        self._errors = self._dialect.errors
        self._engine = self._dialect.engine
        self._main_lock: MainLock | None = main_lock(resolved) if single_main else None
        """Held from :meth:`setup` to :meth:`close` by a main on a SQLite file
        (``single_main``), so a second main on that file refuses to start."""

    def __repr__(self) -> str:
        schema = f", schema={self._schema!r}" if self._schema else ""
        return f"SQLAlchemyAdapter({self._url_text!r}{schema})"

    @property
    def capabilities(self) -> Capabilities:
        return self._dialect.capabilities

    @property
    def offload_threshold(self) -> int | None:
        return self._offload_threshold

    async def count_payloads(self) -> int:
        stmt = sa.select(sa.func.count()).select_from(payloads)
        async with self._read("count_payloads") as conn:
            return int((await conn.execute(stmt)).scalar_one())

    # ------------------------------------------------------------------ plumbing

    def _now(self) -> int:
        return to_us(self._clock())

    @asynccontextmanager
    async def _write(self, op: str) -> AsyncIterator[AsyncConnection]:
        """One write transaction; driver errors come out as :class:`StorageError`."""
        with self._errors.translate(op):
            async with self._dialect.write_lock, self._dialect.write_engine.begin() as conn:
                yield conn

    @asynccontextmanager
    async def _read(self, op: str) -> AsyncIterator[AsyncConnection]:
        with self._errors.translate(op):
            async with self._dialect.read_engine.connect() as conn:
                yield conn

    async def _read_with_bodies(
        self, op: str, stmt: sa.Select[Any], first: int | None = None
    ) -> tuple[Sequence[Mapping[Any, Any]], Bodies]:
        """The rows ``stmt`` selects, and the offloaded payloads of the ``first`` of them
        (``None``: of all).

        Two statements, each seeing the store as it is when it runs: a job whose
        checkpoint was replaced by a small one, between them, has a mark in the row read
        and no payload left (it went with the old value), and ``broker job`` polled
        while a recovered job saved its checkpoints failed with "its offloaded
        checkpoint is missing". Both are read again then: the row read anew names what
        is stored now."""
        for _ in range(_READ_ROUNDS):
            async with self._read(op) as conn:
                rows = (await conn.execute(stmt)).mappings().all()
                wanted = rows if first is None else rows[:first]
                bodies = await sa_bodies(conn, wanted)
            if not bodies_missing(wanted, bodies):
                return rows, bodies
        raise StorageError(
            f"{op} failed on {self._url_text}: the payloads of the jobs read kept changing "
            "between the read of their rows and of their payloads"
        )

    # ------------------------------------------------------------------ lifecycle

    async def setup(self) -> None:
        if self._main_lock is not None:
            self._main_lock.acquire()
        async with self._write("setup") as conn:
            await conn.run_sync(self._setup_sync)

    def _setup_sync(self, conn: sa.Connection) -> None:
        self._dialect.before_migrate(conn)
        current = self._stored_version(conn) or 0
        if current < SCHEMA_VERSION:
            logger.info("migrating %s from schema version %d to %d", self, current, SCHEMA_VERSION)
            migrate(conn, self._schema, current)

    def _stored_version(self, conn: sa.Connection) -> int | None:
        """The store's schema version; None if it holds no broker schema at all.

        :raises SchemaVersionError: a newer schema than this code understands.
        """
        if not sa.inspect(conn).has_table(schema_version.name, schema=self._schema):
            return None
        found = conn.execute(
            sa.select(schema_version.c.version).where(schema_version.c.id == 1)
        ).scalar_one_or_none()
        if found is None:
            raise StorageError(
                f"{self._url_text}: table broker_schema exists but holds no version row; "
                "the store is damaged or was not created by the broker"
            )
        if int(found) > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"the store at {self._url_text} has schema version {found}, but this "
                f"broker understands versions up to {SCHEMA_VERSION}: upgrade the broker "
                "before using this store"
            )
        return int(found)

    async def check_schema(self) -> None:
        required = self._dialect.required_file
        if required is not None and not await asyncio.to_thread(os.path.exists, required):
            raise SchemaVersionError(
                f"there is no store at {self._url_text}: the file does not exist. Check "
                "the store URL; broker-main creates the file when it first starts"
            )
        async with self._read("check schema") as conn:
            current = await conn.run_sync(self._stored_version)
        if current is None:
            raise SchemaVersionError(
                f"the database at {self._url_text} holds no broker schema (no "
                f"{schema_version.name} table{self._in_schema()}): it is empty or not the "
                "broker's. Check the store URL; broker-main creates the schema when it first "
                "starts (or run `broker --database-url URL migrate`)"
            )
        if current < SCHEMA_VERSION:
            raise SchemaVersionError(
                f"the store at {self._url_text} has schema version {current}, older than "
                f"the version {SCHEMA_VERSION} this broker needs: start this version's "
                "broker-main, which migrates it, or run `broker --database-url URL migrate` "
                "(stop any older main first)"
            )

    def _in_schema(self) -> str:
        return f" in schema {self._schema!r}" if self._schema else ""

    async def close(self) -> None:
        await self._dialect.close()
        await self._engine.dispose()
        if self._main_lock is not None:
            self._main_lock.release()

    # ------------------------------------------------------------------ enqueue

    async def enqueue(self, spec: JobSpec) -> EnqueueResult:
        return (await self.enqueue_many([spec]))[0]

    async def enqueue_many(self, specs: Sequence[JobSpec]) -> list[EnqueueResult]:
        return await self.enqueue_handed_off(specs, [None] * len(specs))

    async def enqueue_handed_off(
        self, specs: Sequence[JobSpec], claims: Sequence[Claim | None]
    ) -> list[EnqueueResult]:
        if not specs:
            return []
        with self._errors.translate("enqueue"):
            results = await self._dialect.enqueue(specs, claims, self._epoch)
        self._dialect.note_inserts(sum(not r.duplicate for r in results))
        return results

    async def enqueue_on_driver_connection(
        self, conn: Any, specs: Sequence[JobSpec]
    ) -> list[EnqueueResult]:
        """PostgreSQL: insert jobs on the caller's own asyncpg connection, with the main's
        own statement: inside the transaction open on ``conn``, if any, else committed by
        the statement itself (a single job, or a batch nothing stands in the way of), or
        by a transaction of its own (any other batch).

        Through SQLAlchemy, a job enqueued in the application's transaction cost its
        process about 1.1 ms of CPU (building and compiling the statement, ``BEGIN`` and
        ``COMMIT``); this costs about 0.3 ms, as PgQueuer's one ``INSERT`` costs its
        client. The checks and duplicate rules are the main's.

        :raises PayloadTooLargeError: a job's args and kwargs exceed ``max_payload_bytes``;
            nothing of the batch is inserted.
        """
        if not specs:
            return []
        enqueue = self._dialect.driver_enqueue()
        check_all(specs, self._max_payload_bytes)
        with self._errors.translate("enqueue_in_transaction"):
            return await enqueue(conn, specs, [None] * len(specs), self._epoch)

    async def enqueue_in_transaction(
        self, conn: AsyncConnection, specs: Sequence[JobSpec]
    ) -> list[EnqueueResult]:
        """Insert jobs on the caller's own connection, inside the caller's transaction.

        The jobs commit or roll back together with the application's own rows, so a job
        never refers to data that was rolled back, and data never lacks its job. ``conn``
        must be on this adapter's database (any engine). On PostgreSQL the insert trigger
        wakes the main at commit; on SQLite the main's short poll finds the jobs.

        :raises PayloadTooLargeError: a job's args and kwargs exceed ``max_payload_bytes``;
            nothing of the batch is inserted.
        """
        if not specs:
            return []
        check_all(specs, self._max_payload_bytes)
        options = self._statement_options()

        async def execute(stmt: sa.Executable, params: Any = None) -> Any:
            return await conn.execute(stmt, params, execution_options=options)

        with self._errors.translate("enqueue_in_transaction"):
            return await self._enqueue.on_connection(
                statements(execute), specs, self._dialect.insert
            )

    def enqueue_in_sync_transaction(
        self, conn: SyncStatements, specs: Sequence[JobSpec]
    ) -> list[EnqueueResult]:
        """:meth:`enqueue_in_transaction` on a synchronous connection (a ``sa.Connection``,
        or anything that executes Core statements the same way, such as a Django cursor's
        adapter): the same checks, rows and duplicate rules, in the caller's transaction.

        The one definition of the insert-or-find rule is a coroutine; over a synchronous
        connection none of its awaits ever suspends, so it runs to the end in one step
        (:func:`~adapters.sql.enqueue.complete_now`) without an event loop.
        """
        if not specs:
            return []
        check_all(specs, self._max_payload_bytes)
        options = self._statement_options()

        async def execute(stmt: sa.Executable, params: Any = None) -> Any:
            return conn.execute(stmt, params, execution_options=options)

        with self._errors.translate("enqueue_in_transaction"):
            return complete_now(
                self._enqueue.on_connection(statements(execute), specs, self._dialect.insert)
            )

    def _statement_options(self) -> dict[str, Any]:
        """Execution options for each statement on the application's connection: the
        schema map goes on every statement, never on the connection, whose own tables
        (unqualified, like ours) must keep resolving as the application set them."""
        return {} if self._schema is None else {"schema_translate_map": {None: self._schema}}

    # ------------------------------------------------------------------ dispatch

    async def select_eligible(
        self,
        *,
        modes: Collection[ExecutionMode],
        queues: Collection[str] | None = None,
        limit: int = 100,
        skip: Collection[uuid.UUID] = (),
    ) -> list[Job]:
        if not modes or limit <= 0:
            return []
        with self._errors.translate("select_eligible"):
            return await self._dialect.select_eligible(modes, queues, limit, skip)

    async def next_run_at(
        self, *, modes: Collection[ExecutionMode], queues: Collection[str] | None = None
    ) -> datetime | None:
        if not modes:
            return None
        with self._errors.translate("next_run_at"):
            return await self._dialect.next_run_at(modes, queues)

    async def mark_handed_off(
        self, job_id: uuid.UUID, handoff_id: uuid.UUID, worker_id: str
    ) -> Job | None:
        claimed = await self.mark_handed_off_many([Claim(job_id, handoff_id, worker_id)])
        return claimed[0] if claimed else None

    async def mark_handed_off_many(self, claims: Sequence[Claim]) -> list[Job]:
        wanted: dict[uuid.UUID, Claim] = {}
        for claim in claims:
            wanted.setdefault(claim.job_id, claim)  # the same job twice: the first claim
        if not wanted:
            return []
        with self._errors.translate("mark_handed_off"):
            return await self._dialect.claim(list(wanted.values()), self._epoch)

    # ------------------------------------------------------------------ fenced reports

    async def settle_many(self, settlements: Sequence[Settlement]) -> list[bool]:
        if not settlements:
            return []
        now_us = self._now()
        with self._errors.translate("settle"):
            return await self._dialect.settle(settlements, now_us, self._epoch)

    # ------------------------------------------------------------------ checkpoints, progress

    async def save_checkpoints(self, saves: Sequence[CheckpointSave]) -> list[bool]:
        if not saves:
            return []
        now_us = self._now()
        with self._errors.translate("save checkpoints"):
            return await self._dialect.save_checkpoints(saves, now_us)

    async def save_progress(self, updates: Sequence[ProgressUpdate]) -> list[bool]:
        if not updates:
            return []
        with self._errors.translate("save progress"):
            return await self._dialect.save_progress(updates)

    async def _release(self, conn: AsyncConnection, key: str, slots: int) -> None:
        await conn.execute(
            sa.update(concurrency)
            .where(concurrency.c.key == key)
            .values(
                active=sa.case(
                    (concurrency.c.active > slots, concurrency.c.active - slots), else_=0
                )
            )
        )

    async def complete(
        self, job_id: uuid.UUID, handoff_id: uuid.UUID, result: JSONValue = None
    ) -> bool:
        [done] = await self.settle_many([Settlement(job_id, handoff_id, Outcome.COMPLETE, result)])
        return done

    async def fail(
        self,
        job_id: uuid.UUID,
        handoff_id: uuid.UUID,
        error: str,
        retry_at: datetime | None,
    ) -> bool:
        [done] = await self.settle_many(
            [Settlement(job_id, handoff_id, Outcome.FAIL, error=error, run_at=retry_at)]
        )
        return done

    async def reschedule(self, job_id: uuid.UUID, handoff_id: uuid.UUID, run_at: datetime) -> bool:
        [done] = await self.settle_many(
            [Settlement(job_id, handoff_id, Outcome.RESCHEDULE, run_at=run_at)]
        )
        return done

    async def return_to_queue(self, job_id: uuid.UUID, handoff_id: uuid.UUID) -> bool:
        [done] = await self.settle_many([Settlement(job_id, handoff_id, Outcome.RETURN)])
        return done

    # ------------------------------------------------------------------ leadership

    async def elect(self, holder: str, address: str, ttl: float) -> LeaderRecord | None:
        with self._errors.translate("elect"):
            return await self._dialect.elect(holder, address, ttl)

    async def renew(self, holder: str, epoch: int, ttl: float) -> bool:
        with self._errors.translate("renew"):
            return await self._dialect.renew(holder, epoch, ttl)

    async def resign(self, holder: str, epoch: int) -> None:
        with self._errors.translate("resign"):
            await self._dialect.resign(holder, epoch)

    def fence(self, epoch: int | None, on_fenced: Callable[[str], None] | None = None) -> None:
        self._epoch = epoch
        self._errors.on_fenced = on_fenced

    # ------------------------------------------------------------------ operator actions

    async def handoffs_for_worker(self, worker_id: str) -> list[Job]:
        stmt = (
            sa.select(jobs)
            .where(jobs.c.worker_id == worker_id, IS_HANDED_OFF)
            .order_by(jobs.c.handed_off_us, jobs.c.id)
        )
        rows, bodies = await self._read_with_bodies("handoffs_for_worker", stmt)
        return [job_from_row(r, bodies) for r in rows]

    async def cancel(self, job_id: uuid.UUID) -> Job | None:
        select = sa.select(jobs).where(jobs.c.id == job_id)
        select = self._dialect.lock_rows(select)
        async with self._write("cancel") as conn:
            row = (await conn.execute(select)).mappings().first()
            if row is None:
                return None
            bodies = await sa_bodies(conn, [row])
            move = settlement.cancel(row["status"], from_us(self._now()))
            if move is None:
                return job_from_row(row, bodies)
            update = (
                sa.update(jobs)
                .where(jobs.c.id == job_id, jobs.c.status == row["status"])
                .values(**encode_changes(move.changes))
                .returning(*jobs.c)
            )
            cancelled = (await conn.execute(update)).mappings().one()
            if move.releases_slot and row["concurrency_key"] is not None:
                await self._release(conn, row["concurrency_key"], 1)
        return job_from_row(cancelled, bodies)

    async def retry_dead(self, job_id: uuid.UUID) -> Job | None:
        now_us = self._now()
        update = (
            sa.update(jobs)
            .where(jobs.c.id == job_id, jobs.c.status == JobStatus.FAILED.value)
            .values(**encode_changes(settlement.revive(from_us(now_us)).changes))
            .returning(*jobs.c)
        )
        try:
            async with self._write("retry_dead") as conn:
                dead = (
                    await conn.execute(
                        sa.select(jobs.c.unique_key).where(
                            jobs.c.id == job_id, jobs.c.status == JobStatus.FAILED.value
                        )
                    )
                ).first()
                if dead is not None and dead.unique_key is not None:
                    await self._refuse_if_unique_key_held(conn, job_id, dead.unique_key)
                row = (await conn.execute(update)).mappings().first()
                if row is None:
                    select = sa.select(jobs).where(jobs.c.id == job_id)
                    row = (await conn.execute(select)).mappings().first()
                bodies = await sa_bodies(conn, [] if row is None else [row])
        except StorageError as exc:
            # A job holding the key was enqueued (by another process) after the check.
            if isinstance(exc.__cause__, sa_exc.IntegrityError):
                raise UniqueKeyTakenError(
                    f"job {job_id} cannot be retried: another job took its unique key while "
                    "it is queued or running"
                ) from exc
            raise
        return None if row is None else job_from_row(row, bodies)

    async def _refuse_if_unique_key_held(
        self, conn: AsyncConnection, job_id: uuid.UUID, key: str
    ) -> None:
        holder = (
            await conn.execute(
                sa.select(jobs.c.id).where(jobs.c.unique_key == key, IS_ACTIVE).limit(1)
            )
        ).scalar()
        if holder is not None:
            raise UniqueKeyTakenError(
                f"job {job_id} cannot be retried: job {holder} holds its unique key {key!r} "
                "while it is queued or running; retry once that job has finished",
                holder_id=holder,
            )

    # ------------------------------------------------------------------ inspection

    async def get_job(self, job_id: uuid.UUID) -> Job | None:
        stmt = sa.select(jobs).where(jobs.c.id == job_id)
        rows, bodies = await self._read_with_bodies("get_job", stmt)
        return job_from_row(rows[0], bodies) if rows else None

    async def declare_tasks(
        self,
        worker_id: str,
        declarations: Mapping[str, Mapping[str, JSONValue]],
        seen_at: datetime,
    ) -> None:
        seen_us = to_us(seen_at)
        rows = [
            {
                "task": name,
                "worker_id": worker_id,
                "declaration": json.dumps(dict(declaration), sort_keys=True),
                "seen_us": seen_us,
            }
            for name, declaration in sorted(declarations.items())
        ]
        # The worker's rows go, then its declaration goes in whole: one transaction, and
        # at most MAX_DECLARED_TASKS rows (the main's bound), so no list of names to
        # keep is needed in the statement.
        delete = sa.delete(task_catalog).where(task_catalog.c.worker_id == worker_id)
        async with self._write("declare_tasks") as conn:
            await conn.execute(delete)
            if rows:
                await conn.execute(sa.insert(task_catalog), rows)

    async def task_catalog(
        self, *, tasks: Collection[str] | None = None, limit: int | None = None
    ) -> list[TaskRecord]:
        select = sa.select(task_catalog)
        if limit is not None:
            select = select.order_by(task_catalog.c.seen_us.desc()).limit(limit)
        selects = (
            [select]
            if tasks is None
            else [select.where(task_catalog.c.task.in_(c)) for c in in_chunks(sorted(tasks))]
        )
        async with self._read("task_catalog") as conn:
            rows = [row for s in selects for row in (await conn.execute(s)).mappings().all()]
        records = [
            TaskRecord(
                task=row["task"],
                worker_id=row["worker_id"],
                declaration=json.loads(row["declaration"]),
                seen_at=from_us(row["seen_us"]),
            )
            for row in rows
        ]
        if limit is not None:  # a limit per slice of names: the most recent of them all
            records = sorted(records, key=lambda r: r.seen_at, reverse=True)[:limit]
        return sorted(records, key=lambda r: (r.task, r.worker_id))

    async def forget_tasks(
        self, live_workers: Collection[str], seen_at: datetime, gone_before: datetime
    ) -> int:
        async with self._write("forget_tasks") as conn:
            for chunk in in_chunks(sorted(live_workers)):
                await conn.execute(
                    sa.update(task_catalog)
                    .where(task_catalog.c.worker_id.in_(chunk))
                    .values(seen_us=to_us(seen_at))
                )
            deleted = await conn.execute(
                sa.delete(task_catalog).where(task_catalog.c.seen_us < to_us(gone_before))
            )
        return int(deleted.rowcount or 0)

    async def list_jobs(
        self,
        job_filter: JobFilter | None = None,
        *,
        limit: int = 50,
        cursor: str | None = None,
        include_payload: bool = True,
    ) -> JobPage:
        if limit <= 0:
            return JobPage(jobs=[], next_cursor=None)
        conds: list[sa.ColumnElement[bool]] = []
        if job_filter is not None:
            if job_filter.statuses is not None:
                conds.append(
                    jobs.c.status.in_(sorted({JobStatus(s).value for s in job_filter.statuses}))
                )
            if job_filter.queues is not None:
                conds.append(jobs.c.queue.in_(sorted(set(job_filter.queues))))
            if job_filter.tasks is not None:
                conds.append(jobs.c.task.in_(sorted(set(job_filter.tasks))))
        if cursor is not None:
            created_us, last_id = decode_cursor(cursor)
            conds.append(sa.tuple_(jobs.c.created_us, jobs.c.id) < (created_us, last_id))
        stmt = (
            sa.select(*(jobs.c if include_payload else SUMMARY_COLUMNS))
            .where(*conds)
            .order_by(jobs.c.created_us.desc(), jobs.c.id.desc())
            .limit(limit + 1)
        )
        rows, bodies = await self._read_with_bodies("list_jobs", stmt, first=limit)
        page = [job_from_row(r, bodies) for r in rows[:limit]]
        next_cursor = None
        if len(rows) > limit:
            last = rows[limit - 1]
            next_cursor = encode_cursor(last["created_us"], last["id"])
        return JobPage(jobs=page, next_cursor=next_cursor)

    def cursor_after(self, job: Job) -> str:
        return encode_cursor(to_us(job.created_at), job.id)

    async def count_jobs(self) -> list[QueueCount]:
        stmt = (
            sa.select(jobs.c.queue, jobs.c.status, sa.func.count(), sa.func.min(jobs.c.run_at_us))
            .group_by(jobs.c.queue, jobs.c.status)
            .order_by(jobs.c.queue, jobs.c.status)
        )
        async with self._read("count_jobs") as conn:
            rows = (await conn.execute(stmt)).all()
        return [
            QueueCount(
                queue=queue,
                status=JobStatus(status),
                count=int(count),
                oldest_run_at=from_us(oldest) if status == _QUEUED and oldest is not None else None,
            )
            for queue, status, count, oldest in rows
        ]

    # ------------------------------------------------------------------ pruning

    async def prune(
        self,
        *,
        older_than: datetime | None = None,
        keep_latest: int | None = None,
        statuses: Collection[JobStatus] | None = None,
        batch_size: int = 1000,
    ) -> int:
        """Delete terminal jobs in batches, each its own short transaction.

        ``keep_latest`` counts among the statuses being pruned (by ``updated_at``, then
        id); with ``older_than`` too, a job goes only if both allow it. With neither,
        every terminal job of those statuses goes. Idle concurrency counters (no job
        handed off under the key) are deleted as well.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1 (got {batch_size})")
        if keep_latest is not None and keep_latest < 0:
            raise ValueError(f"keep_latest must not be negative (got {keep_latest})")
        targets = (
            TERMINAL_STATUSES
            if statuses is None
            else TERMINAL_STATUSES & {JobStatus(s) for s in statuses}
        )
        if not targets:
            return 0
        # IS_TERMINAL is the partial index's own predicate; the second test narrows it.
        status_in: sa.ColumnElement[bool] = IS_TERMINAL
        if targets != TERMINAL_STATUSES:
            status_in = sa.and_(IS_TERMINAL, jobs.c.status.in_(sorted(s.value for s in targets)))
        conds: list[sa.ColumnElement[bool]] = [status_in]
        if older_than is not None:
            conds.append(jobs.c.updated_us < to_us(older_than))
        if keep_latest:
            boundary = await self._keep_boundary(status_in, keep_latest)
            if boundary is None:
                return 0  # no more than keep_latest candidates: nothing to delete
            conds.append(
                sa.tuple_(jobs.c.updated_us, jobs.c.id)
                < sa.tuple_(
                    sa.literal(boundary[0], sa.BigInteger()), sa.literal(boundary[1], sa.Uuid())
                )
            )
        batch = sa.select(jobs.c.id).where(*conds).limit(batch_size)
        deleted = 0
        while True:
            # The ids first, then a delete by primary key: one ``DELETE ... IN (subquery)``
            # leaves the join to the planner, and with statistics taken while the jobs were
            # still queued PostgreSQL chose a plan that took seconds per batch.
            async with self._write("prune") as conn:
                ids = list((await conn.execute(batch)).scalars())
                count = 0
                if ids:
                    # Re-check the status on the row itself: a job may have been revived.
                    delete = sa.delete(jobs).where(jobs.c.id.in_(ids), status_in)
                    count = (await conn.execute(delete)).rowcount
            deleted += count
            if len(ids) < batch_size:
                break
        async with self._write("prune") as conn:
            # Idle counters of keys no job holds; a claim re-creates them on demand.
            await conn.execute(sa.delete(concurrency).where(concurrency.c.active <= 0))
        return deleted

    async def _keep_boundary(
        self, status_in: sa.ColumnElement[bool], keep_latest: int
    ) -> tuple[int, uuid.UUID] | None:
        """The ``(updated_us, id)`` of the oldest terminal job that ``keep_latest`` keeps."""
        stmt = (
            sa.select(jobs.c.updated_us, jobs.c.id)
            .where(status_in)
            .order_by(jobs.c.updated_us.desc(), jobs.c.id.desc())
            .offset(keep_latest - 1)
            .limit(1)
        )
        async with self._read("prune") as conn:
            row = (await conn.execute(stmt)).first()
        return None if row is None else (int(row.updated_us), row.id)

    # ------------------------------------------------------------------ notifications

    def listen(self, on_wake: Callable[[], None]) -> AbstractAsyncContextManager[None]:
        """While open, ``on_wake()`` runs whenever any process inserts a job (PostgreSQL).

        Notifications come from a trigger on ``broker_jobs``, so inserts made by other
        brokers, other adapters or plain SQL all wake the listener. If the listening
        connection is lost, ``on_wake`` is called once more and a warning is logged;
        the caller's polling timer takes over from there.
        """
        return self._dialect.listen(on_wake, self)


__all__ = ["Dialect", "SQLAlchemyAdapter"]
