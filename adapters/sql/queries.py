"""The store's calls that SQLAlchemy Core carries out alike on either engine: operator
actions (cancel, retry), inspection (a job, listings, counts, the task catalog) and
pruning, over the adapter's read and write transactions. None is on the hot path; each
runs on the general pool, its errors translated at the store's door.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncConnection

from adapters.sql.dialect import Dialect
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
    job_edges,
    job_links,
    jobs,
    payloads,
    queue_settings,
    task_catalog,
)
from broker import dependencies, settlement
from broker.dependencies import Edge
from broker.exceptions import StorageError, UniqueKeyTakenError
from broker.jobs import TERMINAL_STATUSES, Clock, Job, JobStatus, JSONValue
from broker.model.rates import Rate
from broker.storage import (
    JobFilter,
    JobPage,
    QueueCount,
    QueueSettings,
    StoredWorkflow,
    TaskRecord,
)

_QUEUED = JobStatus.QUEUED.value
_SETTLED_BY_OTHERS = (JobStatus.QUEUED.value, JobStatus.HANDED_OFF.value)
"""Statuses a claim or a settle moves a job out of while a workflow's retry runs."""
_READ_ROUNDS = 5
"""Reads of rows and their payloads before a payload that keeps vanishing between the
two is an error (see :meth:`CoreQueries._read_with_bodies`)."""


def _status_in(statuses: Collection[str]) -> sa.ColumnElement[bool]:
    """A status test written as the partial indexes' predicates are (inline literals, one
    status as ``=``), so the planner can prove one applies: a main's start-up lists the
    handed-off jobs, and with the status a bound parameter neither backend could use the
    index of handed-off jobs, and walked every row of the table (on SQLite, the creation
    index; on PostgreSQL, a scan of the whole table), however deep the queued backlog."""
    if len(statuses) == 1:
        (status,) = statuses
        return jobs.c.status == sa.literal(status, sa.Text(), literal_execute=True)
    return jobs.c.status.in_(
        sa.bindparam("statuses", sorted(statuses), expanding=True, literal_execute=True)
    )


_T = TypeVar("_T")


class CoreQueries:
    """The SQLAlchemy Core half of :class:`~adapters.sql.adapter.SQLAlchemyAdapter`,
    which sets the store up and adds the hot path."""

    _dialect: Dialect
    _errors: StoreErrors
    _clock: Clock
    _url_text: str

    async def count_payloads(self) -> int:
        stmt = sa.select(sa.func.count()).select_from(payloads)
        async with self._read("count_payloads") as conn:
            return int((await conn.execute(stmt)).scalar_one())

    # ------------------------------------------------------------------ plumbing

    def _now(self) -> int:
        return to_us(self._clock())

    _unfinished: set[asyncio.Task[Any]]
    """The writes under way, each in a task of its own so that its caller's cancellation
    does not cut it off (:meth:`_write`); ``close`` waits for them before it disposes of
    the engine (a write cut off by the dispose would leave its connection unclosed)."""

    async def _write(self, op: str, body: Callable[[AsyncConnection], Awaitable[_T]]) -> _T:
        """``body`` in one write transaction, run to its commit or rollback even if the
        caller is cancelled meanwhile (the caller's cancellation is raised at once);
        driver errors come out as :class:`StorageError`.

        aiosqlite runs a statement in its connection's thread, which a cancelled await
        does not stop; SQLAlchemy then dropped the connection without the rollback
        reaching SQLite, so the write transaction stayed open and every later write on
        the file waited out the busy timeout and failed with "database is locked" (found
        as a flaky retention test, whose end cancels a prune). Every write here is an
        operator's or a bounded batch, so letting it finish costs little."""

        async def transaction() -> _T:
            with self._errors.translate(op):
                async with self._dialect.write_lock, self._dialect.write_engine.begin() as conn:
                    return await body(conn)

        task = asyncio.ensure_future(transaction())
        self._unfinished.add(task)
        task.add_done_callback(self._unfinished.discard)
        return await asyncio.shield(task)

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

        async def cancelling(conn: AsyncConnection) -> Job | None:
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

        return await self._write("cancel", cancelling)

    async def retry_dead(self, job_id: uuid.UUID) -> Job | None:
        now_us = self._now()
        update = (
            sa.update(jobs)
            .where(jobs.c.id == job_id, jobs.c.status == JobStatus.FAILED.value)
            .values(**encode_changes(settlement.revive(from_us(now_us)).changes))
            .returning(*jobs.c)
        )

        async def reviving(conn: AsyncConnection) -> Job | None:
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
            if row is None:
                return None
            return job_from_row(row, await sa_bodies(conn, [row]))

        try:
            return await self._write("retry_dead", reviving)
        except StorageError as exc:
            # A job holding the key was enqueued (by another process) after the check.
            if isinstance(exc.__cause__, sa_exc.IntegrityError):
                raise UniqueKeyTakenError(
                    f"job {job_id} cannot be retried: another job took its unique key while "
                    "it is queued or running"
                ) from exc
            raise

    def _workflow_order(self) -> list[sa.ColumnElement[Any]]:
        """Enqueue order: creation time, then ``seq`` (PostgreSQL) or ``rowid`` (SQLite),
        since the jobs of one enqueue share a creation time."""
        return [jobs.c.created_us, self._dialect.enqueue_order, jobs.c.id]

    async def _workflow_edges(
        self, conn: AsyncConnection, members: Sequence[uuid.UUID]
    ) -> list[Edge]:
        edges: list[Edge] = []
        for chunk in in_chunks(list(members)):
            rows = await conn.execute(
                sa.select(job_edges.c.child_id, job_edges.c.parent_id, job_edges.c.done)
                .where(job_edges.c.child_id.in_(chunk))
                .order_by(job_edges.c.child_id, job_edges.c.position)
            )
            edges += [Edge(r.child_id, r.parent_id, bool(r.done)) for r in rows]
        return edges

    @staticmethod
    def _members_of(workflow_id: uuid.UUID) -> sa.Select[Any]:
        """The ids of the workflow's jobs: of ``workflow_id``, or of the workflow of the job
        of that id (see :meth:`broker.storage.SupportsWorkflows.get_workflow`)."""
        of_job = (
            sa.select(job_links.c.workflow_id)
            .where(job_links.c.job_id == workflow_id)
            .scalar_subquery()
        )
        wanted = sa.func.coalesce(of_job, workflow_id)
        return sa.select(job_links.c.job_id).where(job_links.c.workflow_id == wanted)

    async def get_workflow(self, workflow_id: uuid.UUID, *, limit: int) -> StoredWorkflow | None:
        member_ids = self._members_of(workflow_id)
        columns: list[Any] = SUMMARY_COLUMNS
        stmt = (
            sa.select(*columns)
            .where(jobs.c.id.in_(member_ids))
            .order_by(*self._workflow_order())
            .limit(limit + 1)
        )
        async with self._read("get_workflow") as conn, conn.begin():
            rows = (await conn.execute(stmt)).mappings().all()
            if not rows:
                return None
            found = {r["id"]: job_from_row(r) for r in rows[:limit]}
            edges = await self._workflow_edges(conn, list(found))
            first = await conn.execute(
                sa.select(job_links.c.workflow_id).where(job_links.c.job_id == rows[0]["id"])
            )
            resolved = first.scalar_one()
        order = dependencies.parents_first(list(found), edges)
        return StoredWorkflow(
            resolved, [found[j] for j in order], edges, truncated=len(rows) > limit
        )

    async def retry_workflow(self, workflow_id: uuid.UUID) -> list[uuid.UUID]:
        member_ids = self._members_of(workflow_id)
        columns = (jobs.c.id, jobs.c.status, jobs.c.last_error, jobs.c.unique_key)
        # Only the members no settle can move are locked (the running ones are read):
        # a settle locks its job, then its dependents; locking a running member after
        # a dependent, in id order, could deadlock with it. A running member's end that
        # commits first is read here; one that commits after waits on the dependents'
        # locks and then sees them as this retry left them.
        locked = self._dialect.lock_rows(
            sa.select(*columns)
            .where(jobs.c.id.in_(member_ids), jobs.c.status.not_in(_SETTLED_BY_OTHERS))
            .order_by(jobs.c.id)
        )

        async def retrying(conn: AsyncConnection) -> list[uuid.UUID]:
            rows = (await conn.execute(locked)).all()
            rows += (
                await conn.execute(
                    sa.select(*columns).where(
                        jobs.c.id.in_(member_ids), jobs.c.status.in_(_SETTLED_BY_OTHERS)
                    )
                )
            ).all()
            by_id = {r.id: r for r in rows}
            edges = await self._workflow_edges(conn, list(by_id))
            outside = sorted({e.parent for e in edges} - set(by_id))
            parent_status: dict[uuid.UUID, JobStatus] = {}
            for chunk in in_chunks(outside):
                for r in await conn.execute(
                    sa.select(jobs.c.id, jobs.c.status).where(jobs.c.id.in_(chunk))
                ):
                    parent_status[r.id] = JobStatus(r.status)
            created = (
                (
                    await conn.execute(
                        sa.select(jobs.c.id)
                        .where(jobs.c.id.in_(list(by_id)))
                        .order_by(*self._workflow_order())
                    )
                )
                .scalars()
                .all()
                if by_id
                else []
            )
            order = dependencies.parents_first(list(created), edges)
            members = [
                dependencies.Member(j, JobStatus(by_id[j].status), by_id[j].last_error)
                for j in order
            ]
            plan = dependencies.retry_plan(members, edges, parent_status)
            for job_id in plan.requeue:
                key = by_id[job_id].unique_key
                if key is not None:
                    await self._refuse_if_unique_key_held(conn, job_id, key)
            now_us = self._now()
            revive = encode_changes(settlement.revive(from_us(now_us)).changes)
            for chunk in in_chunks(list(plan.requeue)):
                await conn.execute(
                    sa.update(jobs)
                    .where(jobs.c.id.in_(chunk), jobs.c.status == JobStatus.FAILED.value)
                    .values(**revive)
                )
            for chunk in in_chunks(list(plan.revive)):
                await conn.execute(
                    sa.update(jobs)
                    .where(jobs.c.id.in_(chunk), jobs.c.status == JobStatus.CANCELLED.value)
                    .values(status=JobStatus.WAITING.value, last_error=None, updated_us=now_us)
                )
            if plan.reopen:
                await conn.execute(
                    sa.update(job_edges)
                    .where(
                        job_edges.c.child_id == sa.bindparam("c"),
                        job_edges.c.parent_id == sa.bindparam("p"),
                    )
                    .values(done=False),
                    [{"c": c, "p": p} for c, p in plan.reopen],
                )
            if plan.pending:
                await conn.execute(
                    sa.update(job_links)
                    .where(job_links.c.job_id == sa.bindparam("c"))
                    .values(pending=sa.bindparam("n")),
                    [{"c": c, "n": n} for c, n in plan.pending.items()],
                )
            return [*plan.requeue, *plan.revive]

        return await self._write("retry_workflow", retrying)

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

        async def declaring(conn: AsyncConnection) -> None:
            await conn.execute(delete)
            if rows:
                await conn.execute(sa.insert(task_catalog), rows)

        await self._write("declare_tasks", declaring)

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

    async def queue_settings(self) -> list[QueueSettings]:
        select = sa.select(queue_settings).order_by(queue_settings.c.queue)
        async with self._read("queue_settings") as conn:
            rows = (await conn.execute(select)).mappings().all()
        return [
            QueueSettings(
                queue=row["queue"],
                paused=bool(row["paused"]),
                rate=None
                if row["rate_count"] is None
                else Rate(row["rate_count"], row["rate_per"], row["rate_burst"]),
            )
            for row in rows
        ]

    async def save_queue_settings(self, settings: QueueSettings) -> None:
        rate = settings.rate
        row = {
            "queue": settings.queue,
            "paused": settings.paused,
            "rate_count": None if rate is None else rate.count,
            "rate_per": None if rate is None else rate.per,
            "rate_burst": None if rate is None else rate.burst,
        }

        async def saving(conn: AsyncConnection) -> None:
            await conn.execute(
                sa.delete(queue_settings).where(queue_settings.c.queue == settings.queue)
            )
            if not settings.empty:
                await conn.execute(sa.insert(queue_settings), [row])

        await self._write("save_queue_settings", saving)

    async def forget_tasks(
        self, live_workers: Collection[str], seen_at: datetime, gone_before: datetime
    ) -> int:

        async def forgetting(conn: AsyncConnection) -> int:
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

        return await self._write("forget_tasks", forgetting)

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
        created: sa.ColumnElement[Any] = jobs.c.created_us
        if job_filter is not None:
            if job_filter.statuses is not None:
                statuses = {JobStatus(s) for s in job_filter.statuses}
                conds.append(_status_in({s.value for s in statuses}))
                if statuses == {JobStatus.HANDED_OFF}:
                    # The jobs in flight (a main's start-up lists them), a few per worker
                    # slot: read from their own index and sorted. With the bare column in
                    # the order and the cursor, SQLite walked the creation index instead,
                    # through every queued job of a backlog.
                    created = jobs.c.created_us + sa.literal(
                        0, sa.BigInteger(), literal_execute=True
                    )
            if job_filter.queues is not None:
                conds.append(jobs.c.queue.in_(sorted(set(job_filter.queues))))
            if job_filter.tasks is not None:
                conds.append(jobs.c.task.in_(sorted(set(job_filter.tasks))))
        if cursor is not None:
            created_us, last_id = decode_cursor(cursor)
            conds.append(sa.tuple_(created, jobs.c.id) < (created_us, last_id))
        stmt = (
            sa.select(*(jobs.c if include_payload else SUMMARY_COLUMNS))
            .where(*conds)
            .order_by(created.desc(), jobs.c.id.desc())
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
        # A parent stays while a child waits on it: the child reads its result when due.
        child = jobs.alias("child")
        awaited = sa.exists().where(
            job_edges.c.parent_id == jobs.c.id,
            child.c.id == job_edges.c.child_id,
            child.c.status == JobStatus.WAITING.value,
        )
        conds: list[sa.ColumnElement[bool]] = [
            status_in,
            sa.or_(sa.not_(jobs.c.has_dependents), sa.not_(awaited)),
        ]
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

        async def one_batch(conn: AsyncConnection) -> tuple[int, int]:
            # The ids first, then a delete by primary key: one ``DELETE ... IN (subquery)``
            # leaves the join to the planner, and with statistics taken while the jobs were
            # still queued PostgreSQL chose a plan that took seconds per batch.
            ids = list((await conn.execute(batch)).scalars())
            if not ids:
                return 0, 0
            # Re-check the status on the row itself: a job may have been revived.
            delete = sa.delete(jobs).where(jobs.c.id.in_(ids), status_in)
            return len(ids), (await conn.execute(delete)).rowcount

        async def idle_counters(conn: AsyncConnection) -> None:
            # Idle counters of keys no job holds; a claim re-creates them on demand.
            await conn.execute(sa.delete(concurrency).where(concurrency.c.active <= 0))

        deleted = 0
        while True:
            found, count = await self._write("prune", one_batch)
            deleted += count
            if found < batch_size:
                break
        await self._write("prune", idle_counters)
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
