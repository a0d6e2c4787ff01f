"""The one insert-or-find enqueue of the SQL store, and the connections it runs over.

Rule: an enqueue inserts each job unless a job already blocks it, and returns the blocker
instead (a duplicate), in the order :func:`broker.settlement.blocking_holder` states; a
repeat within one batch refers to its first. Every entry point runs the same coroutine
(:meth:`EnqueueRule.run`) over its own ``insert`` and ``find``: the main's (each dialect's
own statements), an application's ``AsyncConnection`` or synchronous connection
(SQLAlchemy Core, :meth:`EnqueueRule.on_connection`) and PostgreSQL's driver connection.

The application's own connection: all the rule does with it is ``await
conn.execute(statement, parameters)``, so a transactional enqueue runs on whatever
connection the application holds, synchronous or not, by handing it an object with just
that method (:func:`statements`); over a synchronous one none of the rule's awaits
suspends, and :func:`complete_now` runs it without an event loop.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol, TypeVar, cast

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from adapters.sql.links import linked
from adapters.sql.rows import (
    ARGS_IN_VALUES,
    KWARGS_IN_VALUES,
    NULL_ROW,
    Payload,
    from_us,
    in_chunks,
    kept,
    moves_out,
    new_columns,
    new_row,
    offload,
    sa_bodies,
    whole_jobs,
)
from adapters.sql.schema import IS_ACTIVE, OFFLOADABLE, jobs, payloads
from broker import settlement
from broker.exceptions import InvalidJobError, StorageError
from broker.jobs import (
    Claim,
    EnqueueResult,
    Job,
    JobSpec,
    SpecColumns,
    check_idempotent_repeat,
    new_jobs_columns,
)

_T = TypeVar("_T")
_Rows = TypeVar("_Rows")


class SyncStatements(Protocol):
    """What a synchronous transactional enqueue needs of a connection:
    ``sa.Connection.execute``'s shape (results with ``scalars()`` and ``mappings()``)."""

    def execute(
        self, statement: Any, parameters: Any = None, *, execution_options: Any = None
    ) -> Any: ...


class _Statements:
    def __init__(self, execute: Callable[[Any, Any], Awaitable[Any]]) -> None:
        self.execute = execute


def statements(execute: Callable[[Any, Any], Awaitable[Any]]) -> AsyncConnection:
    """A stand-in for an ``AsyncConnection`` whose ``execute`` is ``execute``: the only
    method the enqueue code calls."""
    return cast(AsyncConnection, _Statements(execute))


def complete_now(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run a coroutine that never suspends (its awaits reach only synchronous calls), so a
    synchronous caller needs no event loop."""
    try:
        coro.send(None)
    except StopIteration as done:
        return cast(_T, done.value)
    coro.close()
    raise RuntimeError("a synchronous enqueue waited on I/O; its connection must be synchronous")


_ENQUEUE_ROUNDS = 5
"""How often an enqueue retries when the job holding its key vanishes mid-transaction."""

Insert = Callable[[list[dict[str, Any]], list[Payload]], Awaitable[set[uuid.UUID]]]
"""Stores rows unless a key or id is taken, with the offloaded payloads of those it
stored; returns the ids stored."""
Overlap = Callable[
    [Insert, Iterator[tuple[list[dict[str, Any]], list[Payload]]]], Awaitable[set[uuid.UUID]]
]

DriverEnqueue = Callable[
    [Any, Sequence[JobSpec], Sequence[Claim | None], int | None], Awaitable[list[EnqueueResult]]
]
"""An enqueue on a driver's own connection (see ``PostgresDialect.enqueue_on_driver``)."""

OVERLAP_CHUNK = 250
"""Jobs per statement where a batch's rows are built while the rows before are written."""


async def overlapped(
    insert: Callable[[_Rows, list[Payload]], Awaitable[set[uuid.UUID]]],
    batches: Iterator[tuple[_Rows, list[Payload]]],
) -> set[uuid.UUID]:
    """``insert`` each of ``batches`` in turn (on one connection, in one transaction), the
    next one built while the server writes the one before. Taking the next batch from
    the iterator builds it: the jobs and rows of a bulk enqueue cost the main about as
    much CPU as their insert costs the server, and one statement for the whole batch
    made each wait for the other. A statement is never left running: an error or a
    cancellation waits for the one in flight (cancelled, for a cancellation)."""
    stored: set[uuid.UUID] = set()
    ahead: asyncio.Future[set[uuid.UUID]] | None = None
    try:
        for rows, moved in batches:
            if ahead is not None:
                stored |= await ahead
            ahead = asyncio.ensure_future(insert(rows, moved))
            await asyncio.sleep(0)  # its statement goes out before the next batch is built
        if ahead is not None:
            stored |= await ahead
    except BaseException as exc:
        if ahead is not None and not ahead.done():
            if isinstance(exc, asyncio.CancelledError):
                ahead.cancel()
            await asyncio.wait([ahead])
            if not ahead.cancelled():
                ahead.exception()  # retrieved: the error raised here is the one that counts
        raise
    return stored


class EnqueueRule:
    """The enqueue rule of one store: its clock (``now``, in microseconds), the size
    over which a payload moves out of its row (``offload_threshold``) and its name in
    messages (``where``)."""

    def __init__(self, now: Callable[[], int], offload_threshold: int | None, where: str) -> None:
        self._now = now
        self._offload_threshold = offload_threshold
        self._where = where

    def row_to_write(
        self, job_id: uuid.UUID, job_fields: Mapping[str, Any]
    ) -> tuple[dict[str, Any], list[Payload]]:
        """A new job's row as an enqueue writes it, and the payloads moved out of it."""
        return offload(job_id, new_row(job_fields), self._offload_threshold)

    def moves_out(self, values: list[Any]) -> bool:
        """Whether a payload of a new job's row as :func:`~adapters.sql.rows.new_values`
        (a full row's values) makes it would move out of the row, which only the row by
        row way (:meth:`row_to_write`) does. A new job's only payloads are its args and
        kwargs (no result or checkpoint yet)."""
        threshold = self._offload_threshold
        return moves_out(values[ARGS_IN_VALUES], threshold) or moves_out(
            values[KWARGS_IN_VALUES], threshold
        )

    def columns_to_write(
        self, specs: Sequence[JobSpec] | SpecColumns, now: datetime
    ) -> dict[str, list[Any]] | None:
        """The rows of the new jobs of ``specs`` (or of the jobs ``specs`` holds by column)
        enqueued at ``now`` (none of them handed off), by column
        (:func:`~adapters.sql.rows.new_columns`); ``None`` when a payload of one would
        move out of its row, which only the row by row way (:meth:`row_to_write`) does."""
        fields = (
            specs.fields(now) if isinstance(specs, SpecColumns) else new_jobs_columns(specs, now)
        )
        columns = new_columns(fields, len(specs))
        threshold = self._offload_threshold
        if threshold is not None and any(
            moves_out(text, threshold)
            for column in OFFLOADABLE
            if column in columns
            for text in columns[column]
        ):
            return None
        return columns

    async def on_connection(
        self,
        conn: AsyncConnection,
        specs: Sequence[JobSpec],
        insert_into: Callable[[sa.Table], Any],
    ) -> list[EnqueueResult]:
        """The rule through SQLAlchemy Core on ``conn`` (an application's own connection,
        see :func:`statements`); ``insert_into`` is the dialect's ``INSERT`` construct
        (one that knows ``ON CONFLICT DO NOTHING``)."""

        async def insert(rows: list[dict[str, Any]], moved: list[Payload]) -> set[uuid.UUID]:
            stmt = insert_into(jobs).on_conflict_do_nothing().returning(jobs.c.id)
            full = [{**NULL_ROW, **row} for row in rows]
            stored = set((await conn.execute(stmt, full)).scalars())
            stored_payloads = kept(moved, stored)
            if stored_payloads:
                await conn.execute(
                    payloads.insert(),
                    [
                        {"job_id": job_id, "kind": kind, "body": body, "digest": digest}
                        for job_id, kind, body, digest in stored_payloads
                    ],
                )
            return stored

        async def find(missing: Sequence[JobSpec]) -> list[Job | None]:
            return await find_holders(conn, missing)

        return await self.run(insert, find, specs, None)

    async def run(
        self,
        insert: Insert,
        find: Callable[[Sequence[JobSpec]], Awaitable[list[Job | None]]],
        specs: Sequence[JobSpec],
        claims: Sequence[Claim | None] | None,
        overlap: Overlap | None = None,
        link: Callable[[Sequence[JobSpec]], Awaitable[None]] | None = None,
        *,
        tried: bool = False,
    ) -> list[EnqueueResult]:
        """Insert ``specs`` (each ``claims[i]``, if any, stores its job handed off, see
        :meth:`~broker.storage.StorageAdapter.enqueue_handed_off`); a duplicate within the
        batch refers to its first.

        The rule over either kind of connection: ``insert`` stores rows unless a key or
        id is taken (returning the ids stored), and the offloaded payloads of the rows it
        stored in the same transaction; ``find`` names what blocked each. With
        ``overlap`` (:func:`overlapped`), a batch is inserted in chunks, each built while
        the one before is written. ``link`` writes the dependency links of the jobs stored
        fresh that have parents or a workflow, in the same transaction (see
        :mod:`adapters.sql.links`); without it such a job is refused. ``tried``: the
        jobs were just inserted as these rows would insert them, and none was stored (a
        store's one-job insert from its values, see ``PostgresDialect._insert_one``):
        the rule starts from finding what blocked them.
        """
        if link is None and linked(specs):
            raise InvalidJobError(
                "jobs with depends_on or a workflow are enqueued through the main or the "
                "store's own enqueue, not in an application's transaction"
            )
        now_us = self._now()
        # Within the batch, a repeated key (or id) refers back to its first occurrence.
        canonical: list[int] = []
        first: dict[tuple[str, object], int] = {}
        for index, spec in enumerate(specs):
            found = first.get(("key", spec.idempotency_key)) if spec.idempotency_key else None
            if found is not None:
                check_idempotent_repeat(spec, specs[found])
            else:
                found = first.get(("id", spec.id))
            if found is None:
                found = index
                first[("id", spec.id)] = index
                if spec.idempotency_key is not None:
                    first[("key", spec.idempotency_key)] = index
            canonical.append(found)
        now = from_us(now_us)

        def enqueued(i: int) -> dict[str, Any]:
            return settlement.enqueued_fields(specs[i], now, claims[i] if claims else None)

        stored = await self._insert_or_find(
            insert, find, specs, sorted(set(canonical)), enqueued, overlap, tried
        )
        if link is not None:
            fresh = [specs[i] for i, r in stored.items() if not r.duplicate]
            if linked(fresh):
                await link([s for s in fresh if s.depends_on or s.workflow_id is not None])
        return [
            stored[c] if c == i else EnqueueResult(stored[c].job, duplicate=True)
            for i, c in enumerate(canonical)
        ]

    async def _insert_or_find(
        self,
        insert: Insert,
        find: Callable[[Sequence[JobSpec]], Awaitable[list[Job | None]]],
        specs: Sequence[JobSpec],
        indices: list[int],
        enqueued: Callable[[int], dict[str, Any]],
        overlap: Overlap | None,
        tried: bool,
    ) -> dict[int, EnqueueResult]:
        """Insert the jobs whose fields ``enqueued(i)`` gives for ``indices`` (into
        ``specs``); a job inserted comes back as given (the row holds exactly its values),
        one blocked comes back as its holder."""
        out: dict[int, EnqueueResult] = {}
        fields_at: dict[int, dict[str, Any]] = {}
        hot: dict[int, dict[str, Any]] = {}
        moved: dict[int, list[Payload]] = {}

        def rows(chunk: Sequence[int]) -> tuple[list[dict[str, Any]], list[Payload]]:
            """The rows of ``chunk``'s jobs, and their offloaded payloads."""
            return [hot[i] for i in chunk], [p for i in chunk for p in moved[i]]

        def build(chunk: Sequence[int]) -> tuple[list[dict[str, Any]], list[Payload]]:
            for i in chunk:
                job_fields = fields_at[i] = enqueued(i)
                hot[i], moved[i] = self.row_to_write(specs[i].id, job_fields)
            return rows(chunk)

        chunks = [indices] if overlap is None else in_chunks(indices, OVERLAP_CHUNK)
        pending = indices
        for attempt in range(_ENQUEUE_ROUNDS):
            if attempt:
                inserted = await insert(*rows(pending))
            elif len(chunks) == 1:
                built = build(indices)
                inserted = set() if tried else await insert(*built)
            else:
                assert overlap is not None
                inserted = await overlap(insert, map(build, chunks))
            missing = []
            if len(inserted) == len(pending):
                # Every row went in (the ids returned are those of rows inserted, and
                # ``pending`` holds each id once): no lookup per job. Each one hashes and
                # compares a driver's UUID with ours, 15% of a bulk enqueue's CPU in
                # the caller on asyncpg.
                out.update((i, EnqueueResult.inserted(fields_at[i])) for i in pending)
                return out
            for i in pending:
                if specs[i].id in inserted:
                    out[i] = EnqueueResult.inserted(fields_at[i])
                else:
                    missing.append(i)
            if not missing:
                return out
            holders = await find([specs[i] for i in missing])
            pending = []
            for i, holder in zip(missing, holders, strict=True):
                if holder is None:
                    pending.append(i)  # the conflicting job was deleted meanwhile: retry
                else:
                    # Raised inside the enqueue's transaction: nothing of the batch stays.
                    check_idempotent_repeat(specs[i], holder)
                    out[i] = EnqueueResult(holder, duplicate=True)
            if not pending:
                return out
        raise StorageError(
            f"enqueue failed on {self._where}: the job holding an idempotency or unique "
            "key kept disappearing (or finishing) between insert and lookup"
        )


async def find_holders(conn: AsyncConnection, specs: Sequence[JobSpec]) -> list[Job | None]:
    """For each spec that did not insert, the stored job that blocked it (see
    :func:`match_holders`)."""
    found: list[Job] = []
    for chunk in in_chunks(specs):
        keys = [s.idempotency_key for s in chunk if s.idempotency_key is not None]
        uniques = [s.unique_key for s in chunk if s.unique_key is not None]
        cond: sa.ColumnElement[bool] = jobs.c.id.in_([s.id for s in chunk])
        if keys:
            cond = sa.or_(cond, jobs.c.idempotency_key.in_(keys))
        if uniques:
            # IS_ACTIVE is the partial unique index's own predicate.
            cond = sa.or_(cond, sa.and_(jobs.c.unique_key.in_(uniques), IS_ACTIVE))
        rows = list((await conn.execute(sa.select(jobs).where(cond))).mappings())
        found.extend(whole_jobs(rows, await sa_bodies(conn, rows)))
    return match_holders(specs, found)


def match_holders(specs: Sequence[JobSpec], found: list[Job]) -> list[Job | None]:
    """For each spec that did not insert, the job among ``found`` that blocked it
    (:func:`broker.settlement.blocking_holder`; ``found`` holds every job that has the id
    or the idempotency key of a spec, or its unique key while active)."""
    by_key = {j.idempotency_key: j for j in found if j.idempotency_key is not None}
    by_id = {j.id: j for j in found}
    by_unique = {j.unique_key: j for j in found if j.unique_key is not None and j.status.is_active}
    return [
        settlement.blocking_holder(spec, by_key.get, by_id.get, by_unique.get) for spec in specs
    ]
