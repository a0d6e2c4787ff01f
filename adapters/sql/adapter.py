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
import logging
import os
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from adapters import DEFAULT_HOT_POOL_SIZE, DEFAULT_POOL_SIZE
from adapters.sql.connect import MainLock, main_lock, redact, resolve_url
from adapters.sql.dialect import open_dialect
from adapters.sql.enqueue import EnqueueRule, SyncStatements, complete_now, statements
from adapters.sql.queries import CoreQueries
from adapters.sql.schema import migrate, schema_version
from broker.exceptions import ConfigurationError, SchemaVersionError, StorageError
from broker.jobs import (
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
    SpecColumns,
    utcnow,
)
from broker.model import checks
from broker.payload import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    DEFAULT_OFFLOAD_BYTES,
    check_all,
    check_columns,
)
from broker.storage import SCHEMA_VERSION, Capabilities, LeaderRecord

logger = logging.getLogger("adapters.sql")


class SQLAlchemyAdapter(CoreQueries):
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
    file lock (:class:`adapters.sql.connect.MainLock`; a second main on the file is
    refused) and :meth:`close` drops it. On PostgreSQL, its enqueues then notify no listener: the
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
        checks.positive_int("pool_size", pool_size)
        checks.positive_int("hot_pool_size", hot_pool_size)
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
        self._unfinished = set()
        """The leader's epoch every claim and settle is fenced with (see :meth:`fence`)."""
        self._enqueue = EnqueueRule(self._now, offload_threshold, self._url_text)
        self._dialect = open_dialect(
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

    # ------------------------------------------------------------------ lifecycle

    async def setup(self) -> None:
        if self._main_lock is not None:
            self._main_lock.acquire()

        async def migrating(conn: AsyncConnection) -> None:
            await conn.run_sync(self._setup_sync)

        await self._write("setup", migrating)
        # Dependents of a parent whose cancel was cut off before their walk.
        await self._dialect.propagate(None)

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

    unfinished_wait: float = 10.0
    """Seconds :meth:`close` waits for writes whose callers were cancelled (see
    :meth:`CoreQueries._write`): an operator's write or a prune batch that the store
    answers finishes well within it; one stuck on an unreachable store is cancelled, so a
    main still stops during an outage (a server rolls back the transaction of a
    connection that goes; SQLite, the reason for waiting, is a local file)."""

    async def close(self) -> None:
        if self._unfinished:
            _, stuck = await asyncio.wait(self._unfinished, timeout=self.unfinished_wait)
            for task in stuck:
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
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

    async def enqueue_columns(self, chunks: Iterator[SpecColumns], count: int) -> list[uuid.UUID]:
        """The main's bulk enqueue (:class:`~broker.storage.SupportsEnqueueColumns`): on
        PostgreSQL by column (a statement per chunk, one transaction for more than
        1,000 jobs), else, or when that cannot be done (a payload to offload, a refused
        statement: nothing stored), one spec each, in one transaction."""
        taken: list[SpecColumns] = []

        def take() -> Iterator[SpecColumns]:
            for chunk in chunks:
                taken.append(chunk)
                yield chunk

        each = take()
        with self._errors.translate("enqueue"):
            stored = await self._dialect.enqueue_columns(each, count)
        if not stored:
            for _ in each:  # the chunks not taken yet: made and checked too
                pass
            specs = [spec for chunk in taken for spec in chunk.specs()]
            return [result.job_id for result in await self.enqueue_many(specs)]
        self._dialect.note_inserts(count)
        return [job_id for chunk in taken for job_id in chunk.ids]

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
        if len(specs) == 1:
            return [await self.enqueue_one_on_driver_connection(conn, specs[0])]
        enqueue = self._dialect.driver_enqueue()
        check_all(specs, self._max_payload_bytes)
        with self._errors.translate("enqueue_in_transaction"):
            return await enqueue(conn, specs, [None] * len(specs), self._epoch)

    async def enqueue_one_on_driver_connection(self, conn: Any, spec: JobSpec) -> EnqueueResult:
        """:meth:`enqueue_on_driver_connection` of ``spec`` alone (``enqueue_in_async``
        on an asyncpg connection): the same checks and statement, the args encoded once
        for the size check and the row, and no batch around the job.

        :raises PayloadTooLargeError: the job's args and kwargs exceed
            ``max_payload_bytes``; nothing is inserted.
        """
        with self._errors.translate("enqueue_in_transaction"):
            return await self._dialect.enqueue_one_on_driver(conn, spec, self._max_payload_bytes)

    async def enqueue_columns_on_driver_connection(
        self, conn: Any, jobs: SpecColumns
    ) -> list[uuid.UUID]:
        """:meth:`enqueue_on_driver_connection` of ``jobs`` (one task and its options, many
        argument sets): the same checks and rows, by column, with no spec per job unless
        they must go the careful way (inside a transaction open on ``conn``, a payload to
        offload, a refused statement). The new jobs' ids, in order.

        :raises PayloadTooLargeError: a job's args and kwargs exceed ``max_payload_bytes``;
            nothing of the batch is inserted.
        """
        if not len(jobs):
            return []
        check_columns(jobs, self._max_payload_bytes)
        with self._errors.translate("enqueue_in_transaction"):
            if await self._dialect.enqueue_columns_on_driver(conn, jobs):
                return jobs.ids
            specs = jobs.specs()
            enqueue = self._dialect.driver_enqueue()
            results = await enqueue(conn, specs, [None] * len(specs), self._epoch)
        return [result.job_id for result in results]

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
        exclude_queues: Collection[str] = (),
        tasks: Collection[str] | None = None,
        exclude_keys: Collection[tuple[str, str]] = (),
    ) -> list[Job]:
        queues, exclude = _queue_filter(queues, exclude_queues)
        if not modes or limit <= 0 or queues == set() or (tasks is not None and not tasks):
            return []
        keys = sorted(set(exclude_keys))
        with self._errors.translate("select_eligible"):
            return await self._dialect.select_eligible(
                modes, queues, exclude, limit, skip, tasks, keys
            )

    async def next_run_at(
        self,
        *,
        modes: Collection[ExecutionMode],
        queues: Collection[str] | None = None,
        exclude_queues: Collection[str] = (),
    ) -> datetime | None:
        queues, exclude = _queue_filter(queues, exclude_queues)
        if not modes or queues == set():
            return None
        with self._errors.translate("next_run_at"):
            return await self._dialect.next_run_at(modes, queues, exclude)

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

    async def cancel(self, job_id: uuid.UUID) -> Job | None:
        """The cancel (:meth:`CoreQueries.cancel`), then the walk of the job's dependents
        (:func:`broker.dependencies.propagate`) in a transaction of its own on the hot
        path: a crash between the two leaves edges to count, which :meth:`setup` walks.
        The walk is idempotent (each edge counts once), so a cancel repeated walks nothing."""
        job = await super().cancel(job_id)
        if job is not None and job.status is JobStatus.CANCELLED:
            await self._dialect.propagate([(job_id, JobStatus.CANCELLED)])
        return job

    async def warm_up(self) -> None:
        with self._errors.translate("warm_up"):
            await self._dialect.warm_up()

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

    # ------------------------------------------------------------------ notifications

    def on_due(self, notice: Callable[[], None]) -> None:
        """:class:`broker.storage.SupportsDueNotice`: SQLite's settles call ``notice``
        when they made waiting jobs due; PostgreSQL's notify instead."""
        self._dialect.on_due(notice)

    def on_ended(self, notice: Callable[[list[uuid.UUID]], None]) -> None:
        """:class:`broker.storage.SupportsEndNotice`: the dependents a settle or a cancel
        cancelled, after its commit."""
        self._dialect.on_ended(notice)

    def listen(self, on_wake: Callable[[], None]) -> AbstractAsyncContextManager[None]:
        """While open, ``on_wake()`` runs whenever any process inserts a job (PostgreSQL).

        Notifications come from a trigger on ``broker_jobs``, so inserts made by other
        brokers, other adapters or plain SQL all wake the listener. If the listening
        connection is lost, ``on_wake`` is called once more and a warning is logged;
        the caller's polling timer takes over from there.
        """
        return self._dialect.listen(on_wake, self)


__all__ = ["SQLAlchemyAdapter"]


def _queue_filter(
    queues: Collection[str] | None, exclude: Collection[str]
) -> tuple[set[str] | None, list[str]]:
    """A dispatch read's queues as the dialects take them: the queues wanted (``None``:
    all) and, only when all are wanted, those left out (sorted), never both."""
    if queues is None:
        return None, sorted(set(exclude))
    return set(queues) - set(exclude), []
