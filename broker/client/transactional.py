"""Enqueue jobs inside the application's own database transaction.

A web request that saves an order and enqueues "ship it" through the main makes two
commits; a crash between them leaves an order with no job, or a job for an order that
was rolled back. When the broker's store is the application's own database (the same
SQLite file, or the same PostgreSQL database), :func:`enqueue_in` and
:func:`enqueue_in_async` instead insert the job on the application's connection, so
it commits or rolls back with the application's rows.

They take what the application already holds: a SQLAlchemy ``Session`` or
``Connection`` (sync), or an ``AsyncSession`` or ``AsyncConnection`` (asyncio). The
job gets the same checks as an enqueue through the main (the job's own validation,
the payload limit) and the same duplicate rules (an ``idempotency_key`` or an active
``unique_key`` already taken returns the stored job with ``duplicate=True``; the key
reused for a different job raises ``IdempotencyConflictError``). Nobody
needs to tell the main: on PostgreSQL the table's insert trigger notifies it at
commit (LISTEN/NOTIFY never delivers an uncommitted insert), and on SQLite its poll
finds the job within ``poll_interval``.

The task catalog (:mod:`broker.core.catalog`) is not consulted: the main, which holds it,
is not involved, and reading the store's copy inside the application's transaction
would add a query (and a lock wait on PostgreSQL) to every enqueue for a check the task
object already makes. A job by name gets the broker's defaults for what it leaves out;
pass the task object for its ``@task`` defaults.

The rows are written by the SQL store's own code (:mod:`adapters.sql`), so they are
exactly what ``broker-main`` writes; this module only turns the application's handle
and a task into that call.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

import sqlalchemy as sa
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_scoped_session
from sqlalchemy.orm import Session, scoped_session

from broker.exceptions import ConfigurationError, InvalidJobError
from broker.jobs import (
    EnqueueResult,
    ExecutionMode,
    JobSpec,
    JSONValue,
    SpecColumns,
    keyword_sets,
    utcnow,
)
from broker.model.values import check_delay
from broker.payload import DEFAULT_MAX_PAYLOAD_BYTES
from broker.tasks.registry import Task

if TYPE_CHECKING:
    from adapters.sql import SQLAlchemyAdapter, SyncStatements

_STORE_DIALECTS = ("postgresql", "sqlite")

SyncTarget = Session | scoped_session[Any] | sa.Connection
"""What :func:`enqueue_in` writes through: a session (Flask-SQLAlchemy's ``db.session``
is a ``scoped_session``) or a connection."""
AsyncTarget = AsyncSession | async_scoped_session[Any] | AsyncConnection
"""What :func:`enqueue_in_async` writes through. On PostgreSQL it also takes an
``asyncpg`` connection (asyncpg has no types to name here), on which a job costs the
application a quarter of the CPU (no statement to build, no ``BEGIN`` and ``COMMIT`` of its
own): inside the transaction open on it, if any, else committed at once."""


class EnqueueOptions(TypedDict, total=False):
    """A job's options, as :meth:`broker.Client.enqueue` takes them; a ``Task`` gives the
    defaults of those left out."""

    queue: str
    priority: int
    run_at: datetime
    delay: float
    """Seconds from now (this process's clock); the alternative to ``run_at``."""
    idempotency_key: str
    max_attempts: int
    timeout: float
    execution_mode: ExecutionMode | str
    concurrency_key: str
    concurrency_limit: int
    unique_key: str


def job_spec(
    task: str | Task[..., Any],
    args: Sequence[JSONValue] = (),
    kwargs: Mapping[str, JSONValue] | None = None,
    **options: Unpack[EnqueueOptions],
) -> JobSpec:
    """The job that enqueuing ``task`` with these arguments and options stores.

    :raises InvalidJobError: an option is invalid (the job's own checks).
    """
    given: dict[str, Any] = {k: v for k, v in options.items() if v is not None}
    if type(task) is str and _SHARED_OPTIONS.issuperset(given):
        try:
            template = _options_spec(task, **given)
        except TypeError:
            pass  # an option that cannot key the cache (a list): made and checked below
        else:
            return template.with_arguments(tuple(args), dict(kwargs or {}))
    delay = given.pop("delay", None)
    if delay is not None:
        if "run_at" in given:
            raise InvalidJobError("give run_at or delay, not both")
        try:
            check_delay("delay", float(delay))
        except (TypeError, ValueError) as exc:
            raise InvalidJobError(str(exc)) from None
        given["run_at"] = utcnow() + timedelta(seconds=float(delay))
    # A mode given by name ("pooled") is the job's own check to convert (JobSpec).
    if isinstance(task, Task):
        task.check_arguments(args, kwargs or {})  # a job that could never run is refused here
        return task.spec(args, kwargs, **given)
    return JobSpec(task=task, args=tuple(args), kwargs=dict(kwargs or {}), **given)


_SHARED_OPTIONS = frozenset(EnqueueOptions.__annotations__) - {
    "delay",
    "run_at",
    "idempotency_key",
    "unique_key",
}
"""The options that many jobs share: a spec with any other (a time or a key that names
one job, or a field of a spec that is no option, such as its ``id``) is made and checked
whole, never from :func:`_options_spec`'s cache."""


@functools.lru_cache(maxsize=256, typed=True)
def _options_spec(task: str, **options: Any) -> JobSpec:
    """A spec of ``task`` with these options and no arguments, checked (its options are a
    whole spec's), for :func:`job_spec` to give each job its arguments
    (:meth:`JobSpec.with_arguments`): a producer that enqueues one task with the same
    options call after call has them checked once. Keyed by each option's type as well
    as its value (``typed``), so that ``priority=True``, equal to ``1`` but refused,
    is never served the spec ``1`` made. An invalid spec raises, and is not cached.

    :raises InvalidJobError: an option is invalid.
    :raises TypeError: an option cannot be hashed, or is not one.
    """
    return JobSpec(task=task, **options)


def enqueue_in(
    target: SyncTarget,
    task: str | Task[..., Any],
    args: Sequence[JSONValue] = (),
    kwargs: Mapping[str, JSONValue] | None = None,
    *,
    schema: str | None = None,
    max_payload_bytes: int | None = DEFAULT_MAX_PAYLOAD_BYTES,
    **options: Unpack[EnqueueOptions],
) -> EnqueueResult:
    """Insert one job in the transaction of ``target`` (a ``Session`` or ``Connection``).

    ``task`` is a registered :class:`~broker.Task` (its defaults apply) or a task name.
    ``schema`` is the PostgreSQL schema of the broker's tables, if the main was given
    one; ``max_payload_bytes`` should match the main's ``--max-payload-bytes``.

    :raises InvalidJobError: the job is invalid; nothing is written.
    :raises PayloadTooLargeError: its arguments are over ``max_payload_bytes``.
    :raises StorageError: the database refused the insert (the transaction is then the
        application's to roll back).
    """
    spec = job_spec(task, args, kwargs, **options)
    [result] = enqueue_many_in(target, [spec], schema=schema, max_payload_bytes=max_payload_bytes)
    return result


def enqueue_many_in(
    target: SyncTarget,
    specs: Sequence[JobSpec],
    *,
    schema: str | None = None,
    max_payload_bytes: int | None = DEFAULT_MAX_PAYLOAD_BYTES,
) -> list[EnqueueResult]:
    """Insert jobs in the transaction of ``target``, all checked before any is written.

    A key repeated within the batch refers back to its first job (``duplicate=True``).
    """
    conn = _sync_connection(target)
    store = _store(conn.engine.url, conn.dialect.name, schema, max_payload_bytes)
    return store.enqueue_in_sync_transaction(conn, specs)


async def enqueue_in_async(
    target: AsyncTarget,
    task: str | Task[..., Any],
    args: Sequence[JSONValue] = (),
    kwargs: Mapping[str, JSONValue] | None = None,
    *,
    schema: str | None = None,
    max_payload_bytes: int | None = DEFAULT_MAX_PAYLOAD_BYTES,
    **options: Unpack[EnqueueOptions],
) -> EnqueueResult:
    """:func:`enqueue_in` for asyncio: in the transaction of an ``AsyncSession`` or an
    ``AsyncConnection``, or on an ``asyncpg`` connection (see :data:`AsyncTarget`)."""
    spec = job_spec(task, args, kwargs, **options)
    if _is_asyncpg(target):
        # Straight to the store's one-job insert: each layer between is a coroutine
        # frame made and run again for every job of a one-at-a-time producer.
        store = _driver_store(schema, max_payload_bytes)
        return await store.enqueue_one_on_driver_connection(target, spec)
    [result] = await enqueue_many_in_async(
        target, [spec], schema=schema, max_payload_bytes=max_payload_bytes
    )
    return result


async def enqueue_many_in_async(
    target: AsyncTarget,
    specs: Sequence[JobSpec],
    *,
    schema: str | None = None,
    max_payload_bytes: int | None = DEFAULT_MAX_PAYLOAD_BYTES,
) -> list[EnqueueResult]:
    """:func:`enqueue_many_in` for asyncio."""
    if _is_asyncpg(target):
        # A connection (or a pool's proxy of one) of asyncpg's own: the main's own insert
        # statement on it, without SQLAlchemy (see enqueue_on_driver_connection).
        return await _driver_store(schema, max_payload_bytes).enqueue_on_driver_connection(
            target, specs
        )
    if isinstance(target, async_scoped_session):
        target = target()
    if isinstance(target, AsyncSession):
        conn = await target.connection()
    elif isinstance(target, AsyncConnection):
        conn = target
    else:
        raise TypeError(
            "enqueue_in_async takes an AsyncSession or an AsyncConnection (got "
            f"{type(target).__name__}); for a Session or Connection use enqueue_in"
        )
    store = _store(conn.engine.url, conn.dialect.name, schema, max_payload_bytes)
    return await store.enqueue_in_transaction(conn, specs)


async def enqueue_each_in_async(
    target: AsyncTarget,
    task: str | Task[..., Any],
    arg_sets: Sequence[Sequence[JSONValue]],
    kwarg_sets: Sequence[Mapping[str, JSONValue]] | None = None,
    *,
    schema: str | None = None,
    max_payload_bytes: int | None = DEFAULT_MAX_PAYLOAD_BYTES,
    **options: Unpack[EnqueueOptions],
) -> list[uuid.UUID]:
    """One job of ``task`` for each of ``arg_sets`` (with the keyword arguments at the
    same place in ``kwarg_sets``, if given), the options given once for all: a bulk
    enqueue as PgQueuer's ``enqueue`` of lists is one. All or none, as
    :func:`enqueue_many_in_async` stores them; the new jobs' ids, in order.

    On an ``asyncpg`` connection outside a transaction, a task given by name goes by
    column, with no :class:`~broker.JobSpec` per job: its options are checked once,
    each job's arguments as a spec checks them, and the rows go in one statement per
    1,000 jobs. A :class:`~broker.Task` (whose keys and argument checks are per job),
    another connection, or an open transaction store the same jobs one spec each.

    :raises InvalidJobError: an option or an argument set is invalid, or the options
        name an ``idempotency_key`` or ``unique_key`` (each names one job: give it per
        job to :func:`enqueue_many_in_async`); nothing is written.
    :raises PayloadTooLargeError: a job's arguments are over ``max_payload_bytes``.
    """
    if isinstance(task, Task):
        kwargs = keyword_sets(len(arg_sets), kwarg_sets)
        specs = [job_spec(task, a, k, **options) for a, k in zip(arg_sets, kwargs, strict=True)]
    else:
        jobs = SpecColumns.of(job_spec(task, **options), arg_sets, kwarg_sets)
        if _is_asyncpg(target):
            store = _driver_store(schema, max_payload_bytes)
            return await store.enqueue_columns_on_driver_connection(target, jobs)
        specs = jobs.specs()
    results = await enqueue_many_in_async(
        target, specs, schema=schema, max_payload_bytes=max_payload_bytes
    )
    return [result.job_id for result in results]


def enqueue_on_statements(
    statements: SyncStatements,
    dialect: str,
    specs: Sequence[JobSpec],
    *,
    schema: str | None = None,
    max_payload_bytes: int | None = DEFAULT_MAX_PAYLOAD_BYTES,
) -> list[EnqueueResult]:
    """Insert jobs through anything that executes SQLAlchemy Core statements like a
    ``Connection`` does (how :mod:`broker.contrib.django` writes through Django's
    cursor); ``dialect`` names its database, ``postgresql`` or ``sqlite``."""
    store = _store(URL.create(dialect), dialect, schema, max_payload_bytes)
    return store.enqueue_in_sync_transaction(statements, specs)


def _is_asyncpg(target: object) -> bool:
    """Whether ``target`` is an asyncpg connection (or a pool's proxy of one)."""
    return type(target).__module__.partition(".")[0] == "asyncpg"


def _sync_connection(target: SyncTarget) -> sa.Connection:
    if isinstance(target, scoped_session):
        target = target()
    if isinstance(target, Session):
        return target.connection()
    if isinstance(target, sa.Connection):
        return target
    if isinstance(target, AsyncSession | AsyncConnection | async_scoped_session):
        raise TypeError(
            f"enqueue_in takes a Session or a Connection; for an {type(target).__name__} "
            "use `await enqueue_in_async(...)`"
        )
    raise TypeError(
        f"enqueue_in takes a SQLAlchemy Session or Connection (got {type(target).__name__})"
    )


@functools.lru_cache(maxsize=32)
def _driver_store(schema: str | None, max_payload_bytes: int | None) -> SQLAlchemyAdapter:
    """:func:`_store` for an asyncpg connection, which names no database: building and
    hashing the ``URL`` that :func:`_store` is cached by took 3.8 µs of every direct
    enqueue (of about 170 µs of the caller's CPU in all); this lookup takes 0.1 µs."""
    return _store(URL.create("postgresql"), "postgresql", schema, max_payload_bytes)


@functools.lru_cache(maxsize=32)
def _store(
    url: URL, dialect: str, schema: str | None, max_payload_bytes: int | None
) -> SQLAlchemyAdapter:
    """The SQL store's code for the application's database, to write through the
    application's connection. Its own engine is never connected: it only names the
    database in error messages, and holds the dialect, schema and payload limit."""
    if dialect not in _STORE_DIALECTS:
        raise ConfigurationError(
            f"the broker's store is SQLite or PostgreSQL; this connection is to {dialect!r}, "
            "so it cannot hold the broker's tables: enqueue through a Client instead"
        )
    from adapters.sql import SQLAlchemyAdapter

    if dialect == "sqlite" and url.database in (None, "", ":memory:"):
        # An in-memory database cannot be the main's store; the name is only for messages.
        url = url.set(database="app-connection")
    return SQLAlchemyAdapter(
        url.set(drivername=dialect).render_as_string(hide_password=False),
        schema=schema,
        max_payload_bytes=max_payload_bytes,
    )


__all__ = [
    "EnqueueOptions",
    "enqueue_each_in_async",
    "enqueue_in",
    "enqueue_in_async",
    "enqueue_many_in",
    "enqueue_many_in_async",
    "enqueue_on_statements",
    "job_spec",
]
