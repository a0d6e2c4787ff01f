"""PostgreSQL: how the SQL store's hot path is carried out (:class:`PostgresDialect`).

Each hot call is one asyncpg statement over arrays, on a pool of its own
(:mod:`adapters.sql.postgres_sql` holds the text and the pools); the values are encoded
and the rows decoded with :mod:`adapters.sql.rows`, as on every other path. Also here:
the enqueue on a driver connection, the election, ``LISTEN`` and the planner's
statistics after bulk inserts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from adapters.sql.connect import redact
from adapters.sql.enqueue import (
    OVERLAP_CHUNK,
    DriverEnqueue,
    EnqueueRule,
    match_holders,
    overlapped,
)
from adapters.sql.errors import StoreErrors
from adapters.sql.links import PgLinks, linked
from adapters.sql.postgres_sql import HotPool, HotSql
from adapters.sql.rows import (
    ARGS_IN_VALUES,
    INSERT_VALUES,
    KWARGS_IN_VALUES,
    NULL_ROW,
    ROWS_JSON,
    Bodies,
    Payload,
    at_us,
    claimed_jobs,
    encode_changes,
    from_us,
    grant,
    in_chunks,
    is_offloaded,
    job_from_record,
    kept,
    moves_out,
    new_values,
    offload,
    result_text,
    selected_job,
    whole_jobs,
)
from adapters.sql.schema import QUIET_INSERTS_SETTING, _qualified, jobs, notify_channel
from broker import dependencies, settlement
from broker.jobs import (
    CheckpointSave,
    Claim,
    EnqueueResult,
    ExecutionMode,
    Job,
    JobSpec,
    JobStatus,
    Outcome,
    ProgressUpdate,
    Settlement,
    SpecColumns,
)
from broker.payload import check_encoded
from broker.storage import Capabilities, LeaderRecord

logger = logging.getLogger("adapters.sql")
_EVERY_AT_ONCE = 1000
"""The most jobs :meth:`PostgresDialect._enqueue_every` inserts in one statement, outside a
transaction: the main's group commits (``--enqueue-batch``, 1,000 by default) go whole."""


class _Offloading(Exception):
    """A job of the batch has a payload to move out of its row: not for the plain insert."""


_ANALYZE_AFTER_INSERTS = 500
_ANALYZE_INTERVAL = 30.0


async def pg_bodies(sql: HotSql, conn: Any, rows: Sequence[Mapping[Any, Any]]) -> Bodies:
    """The offloaded payloads of ``rows`` (an asyncpg connection), in one query."""
    wanted = [r["id"] for r in rows if is_offloaded(r)]
    if not wanted:
        return {}
    found = await conn.fetch(sql.payloads_of, wanted)
    return {(r["job_id"], r["kind"]): (r["body"], r["digest"]) for r in found}


async def pg_put(sql: HotSql, conn: Any, moved: Sequence[Payload]) -> None:
    """Write payload rows on an asyncpg connection, replacing any of the same kind."""
    if moved:
        await conn.execute(sql.put_payloads, *(list(column) for column in zip(*moved, strict=True)))


_COMPLETED = JobStatus.COMPLETED.value


def _completions_only(columns: list[list[Any]], now_us: int) -> bool:
    """Whether the settle statement's arrays (see ``HotSql.settle``) are completions
    alone, each moving exactly as ``HotSql.settle_completed`` does: status completed,
    its result set, its progress done, nothing else changed but ``updated_us`` (the
    batch's one time), no attempt or recovery counted, its slot given back."""
    (_, _, status, set_result, _, set_error, _, run_at, attempts, updated, releases) = columns[:11]
    recoveries, set_holder, progress = columns[11], columns[12], columns[14]
    return (
        all(v == _COMPLETED for v in status)
        and all(v == settlement.DONE for v in progress)
        and all(set_result)
        and all(releases)
        and all(v == now_us for v in updated)
        and all(v is None for v in run_at)
        and not any(set_error)
        and not any(attempts)
        and not any(recoveries)
        and not any(set_holder)
    )


def _keyed(rows: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a job of ``rows`` (as an enqueue writes them: NULLs left out) has a
    concurrency key."""
    return any("concurrency_key" in row for row in rows)


def _claim_arrays(claims: Sequence[Claim]) -> tuple[list[uuid.UUID], list[uuid.UUID], list[str]]:
    """Claims as the ``unnest`` arrays of the hot claim statements."""
    return [c.job_id for c in claims], [c.handoff_id for c in claims], [c.worker_id for c in claims]


class PostgresDialect:
    """How the store's calls run on PostgreSQL: claims, settles, checkpoints, progress
    and selection as one statement each on the hot pool; the main's enqueues on a pool
    of their own; the election on a connection of its own (opened by a main's first
    round only), so a renewal never queues behind claims and settles.

    Errors are left to the caller's door (:meth:`StoreErrors.translate`), but for the
    settle a claim makes of its own.
    """

    capabilities = Capabilities(
        skip_locked=True, listen_notify=True, shared_between_processes=True, leader_election=True
    )
    insert = staticmethod(pg_dialect.insert)
    required_file: str | None = None
    enqueue_order: sa.ColumnElement[Any] = jobs.c.seq

    def __init__(
        self,
        resolved: URL,
        driver: Any,
        *,
        schema: str | None,
        pool_size: int,
        hot_pool_size: int,
        echo: bool,
        read_only: bool,
        single_main: bool,
        now: Callable[[], int],
        offload_threshold: int | None,
        enqueue: EnqueueRule,
    ) -> None:
        self.errors = StoreErrors.for_postgres(redact(resolved), driver)
        self._server_refused: type[BaseException] = driver.PostgresError
        """A statement the server refused: the session is fine, nothing was written."""
        self._id_taken: type[BaseException] = driver.UniqueViolationError
        """What ``HotSql.insert_one_new`` raises when its job's id is taken."""
        self._schema = schema
        self._now = now
        self._offload_threshold = offload_threshold
        self._end_notice: Callable[[list[uuid.UUID]], None] | None = None
        self._enqueue = enqueue
        connect_args: dict[str, Any] = {"server_settings": {"application_name": "broker"}}
        if read_only:
            connect_args["server_settings"]["default_transaction_read_only"] = "on"
        options = {} if schema is None else {"schema_translate_map": {None: schema}}
        self.engine: AsyncEngine = create_async_engine(
            resolved,
            echo=echo,
            pool_size=pool_size,
            execution_options=options,
            connect_args=connect_args,
        )
        self._pool_size = pool_size
        self.write_engine = self.engine
        self.read_engine = self.engine.execution_options(isolation_level="AUTOCOMMIT")
        self.write_lock: AbstractAsyncContextManager[Any] = contextlib.nullcontext()
        _, connect_kwargs = self.engine.dialect.create_connect_args(resolved)
        self._sql = HotSql(schema)
        self._hot = HotPool(hot_pool_size, {**connect_kwargs, **connect_args})
        # A main's own enqueues wake its dispatcher themselves: their sessions skip
        # the insert notification (QUIET_INSERTS_SETTING), which only came back to it.
        quiet = {QUIET_INSERTS_SETTING: "on"} if single_main else {}
        enqueue_args = {
            **connect_args,
            "server_settings": {**connect_args["server_settings"], **quiet},
        }
        self._enqueue_pool = HotPool(pool_size, {**connect_kwargs, **enqueue_args})
        """The main's enqueues: a pool of asyncpg's own, as the hot one, queueing neither
        with dispatch nor with listings and operator calls (checking out a SQLAlchemy
        connection and unwrapping its driver connection cost as much of the main's CPU
        as a one-job insert itself)."""
        self._leader_pool = HotPool(1, {**connect_kwargs, **connect_args})
        self._unanalyzed_inserts = 0
        self._last_analyze = -math.inf
        self._analyzing: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    def before_migrate(self, conn: sa.Connection) -> None:
        """Serialise concurrent setups (several processes starting at once), and create
        the store's schema if it has one."""
        conn.execute(sa.select(sa.func.pg_advisory_xact_lock(self._setup_lock_key())))
        if self._schema is not None:
            quoted = conn.dialect.identifier_preparer.quote_schema(self._schema)
            conn.exec_driver_sql(f"CREATE SCHEMA IF NOT EXISTS {quoted}")

    def _setup_lock_key(self) -> int:
        digest = hashlib.sha256(f"broker.setup:{self._schema or ''}".encode()).digest()
        return int.from_bytes(digest[:8], "big", signed=True)

    def lock_rows(self, select: sa.Select[Any]) -> sa.Select[Any]:
        """``select`` locking the rows it reads until the transaction ends."""
        return select.with_for_update()

    async def close(self) -> None:
        if self._analyzing is not None:
            self._analyzing.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._analyzing
        await self._hot.close()
        await self._enqueue_pool.close()
        await self._leader_pool.close()

    # ------------------------------------------------------------------ dispatch

    async def select_eligible(
        self,
        modes: Collection[ExecutionMode],
        queues: Collection[str] | None,
        exclude: Sequence[str],
        limit: int,
        skip: Collection[uuid.UUID],
        tasks: Collection[str] | None,
        exclude_keys: Sequence[tuple[str, str]],
    ) -> list[Job]:
        wanted: list[Any] = [sorted({ExecutionMode(m).value for m in modes})]
        sql = self._sql
        statement = sql.eligible
        if queues is not None:
            wanted.append(sorted(set(queues)))
            statement = sql.eligible_in_queues
        elif exclude:
            wanted.append(list(exclude))
            statement = sql.eligible_not_in_queues
        of_tasks = None if tasks is None else sorted(set(tasks))
        key_tasks = [task for task, _ in exclude_keys] if exclude_keys else None
        keys = [key for _, key in exclude_keys] if exclude_keys else None
        async with self._hot.acquire() as conn:
            found = await conn.fetch(
                statement, *wanted, self._now(), limit, list(skip), of_tasks, key_tasks, keys
            )
        return [selected_job(r) for r in found]

    async def next_run_at(
        self,
        modes: Collection[ExecutionMode],
        queues: Collection[str] | None,
        exclude: Sequence[str],
    ) -> datetime | None:
        sql = self._sql
        wanted = [sorted({ExecutionMode(m).value for m in modes})]
        async with self._hot.acquire() as conn:
            if queues is not None:
                earliest = await conn.fetchval(sql.next_run_in_queues, *wanted, sorted(queues))
            elif exclude:
                earliest = await conn.fetchval(sql.next_run_not_in_queues, *wanted, list(exclude))
            else:
                earliest = await conn.fetchval(sql.next_run, *wanted)
        return None if earliest is None else from_us(earliest)

    async def claim(self, claims: list[Claim], epoch: int | None) -> list[Job]:
        """One statement claims the wanted jobs, concurrency slots included (see
        ``HotSql.claim``).

        The rare keyed job it cannot decide in one statement (its key has no counter row
        yet, or the key's candidates disagree on the limit) comes back unclaimed and goes
        through :meth:`_claim_keyed`, a short transaction on the same connection.
        """
        now_us = self._now()
        sql = self._sql
        async with self._hot.acquire() as conn:
            by_id = sorted(range(len(claims)), key=lambda i: claims[i].job_id)
            rows = await conn.fetch(
                sql.claim,
                *_claim_arrays([claims[i] for i in by_id]),
                now_us,
                epoch,
                [i + 1 for i in by_id],
            )
            stored = [r for r in rows if r["claimed"]]
            unclaimed = {r["id"] for r in rows if not r["claimed"]}
            keyed = [c for c in claims if c.job_id in unclaimed]  # in claim order
            if keyed:
                stored.extend(await self._claim_keyed(sql, conn, keyed, now_us, epoch))
            bodies = await pg_bodies(sql, conn, stored)
        won, refused = claimed_jobs(
            claims, stored, functools.partial(job_from_record, bodies=bodies)
        )
        if refused:
            # The claim committed; the fenced settle of its leases fails these jobs dead.
            with self.errors.translate("settle"):
                await self.settle(refused, now_us, epoch)
        order = {claim.job_id: i for i, claim in enumerate(claims)}
        return sorted(won, key=lambda job: order[job.id])

    @staticmethod
    async def _claim_keyed(
        sql: HotSql, conn: Any, claims: list[Claim], now_us: int, epoch: int | None
    ) -> list[Any]:
        """Claims of keyed jobs, in one transaction: the epoch fence (held to the
        commit), the rows are locked (skipping any another claimer holds), then their
        counters in key order, then the granted rows are handed off and their slots
        taken. Returns the rows as now stored."""
        async with conn.transaction():
            if epoch is not None:
                await conn.execute(sql.fence, epoch)
            candidates = await conn.fetch(sql.lock_claimable, [c.job_id for c in claims], now_us)
            keys = sorted({r["concurrency_key"] for r in candidates} - {None})
            active = {r["key"]: r["active"] for r in await conn.fetch(sql.lock_counters, keys)}
            granted, taken = grant(
                [(r["id"], r["concurrency_key"], r["concurrency_limit"]) for r in candidates],
                [c.job_id for c in claims],
                active,
            )
            if not granted:
                return []
            if taken:
                await conn.execute(sql.take_slots, list(taken), list(taken.values()))
            chosen = set(granted)
            handed = [c for c in claims if c.job_id in chosen]
            return list(await conn.fetch(sql.hand_off, *_claim_arrays(handed), now_us))

    def on_due(self, notice: Callable[[], None]) -> None:
        """Nothing to do: the settle that makes a child due sends ``pg_notify``, which
        every main listening hears (see :class:`broker.storage.SupportsDueNotice`)."""

    # ------------------------------------------------------------------ fenced reports

    async def settle(
        self, settlements: Sequence[Settlement], now_us: int, epoch: int | None
    ) -> list[bool]:
        """One statement for the whole batch, every shape of move at once, fenced per job
        and giving back the concurrency slots (see ``HotSql.settle``). Only the first
        move per job in a batch can be accepted."""
        first: dict[uuid.UUID, int] = {}
        for i, s in enumerate(settlements):
            first.setdefault(s.job_id, i)
        chosen = [settlements[i] for i in first.values()]
        sql = self._sql
        columns: list[list[Any]] | None = None
        moved: list[Payload] = []
        results = self._completed_results(chosen, now_us)
        if results is None:
            columns, moved = self._settle_columns(chosen, now_us)
        async with self._hot.acquire() as conn:
            if results is not None:
                ids, leases = [s.job_id for s in chosen], [s.handoff_id for s in chosen]
                accepted = {
                    r["id"]
                    for r in await conn.fetch(
                        sql.settle_completed, ids, leases, results, now_us, epoch, settlement.DONE
                    )
                }
            elif not moved:
                assert columns is not None
                accepted = {r["id"] for r in await conn.fetch(sql.settle, *columns, epoch)}
            else:
                # The payloads of the moves the fence lets through, in their transaction.
                assert columns is not None
                async with conn.transaction():
                    accepted = {r["id"] for r in await conn.fetch(sql.settle, *columns, epoch)}
                    await pg_put(sql, conn, kept(moved, accepted))
            if len(accepted) < len(first):
                if columns is None:
                    columns, moved = self._settle_columns(chosen, now_us)
                accepted |= await self._settle_parents(conn, columns, accepted, moved, epoch)
        return [first[s.job_id] == i and s.job_id in accepted for i, s in enumerate(settlements)]

    def _completed_results(
        self, chosen: Sequence[Settlement], now_us: int
    ) -> list[str | None] | None:
        """The results as stored when ``chosen`` are completions alone, none with a result
        to offload: the batch ``HotSql.settle_completed`` settles (and ``None`` otherwise).

        A completion's move (:func:`broker.settlement.settle`) depends on the settlement
        only through its result, so the first one's move, built as every other batch's
        are and checked against that statement (:func:`_completions_only`), stands for
        them all. Building the fifteen columns of every completion, to find that they
        were completions, cost the main 11 to 16 us a job settled on a loaded machine,
        this 2."""
        if not all(s.outcome is Outcome.COMPLETE for s in chosen):
            return None
        columns, moved = self._settle_columns(chosen[:1], now_us)
        if moved or not _completions_only(columns, now_us):
            return None
        results = [result_text(s.result) for s in chosen]
        limit = self._offload_threshold
        if limit is not None and any(moves_out(r, limit) for r in results):
            return None
        return results

    def _settle_columns(
        self, chosen: Sequence[Settlement], now_us: int
    ) -> tuple[list[list[Any]], list[Payload]]:
        """The arrays of ``HotSql.settle`` for the moves of ``chosen`` (one per job), and
        the payloads they move out of their rows."""
        now = from_us(now_us)
        columns: list[list[Any]] = [[] for _ in range(15)]
        moved: list[Payload] = []
        for s in chosen:
            move = settlement.settle(s, now)
            changes = encode_changes(move.changes)
            values, offloaded = offload(s.job_id, changes, self._offload_threshold)
            moved += offloaded
            row = [
                s.job_id,
                s.handoff_id,
                values.pop("status"),
                "result" in values,
                values.pop("result", None),
                "last_error" in values,
                values.pop("last_error", None),
                values.pop("run_at_us", None),
                int(move.counts_attempt),
                values.pop("updated_us"),
                move.releases_slot,
                int(move.counts_recovery),
                "state_holder" in values,
                values.pop("state_holder", None),
                values.pop("progress", None),
            ]
            if values:
                raise TypeError(f"the settle statement cannot set {sorted(values)}")
            for column, value in zip(columns, row, strict=True):
                column.append(value)
        return columns, moved

    async def _settle_parents(
        self,
        conn: Any,
        columns: list[list[Any]],
        accepted: set[uuid.UUID],
        moved: list[Payload],
        epoch: int | None,
    ) -> set[uuid.UUID]:
        """The moves the everyday statements left out: those of jobs others depend on
        (``has_dependents``), each settled with the walk of its dependents in one
        transaction (:func:`broker.dependencies.propagate`), and the stale ones, which
        this fences out as well. Returns the ids it settled."""
        rest = [i for i, job_id in enumerate(columns[0]) if job_id not in accepted]
        picked = [[column[i] for i in rest] for column in columns]
        sql = self._sql
        async with conn.transaction():
            rows = await conn.fetch(sql.settle_parents, *picked, epoch)
            settled = {r["id"] for r in rows}
            await pg_put(sql, conn, kept(moved, settled))
            ended = [
                (r["id"], JobStatus(r["status"]))
                for r in rows
                if dependencies.ends_parent(JobStatus(r["status"]))
            ]
            carried = (
                await dependencies.propagate(self._links(conn), ended)
                if ended
                else dependencies.Carried(0, ())
            )
        self._ended(carried)
        return settled

    def _ended(self, carried: dependencies.Carried) -> None:
        if carried.cancelled and self._end_notice is not None:
            self._end_notice(list(carried.cancelled))

    def on_ended(self, notice: Callable[[list[uuid.UUID]], None]) -> None:
        """See :class:`broker.storage.SupportsEndNotice`."""
        self._end_notice = notice

    def _links(self, conn: Any) -> PgLinks:
        async def put(conn: Any, moved: Sequence[Payload]) -> None:
            await pg_put(self._sql, conn, moved)

        return PgLinks(
            conn, self._sql.link_tables, self._now(), self._offload_threshold, put, self._schema
        )

    async def propagate(self, ended: Sequence[tuple[uuid.UUID, JobStatus]] | None) -> None:
        """Walk the dependents of ``ended`` (parents a cancel ended; ``None``: every parent
        left with an edge to count, at start-up) in a transaction of its own."""
        carried = dependencies.Carried(0, ())
        async with self._hot.acquire() as conn, conn.transaction():
            links = self._links(conn)
            parents = await links.stranded() if ended is None else ended
            if parents:
                carried = await dependencies.propagate(links, parents)
        self._ended(carried)

    # ------------------------------------------------------------------ checkpoints, progress

    async def save_checkpoints(self, saves: Sequence[CheckpointSave], now_us: int) -> list[bool]:
        """One statement for the batch; an ``UPDATE`` takes one source row per job, so
        only the newest save of each lease goes in, and the older ones share its answer
        (a newer state of theirs is what is durable)."""
        newest: dict[tuple[uuid.UUID, uuid.UUID], CheckpointSave] = {}
        for save in saves:
            key = (save.job_id, save.handoff_id)
            if key not in newest or newest[key].seq < save.seq:
                newest[key] = save
        chosen = list(newest.values())
        states: list[str | None] = []
        moved: dict[tuple[uuid.UUID, uuid.UUID], list[Payload]] = {}
        for key, c in newest.items():
            values, moved[key] = offload(
                c.job_id, {"checkpoint": result_text(c.state)}, self._offload_threshold
            )
            states.append(values["checkpoint"])
        arrays = (
            [c.job_id for c in chosen],
            [c.handoff_id for c in chosen],
            [c.seq for c in chosen],
        )
        sql = self._sql
        async with self._hot.acquire() as conn:
            if not any(moved.values()):
                rows = await conn.fetch(sql.save_checkpoints, *arrays, states, now_us)
            else:
                # The payloads of the saves the fence lets through, in their transaction:
                # by lease, since a batch may hold a stale lease's save of the same job.
                async with conn.transaction():
                    rows = await conn.fetch(sql.save_checkpoints, *arrays, states, now_us)
                    payloads = [p for r in rows for p in moved[(r["id"], r["handoff_id"])]]
                    await pg_put(sql, conn, payloads)
        taken = {(r["id"], r["handoff_id"]) for r in rows}
        return [(s.job_id, s.handoff_id) in taken for s in saves]

    async def save_progress(self, updates: Sequence[ProgressUpdate]) -> list[bool]:
        # The last update of each lease counts (one source row per job and lease).
        chosen = list({(u.job_id, u.handoff_id): u for u in updates}.values())
        async with self._hot.acquire() as conn:
            rows = await conn.fetch(
                self._sql.save_progress,
                [u.job_id for u in chosen],
                [u.handoff_id for u in chosen],
                [u.fraction for u in chosen],
                [u.message for u in chosen],
            )
        taken = {(r["id"], r["handoff_id"]) for r in rows}
        return [(u.job_id, u.handoff_id) in taken for u in updates]

    # ------------------------------------------------------------------ enqueue

    async def enqueue(
        self, specs: Sequence[JobSpec], claims: Sequence[Claim | None], epoch: int | None
    ) -> list[EnqueueResult]:
        """The main's enqueue, on a connection of its enqueue pool."""
        async with self._enqueue_pool.acquire() as conn:
            return await self.enqueue_on_driver(conn, specs, claims, epoch)

    def driver_enqueue(self) -> DriverEnqueue:
        """The enqueue on an application's own asyncpg connection."""
        return self.enqueue_on_driver

    async def enqueue_one_on_driver(
        self, conn: Any, spec: JobSpec, limit: int | None
    ) -> EnqueueResult:
        """:meth:`enqueue_on_driver` of ``spec`` alone, checked against the payload limit
        ``limit`` first (:func:`~broker.payload.check_encoded`, on its row's own JSON):
        an application's one-at-a-time enqueue on its own connection. Its row's values
        are made once, from the spec (:func:`~adapters.sql.rows.new_values`), and serve
        the size check and the statement; a job with parents or a payload to move out
        goes the rule's way (:meth:`enqueue_on_driver`)."""
        now = at_us(self._now())
        values = new_values(spec, now)
        check_encoded(spec, values[ARGS_IN_VALUES], values[KWARGS_IN_VALUES], limit)
        if self._enqueue.moves_out(values) or linked([spec]):
            [result] = await self.enqueue_on_driver(conn, [spec], [None], None)
            return result
        return await self._insert_one(conn, spec, values, now)

    async def _insert_one(
        self, conn: Any, spec: JobSpec, values: list[Any], now: datetime
    ) -> EnqueueResult:
        """Insert ``spec``'s new job (no parents, nothing to move out, not handed off) as
        ``values`` (:func:`~adapters.sql.rows.new_values` at ``now``), in one statement
        that commits on its own outside a transaction. When a key or id is taken, the
        rule takes over from its first insert (:meth:`EnqueueRule.run`'s ``tried``):
        it finds the holder, and inserts again only if the holder went meanwhile.

        Outside a transaction a job with no key goes in without ``ON CONFLICT``
        (``HotSql.insert_one_new``, the server's cheaper insert), and a taken id fails
        the statement instead of inserting nothing: the same answer, the same round
        trips. Inside the caller's transaction the failure would abort it, so there
        the insert does nothing on a conflict, as it does for a job with a key."""
        sql = self._sql
        stmt = sql.insert_one
        if not conn.is_in_transaction():
            if spec.idempotency_key is None and spec.unique_key is None:
                stmt = sql.insert_one_new
            if spec.concurrency_key is not None:
                stmt = sql.with_counters[stmt]  # see enqueue_on_driver
        try:
            if await conn.fetch(stmt, *values):
                return EnqueueResult.inserted_new(spec, now)
        except self._id_taken:
            pass  # its id is taken: the holder is found as after ON CONFLICT's nothing
        [result] = await self.enqueue_on_driver(conn, [spec], [None], None, tried=True)
        return result

    async def enqueue_on_driver(
        self,
        conn: Any,
        specs: Sequence[JobSpec],
        claims: Sequence[Claim | None],
        epoch: int | None,
        *,
        tried: bool = False,
    ) -> list[EnqueueResult]:
        """One ``INSERT ... SELECT FROM json_to_recordset(...)`` for the whole batch, on
        an asyncpg connection (a batch of new jobs that all insert: ``unnest`` of its
        columns, see :meth:`_enqueue_every`).

        A single job needs no transaction (its one statement commits on its own, so an
        enqueue is one round trip), nor does a batch of new jobs that all insert; any
        other batch takes one, so it is stored all or nothing, and so does a job with
        offloaded payloads (its row and its payloads together). Inside a transaction
        already open on ``conn``, each is a savepoint.

        Outside one, the insert also creates the counters of its jobs' concurrency keys
        (see ``HotSql.with_counters``). Inside an application's transaction it does not:
        a counter it created would stay uncommitted as long as that transaction, and a
        claim creating the same counter would wait for it, dispatch held up by a web
        request; a key without a counter is created by its first claim instead.

        A lone new job (no parents, nothing to move out, not handed off: every
        one-at-a-time enqueue) is inserted from its values (:meth:`_insert_one`), with
        no dict of its fields or of its row. ``tried``: ``specs`` (one job) was just
        inserted that way and was not stored (a key or id taken).
        """
        if len(specs) == 1 and not tried and claims[0] is None and not linked(specs):
            spec = specs[0]
            now = at_us(self._now())
            values = new_values(spec, now)
            if not self._enqueue.moves_out(values):
                return [await self._insert_one(conn, spec, values, now)]
        sql = self._sql
        counters = not conn.is_in_transaction()

        async def insert(rows: list[dict[str, Any]], moved: list[Payload]) -> set[uuid.UUID]:
            # Jobs written handed off are fenced as a claim is.
            fenced = [epoch] if any(claims) else []
            if len(rows) == 1:
                stmt = sql.insert_one_fenced if fenced else sql.insert_one
                values = INSERT_VALUES({**NULL_ROW, **rows[0]})
            else:
                stmt = sql.insert_fenced if fenced else sql.insert
                values = [ROWS_JSON.encode(rows).decode()]
            if counters and _keyed(rows):
                stmt = sql.with_counters[stmt]
            if not moved:
                return {r["id"] for r in await conn.fetch(stmt, *values, *fenced)}
            async with conn.transaction():  # a savepoint inside a batch's transaction
                stored = {r["id"] for r in await conn.fetch(stmt, *values, *fenced)}
                await pg_put(sql, conn, kept(moved, stored))
            return stored

        async def find(missing: Sequence[JobSpec]) -> list[Job | None]:
            found = await conn.fetch(
                sql.holders,
                [s.id for s in missing],
                [s.idempotency_key for s in missing if s.idempotency_key is not None],
                [s.unique_key for s in missing if s.unique_key is not None],
            )
            bodies = await pg_bodies(sql, conn, found)
            return match_holders(missing, whole_jobs(found, bodies))

        if linked(specs):
            # The links, and the walk of parents that have ended already, in the
            # transaction that stores the jobs.
            async with conn.transaction():
                link = self._links(conn).link
                return await self._enqueue.run(insert, find, specs, claims, link=link)
        if len(specs) == 1:
            return await self._enqueue.run(insert, find, specs, claims, tried=tried)
        if not any(claims) and not conn.is_in_transaction():
            every = await self._enqueue_every(conn, specs)
            if every is not None:
                return every
        async with conn.transaction():
            return await self._enqueue.run(insert, find, specs, claims, overlapped)

    async def _enqueue_every(
        self, conn: Any, specs: Sequence[JobSpec]
    ) -> list[EnqueueResult] | None:
        """A batch of new jobs in plain ``INSERT``s by column, stored all or none, when
        nothing stands in the way; ``None`` when something does (a key or id taken, in
        the store or twice in the batch, a payload to offload, any refusal), and then
        nothing of the batch was stored and it goes the careful way
        (:meth:`EnqueueRule.run`, in a transaction).

        In a bulk enqueue nothing usually does, and the careful way cost each group
        commit a ``BEGIN`` and a ``COMMIT`` round trip, each waiting its turn on the
        main's loop behind the checks of the next request: a trace of 3,500 jobs
        showed the database idle half the time. So a batch of up to
        :data:`_EVERY_AT_ONCE` jobs (every group commit of the main's, by default) is one
        statement, committed on its own. A larger one (an application's bulk enqueue on
        its own connection) is a transaction of one statement per
        :data:`~adapters.sql.enqueue.OVERLAP_CHUNK` jobs, each chunk's columns built while
        the server writes the chunk before (:func:`~adapters.sql.enqueue.overlapped`):
        built whole first, the server waited for the client's rows and then the client
        for the server's insert. A statement that fails changes nothing, and outside a
        transaction (checked) aborts nothing else; inside the batch's own, it rolls the
        batch back.

        The rows go by column (``HotSql.insert_columns``): no dict per job, for its
        fields or its row, and each result builds its job's fields only if read
        (:meth:`EnqueueResult.inserted_new`).
        """
        now = from_us(self._now())
        chunks = [specs] if len(specs) <= _EVERY_AT_ONCE else in_chunks(specs, OVERLAP_CHUNK)
        if not await self._insert_by_column(conn, chunks, now):
            return None
        return [EnqueueResult.inserted_new(spec, now) for spec in specs]

    async def enqueue_columns_on_driver(self, conn: Any, jobs: SpecColumns) -> bool:
        """Store ``jobs`` (new, independent jobs held by column: no key, no parents) on an
        asyncpg connection by column, as :meth:`_enqueue_every` stores a batch of specs,
        without a spec per job; ``False`` when that cannot be done (inside a transaction
        open on ``conn``, where a failed statement would abort it, a payload to offload,
        any refusal), and then nothing was stored and the jobs go one spec each."""
        if conn.is_in_transaction():
            return False
        # Statements of _EVERY_AT_ONCE jobs, not OVERLAP_CHUNK: with no spec per job to
        # read, a chunk's columns cost the caller little beside its round trip (4,000 jobs,
        # alternating, at a load of 23: 5.3 us of CPU and 75 us of wall time a job in
        # statements of 1,000, 7.3 and 100 in statements of 250).
        chunks = [jobs.chunk(i, i + _EVERY_AT_ONCE) for i in range(0, len(jobs), _EVERY_AT_ONCE)]
        return await self._insert_by_column(conn, chunks, from_us(self._now()))

    async def enqueue_columns(self, chunks: Iterator[SpecColumns], count: int) -> bool:
        """The main's bulk enqueue (``enqueue_each``) by column, on a connection of its
        enqueue pool: a statement per chunk, one transaction for more than
        :data:`_EVERY_AT_ONCE` jobs, each chunk taken (made and checked by the main)
        while the one before is written. ``False`` as :meth:`_insert_by_column`; a
        chunk that raises rolls back the chunks before it."""
        async with self._enqueue_pool.acquire() as conn:
            each = list(chunks) if count <= _EVERY_AT_ONCE else chunks
            return await self._insert_by_column(conn, each, from_us(self._now()))

    async def _insert_by_column(
        self,
        conn: Any,
        chunks: Sequence[Sequence[JobSpec] | SpecColumns] | Iterator[SpecColumns],
        now: datetime,
    ) -> bool:
        """Insert each of ``chunks`` (new jobs enqueued at ``now``) as one statement by
        column, in one transaction unless a list of one (an iterator's next chunk is
        taken while the one before is written); ``False`` when a statement failed or a
        payload would move out of its row, and nothing was stored."""
        sql = self._sql

        def build(
            chunk: Sequence[JobSpec] | SpecColumns,
        ) -> tuple[dict[str, list[Any]], list[Payload]]:
            columns = self._enqueue.columns_to_write(chunk, now)
            if columns is None:
                raise _Offloading
            return columns, []

        async def insert(columns: dict[str, list[Any]], _moved: list[Payload]) -> set[uuid.UUID]:
            keyed = "concurrency_key" in columns
            stmt = sql.with_counters[sql.insert_columns] if keyed else sql.insert_columns
            await conn.execute(stmt, ROWS_JSON.encode(columns).decode())
            return set()

        try:
            if isinstance(chunks, Sequence) and len(chunks) == 1:
                await insert(*build(chunks[0]))
            else:
                async with conn.transaction():
                    await overlapped(insert, map(build, chunks))
        except (self._server_refused, _Offloading):
            return False
        return True

    def note_inserts(self, count: int) -> None:
        """Keep the planner's statistics fresh after bulk inserts.

        Until autovacuum first analyzes the table (up to a minute, longer under load) the
        planner believes the queue is empty and scans and sorts every queued row on each
        dispatch instead of reading the dispatch index in order: milliseconds per pass at a
        few thousand jobs. A background ``ANALYZE`` after large batches, at most every 30 s,
        keeps dispatch on the index.
        """
        self._unanalyzed_inserts += count
        now = time.monotonic()
        if (
            self._unanalyzed_inserts < _ANALYZE_AFTER_INSERTS
            or now - self._last_analyze < _ANALYZE_INTERVAL
            or (self._analyzing is not None and not self._analyzing.done())
        ):
            return
        self._unanalyzed_inserts = 0
        self._last_analyze = now
        self._analyzing = asyncio.create_task(self._analyze(), name="broker-store-analyze")

    async def _analyze(self) -> None:
        def analyze(conn: sa.Connection) -> None:
            conn.exec_driver_sql(f"ANALYZE {_qualified(conn, self._schema, jobs.name)}")

        try:
            async with self.read_engine.connect() as conn:
                await conn.run_sync(analyze)
        except self.errors.caught as exc:
            logger.warning("could not refresh planner statistics: %r", exc)

    # ------------------------------------------------------------------ leadership

    async def warm_up(self) -> None:
        """Open the general pool's connections, all at once, and leave them in the pool.

        SQLAlchemy opens them on demand, and a main that has stood by holds one (its
        start-up's): once elected, the leader's set-up (the notification connection,
        which it keeps, the first retention pass, the workers' declarations) took that
        one in the same moment as the first client request, which then waited for a
        connection of its own, a new server process and asyncpg's type introspection
        (0.1 to 0.3 s with two cores shared by several tests; up to 2 s on a loaded
        machine). Opened while the main loads its orphans, before it welcomes anyone,
        they cost the takeover nothing it waits for."""
        opened = await asyncio.gather(
            *(self.engine.connect().start() for _ in range(self._pool_size)),
            return_exceptions=True,
        )
        for conn in opened:
            if not isinstance(conn, BaseException):
                await conn.close()  # back to the pool, open
        for conn in opened:
            if isinstance(conn, BaseException):
                raise conn

    async def elect(self, holder: str, address: str, ttl: float) -> LeaderRecord | None:
        async with self._leader_pool.acquire() as conn:
            row = await conn.fetchrow(self._sql.elect, holder, address, ttl)
        if row is None:
            return None
        return LeaderRecord(row["epoch"], row["holder"], row["address"], row["live"])

    async def renew(self, holder: str, epoch: int, ttl: float) -> bool:
        async with self._leader_pool.acquire() as conn:
            return await conn.fetchval(self._sql.renew, holder, epoch, ttl) is not None

    async def resign(self, holder: str, epoch: int) -> None:
        async with self._leader_pool.acquire() as conn:
            await conn.execute(self._sql.resign, holder, epoch)

    # ------------------------------------------------------------------ notifications

    @asynccontextmanager
    async def listen(self, on_wake: Callable[[], None], where: object) -> AsyncIterator[None]:
        """``on_wake()`` whenever any process inserts a job, while open; a lost connection
        calls it once more and logs a warning naming ``where`` (the adapter)."""

        def wake(*_args: object) -> None:
            try:
                on_wake()
            except Exception:
                logger.exception("listen(): on_wake callback failed")

        def lost(*_args: object) -> None:
            logger.warning("listen(): the notification connection to %s was lost", where)
            wake()

        caught = self.errors.caught
        with self.errors.translate("listen"):
            conn = await self.engine.connect()
        try:
            with self.errors.translate("listen"):
                schema = self._schema
                if schema is None:
                    schema = str((await conn.execute(sa.text("SELECT current_schema()"))).scalar())
                    await conn.commit()  # LISTEN must not sit in an open transaction
                channel = notify_channel(schema)
                raw = await conn.get_raw_connection()
                driver_conn: Any = raw.driver_connection
                await driver_conn.add_listener(channel, wake)
                driver_conn.add_termination_listener(lost)
            try:
                yield
            finally:
                driver_conn.remove_termination_listener(lost)
                with contextlib.suppress(*caught):
                    await driver_conn.remove_listener(channel, wake)
        finally:
            with contextlib.suppress(*caught):
                await conn.close()
