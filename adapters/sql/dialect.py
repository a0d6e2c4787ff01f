"""What a dialect of the SQL store is (:class:`Dialect`), and the choice of one.

procrastinate's connector is the model: the adapter (:mod:`adapters.sql.adapter`) states
what each call does, and a narrow object per engine says how, its statements its own.
The choice is made once, at construction (:func:`open_dialect`); no method of the
adapter asks which engine it has.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from datetime import datetime
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

from adapters.sql.connect import require_driver
from adapters.sql.enqueue import DriverEnqueue, EnqueueRule
from adapters.sql.errors import StoreErrors
from broker.exceptions import ConfigurationError
from broker.jobs import (
    CheckpointSave,
    Claim,
    EnqueueResult,
    ExecutionMode,
    Job,
    JobSpec,
    JobStatus,
    ProgressUpdate,
    Settlement,
    SpecColumns,
)
from broker.storage import Capabilities, LeaderRecord


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

    enqueue_order: sa.ColumnElement[Any]
    """What orders jobs of one creation time as they were enqueued (PostgreSQL: ``seq``;
    SQLite: ``rowid``)."""

    def before_migrate(self, conn: sa.Connection) -> None: ...
    def lock_rows(self, select: sa.Select[Any]) -> sa.Select[Any]: ...
    async def close(self) -> None: ...
    async def select_eligible(
        self,
        modes: Collection[ExecutionMode],
        queues: Collection[str] | None,
        exclude: Sequence[str],
        limit: int,
        skip: Collection[uuid.UUID],
        tasks: Collection[str] | None,
        exclude_keys: Sequence[tuple[str, str]],
    ) -> list[Job]: ...
    async def next_run_at(
        self,
        modes: Collection[ExecutionMode],
        queues: Collection[str] | None,
        exclude: Sequence[str],
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
    async def enqueue_one_on_driver(
        self, conn: Any, spec: JobSpec, limit: int | None
    ) -> EnqueueResult: ...
    async def enqueue_columns_on_driver(self, conn: Any, jobs: SpecColumns) -> bool: ...
    async def enqueue_columns(self, chunks: Iterator[SpecColumns], count: int) -> bool: ...
    async def propagate(self, ended: Sequence[tuple[uuid.UUID, JobStatus]] | None) -> None: ...
    def note_inserts(self, count: int) -> None: ...
    async def warm_up(self) -> None: ...
    async def elect(self, holder: str, address: str, ttl: float) -> LeaderRecord | None: ...
    async def renew(self, holder: str, epoch: int, ttl: float) -> bool: ...
    async def resign(self, holder: str, epoch: int) -> None: ...
    def listen(
        self, on_wake: Callable[[], None], where: object
    ) -> AbstractAsyncContextManager[None]: ...
    def on_due(self, notice: Callable[[], None]) -> None: ...
    def on_ended(self, notice: Callable[[list[uuid.UUID]], None]) -> None: ...


def open_dialect(
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
    enqueue: EnqueueRule,
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
