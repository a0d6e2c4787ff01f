"""SQLite: how the SQL store's hot path is carried out (:class:`SqliteDialect`).

Each hot call is one function run on a ``sqlite3`` connection of the store's own, in one
hop to its thread (:mod:`adapters.sql.sqlite_thread`), writes group-committed: the
statement builders and the transaction functions are here. A SQLite file has no
election, no notifications and no driver connection of an application's; its one main
is kept alone by the file lock (:class:`adapters.sql.connect.MainLock`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import sqlite3
import uuid
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from datetime import datetime
from typing import Any, NoReturn

import msgspec
import sqlalchemy as sa
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from adapters.sql.connect import WRITE_OPTION, existing_file_url, redact, wire_sqlite
from adapters.sql.enqueue import EnqueueRule, complete_now, match_holders
from adapters.sql.errors import StoreErrors
from adapters.sql.links import LiteLinks, linked
from adapters.sql.rows import (
    COLUMN_OF,
    ID_AT,
    PAYLOADS_AT,
    ROW_COLUMNS,
    Bodies,
    Payload,
    claimed_jobs,
    encode_changes,
    from_us,
    grant,
    in_chunks,
    job_from_values,
    kept,
    offload,
)
from adapters.sql.schema import DISPATCH_INDEX, DUE_INDEX, INSERT_COLUMNS, OFFLOADED, selection
from broker import dependencies, settlement
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


def _lite_value(value: Any) -> Any:
    """A value as SQLAlchemy's ``Uuid`` stores it on SQLite (32 hex digits), else as is."""
    return value.hex if isinstance(value, uuid.UUID) else value


_LITE_COLUMNS = ", ".join(ROW_COLUMNS)
"""What SQLite's hot statements select or return of a job: every column, in :class:`Job`'s
field order, so a row is decoded by position (:func:`_lite_job`)."""
_LITE_IDS = [ROW_COLUMNS.index(column) for column in ("id", "handoff_id")]


def _lite_job(row: Sequence[Any], bodies: Bodies | None = None) -> Job:
    """A :class:`Job` from a row of :data:`_LITE_COLUMNS` (its ids are hex text)."""
    values = list(row)
    for i in _LITE_IDS:
        if values[i] is not None:
            values[i] = uuid.UUID(hex=values[i])
    return job_from_values(values, bodies)


def _lite_bodies(conn: sqlite3.Connection, rows: Sequence[Sequence[Any]]) -> Bodies:
    """The offloaded payloads of ``rows`` (of :data:`_LITE_COLUMNS`), in one query."""
    wanted = [r[ID_AT] for r in rows if OFFLOADED in PAYLOADS_AT(r)]
    if not wanted:
        return {}
    found = conn.execute(
        "SELECT job_id, kind, body, digest FROM broker_payloads "
        "WHERE job_id IN (SELECT value FROM json_each(?))",
        (json.dumps(wanted),),
    )
    return {(uuid.UUID(hex=job_id), kind): (body, digest) for job_id, kind, body, digest in found}


def _lite_put(conn: sqlite3.Connection, moved: Sequence[Payload]) -> None:
    """Write payload rows on SQLite's hot connection, replacing any of the same kind."""
    if not moved:
        return
    conn.executemany(
        "INSERT INTO broker_payloads (job_id, kind, body, digest) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (job_id, kind) DO UPDATE SET body = excluded.body, digest = excluded.digest",
        [(job_id.hex, kind, body, digest) for job_id, kind, body, digest in moved],
    )


def _lite_update(move: settlement.Move, where: str) -> tuple[str, list[str]]:
    """An ``UPDATE`` of ``broker_jobs`` carrying out ``move`` (its fields bound in the order
    returned, then ``where``'s); the same text for every move of one shape, so the
    ``sqlite3`` statement cache prepares it once."""
    columns = sorted(COLUMN_OF[name] for name in move.changes)
    return f"UPDATE broker_jobs SET {_lite_sets(move, columns, '?')} WHERE {where}", columns


def _lite_sets(move: settlement.Move, columns: list[str], value: str) -> str:
    """The ``SET`` list carrying out ``move``: each of ``columns`` (its changes) to
    ``value`` (formatted with the column's name), and the counters it adds to."""
    sets = [f"{column} = {value.format(column)}" for column in columns]
    if move.counts_attempt:
        sets.append("attempts = attempts + 1")
    if move.counts_recovery:
        sets.append("recoveries = recoveries + 1")
    return ", ".join(sets)


def _lite_update_batch(
    move: settlement.Move, keys: Sequence[str], where: str, returning: str
) -> tuple[str, list[str]]:
    """An ``UPDATE`` carrying out moves of ``move``'s shape on a batch of rows, in one
    statement: the JSON array bound as ``?1`` holds an array per row, its ``keys`` first
    (``where`` reads them as ``w.<key>``), then its move's values of the columns returned;
    the statement returns ``returning`` of each row it changed.
    One statement for the batch, instead of one per row (and a claim's ``SELECT`` of
    the rows first), is the larger part of why SQLite's thread went from 0.16 to 0.07 ms
    of CPU per job in a pooled drain; the text is the same for every batch of one
    shape, so it is prepared once."""
    columns = sorted(COLUMN_OF[name] for name in move.changes)
    names = [*keys, *(f"new_{column}" for column in columns)]
    source = ", ".join(f"json_extract(value, '$[{i}]') AS {n}" for i, n in enumerate(names))
    return (
        f"UPDATE broker_jobs SET {_lite_sets(move, columns, 'w.new_{}')} "
        f"FROM (SELECT {source} FROM json_each(?1)) AS w WHERE {where} "
        f"RETURNING {returning}",
        columns,
    )


_LITE_RETURNING = ", ".join(f"broker_jobs.{column}" for column in ROW_COLUMNS)
_LITE_ROWS = msgspec.json.Encoder()
"""The rows of a batched statement (:func:`_lite_update_batch`) as the JSON text bound."""


def _hand_off_rows(claims: Sequence[Claim], now: datetime, where: str) -> tuple[str, str]:
    """The hand-off of ``claims`` as one batched ``UPDATE`` of the due queued rows that
    also meet ``where`` (``now``'s microseconds bound as ``?2``), returning them as now
    stored: the statement for their shape and its JSON rows."""
    rows = []
    update = ""
    for claim in claims:
        move = settlement.hand_off(claim, now)
        if not update:
            update, columns = _lite_update_batch(
                move,
                ["w_id"],
                f"broker_jobs.id = w.w_id AND status = 'queued' AND run_at_us <= ?2{where}",
                _LITE_RETURNING,
            )
        values = encode_changes(move.changes)
        rows.append([claim.job_id.hex, *(_lite_value(values[c]) for c in columns)])
    return update, _LITE_ROWS.encode(rows).decode()


_LITE_DUE = "status = 'queued' AND execution_mode IN (SELECT value FROM json_each(?1))"
_LITE_IN_QUEUES = " AND queue IN (SELECT value FROM json_each(?2))"
_LITE_NOT_IN_QUEUES = " AND queue NOT IN (SELECT value FROM json_each(?2))"


def _lite_next_run(queue_test: str) -> str:
    """SQLite's next run time: per mode in ``?1``, the first entry of the due index
    (``adapters.sql.schema._v19_due_index``) that passes the queue test, one probe each,
    rather than a walk of every queued row."""
    return f"""
        SELECT min((
            SELECT run_at_us FROM broker_jobs INDEXED BY {DUE_INDEX}
            WHERE status = 'queued' AND execution_mode = m.value{queue_test}
            ORDER BY run_at_us LIMIT 1
        )) FROM json_each(?1) AS m
    """


_LITE_LEVEL = f"""
    SELECT priority FROM broker_jobs INDEXED BY {DISPATCH_INDEX}
    WHERE status = 'queued' AND priority < ?1 ORDER BY priority DESC LIMIT 1
"""
"""The next priority level below ``?1`` among queued jobs: one probe of the dispatch index."""
_LITE_NO_LEVEL = 2**31
"""Above every priority (:class:`broker.jobs.JobSpec` keeps them to 32 bits)."""


def _lite_eligible(queue_test: str) -> str:
    """SQLite's selection at one priority level (``?8``): the best due jobs of the modes
    in ``?1`` (and queues in ``?2``) whose concurrency key has room, of the tasks in ``?6``
    (``NULL``: any), but those in the skipped ids (``?5``) and those of the ``[task, rate
    key]`` pairs in ``?7`` (``NULL``: none; a job without a key is its task's key ``''``),
    at most ``?4`` (``?3`` is the time now), their payloads left out (see
    ``_sql_schema.selection``).
    The dispatch index gives them in order, as a range that ends at the first job not
    yet due (see :func:`_lite_select_eligible`); ``rowid`` (the index's own last column)
    breaks ties in enqueue order."""
    return f"""
        SELECT {selection(ROW_COLUMNS, "j.")} FROM broker_jobs AS j INDEXED BY {DISPATCH_INDEX}
        WHERE {_LITE_DUE}{queue_test} AND priority = ?8 AND run_at_us <= ?3
            AND NOT EXISTS (
                SELECT 1 FROM broker_concurrency AS c
                WHERE c.key = j.concurrency_key AND c.active >= j.concurrency_limit
            )
            AND id NOT IN (SELECT value FROM json_each(?5))
            AND (?6 IS NULL OR task IN (SELECT value FROM json_each(?6)))
            AND (?7 IS NULL OR NOT EXISTS (
                SELECT 1 FROM json_each(?7) AS b
                WHERE json_extract(b.value, '$[0]') = j.task
                    AND json_extract(b.value, '$[1]') = coalesce(j.rate_key, '')
            ))
        ORDER BY run_at_us, created_us, seq, j.rowid
        LIMIT ?4
    """


def _lite_select_eligible(
    conn: sqlite3.Connection, statement: str, params: tuple[Any, ...], limit: int
) -> list[Any]:
    """The eligible read, level by level from the highest priority down, until ``limit``
    rows are read or the levels run out: each level's due jobs are a range of the
    dispatch index (priority, then time), so jobs scheduled ahead are never walked. As
    one statement with the due bound a mere filter, a read that found fewer due jobs
    than its limit walked every queued job behind them, future ones included (issue
    35). Levels in descending order, each read in order, come out in dispatch order."""
    rows: list[Any] = []
    level = _LITE_NO_LEVEL
    while len(rows) < limit:
        found = conn.execute(_LITE_LEVEL, (level,)).fetchone()
        if found is None:
            break
        level = found[0]
        rows += conn.execute(statement, (*params[:3], limit - len(rows), *params[4:], level))
    return rows


_LITE_ELIGIBLE = _lite_eligible("")
_LITE_ELIGIBLE_IN_QUEUES = _lite_eligible(_LITE_IN_QUEUES)
_LITE_ELIGIBLE_NOT_IN_QUEUES = _lite_eligible(_LITE_NOT_IN_QUEUES)


def _lite_wanted(
    modes: Collection[ExecutionMode], queues: Collection[str] | None, exclude: Sequence[str]
) -> tuple[tuple[Any, ...], int]:
    """The modes (``?1``) and queues (``?2``, if any) of SQLite's dispatch reads, and which
    queue test they take: 0 none, 1 the queues in ``?2``, 2 all but those in ``?2``
    (queues left out: see ``adapters.sql.adapter._queue_filter``)."""
    wanted = json.dumps(sorted({ExecutionMode(m).value for m in modes}))
    if queues is not None:
        return (wanted, json.dumps(sorted(set(queues)))), 1
    if exclude:
        return (wanted, json.dumps(list(exclude))), 2
    return (wanted, None), 0


_LITE_ELIGIBLE_BY_TEST = (_LITE_ELIGIBLE, _LITE_ELIGIBLE_IN_QUEUES, _LITE_ELIGIBLE_NOT_IN_QUEUES)
_LITE_NEXT_RUN_BY_TEST = tuple(
    _lite_next_run(t) for t in ("", _LITE_IN_QUEUES, _LITE_NOT_IN_QUEUES)
)


_LITE_INSERT_ROWS = 25
"""Most rows in one of SQLite's ``INSERT`` statements (``25 x 32`` parameters stay under
the 999 of SQLite before 3.32). A statement per row cost an ``enqueue_many`` of 1,000
jobs 0.057 ms of CPU per job, 25 rows a statement 0.047 (100 measured no better)."""


@functools.lru_cache(maxsize=_LITE_INSERT_ROWS)
def _lite_insert(rows: int) -> str:
    """SQLite's insert of ``rows`` jobs (each binding :data:`INSERT_COLUMNS` in order) that
    stores those whose id and keys are free, in the order given, and returns their ids."""
    marks = f"({', '.join('?' * len(INSERT_COLUMNS))})"
    return (
        f"INSERT INTO broker_jobs ({', '.join(INSERT_COLUMNS)}) "
        f"VALUES {', '.join([marks] * rows)} ON CONFLICT DO NOTHING RETURNING id"
    )


def _claim_lite(conn: sqlite3.Connection, claims: list[Claim], now_us: int) -> list[Job]:
    """SQLite's claim, one transaction: the due queued rows among the claims that have no
    concurrency key, handed off in one statement; then, if any claim is left over, the
    keyed ones among those, the counters of their keys, and the hand-off of the ones
    granted. (Granting the unkeyed jobs first changes nothing: they take no slot.)"""
    now = from_us(now_us)
    update, batch = _hand_off_rows(claims, now, " AND concurrency_key IS NULL")
    rows = conn.execute(update, (batch, now_us)).fetchall()
    taken = {r[ID_AT] for r in rows}
    rest = [c for c in claims if c.job_id.hex not in taken]
    if rest:
        rows += _claim_keyed_lite(conn, rest, now_us, now)
    won, refused = claimed_jobs(
        claims, rows, functools.partial(_lite_job, bodies=_lite_bodies(conn, rows))
    )
    if refused:  # in the claim's transaction: the job is never seen handed off
        _settle_lite(conn, refused, now_us, None)
    order = {claim.job_id: i for i, claim in enumerate(claims)}
    return sorted(won, key=lambda job: order[job.id])


def _claim_keyed_lite(
    conn: sqlite3.Connection, claims: list[Claim], now_us: int, now: datetime
) -> list[Any]:
    """The keyed due queued rows among ``claims``, granted while their keys have room
    (:func:`grant`) and handed off, their slots taken; returns the rows as now stored."""
    found = conn.execute(
        "SELECT id, concurrency_key, concurrency_limit FROM broker_jobs "
        "WHERE id IN (SELECT value FROM json_each(?)) AND status = 'queued' "
        "AND run_at_us <= ? AND concurrency_key IS NOT NULL",
        (json.dumps([c.job_id.hex for c in claims]), now_us),
    ).fetchall()
    if not found:
        return []
    keys = sorted({key for _, key, _ in found})
    conn.executemany(
        "INSERT INTO broker_concurrency (key, active) VALUES (?, 0) ON CONFLICT (key) DO NOTHING",
        [(k,) for k in keys],
    )
    counters = conn.execute(
        "SELECT key, active FROM broker_concurrency WHERE key IN (SELECT value FROM json_each(?))",
        (json.dumps(keys),),
    )
    granted, taken = grant(
        [(uuid.UUID(hex=job_id), key, limit) for job_id, key, limit in found],
        [c.job_id for c in claims],
        dict(counters.fetchall()),
    )
    if not granted:
        return []
    chosen = set(granted)
    update, batch = _hand_off_rows([c for c in claims if c.job_id in chosen], now, "")
    rows = conn.execute(update, (batch, now_us)).fetchall()
    conn.executemany(
        "UPDATE broker_concurrency SET active = active + ? WHERE key = ?",
        [(n, key) for key, n in sorted(taken.items())],
    )
    return rows


def _settle_lite(
    conn: sqlite3.Connection,
    settlements: Sequence[Settlement],
    now_us: int,
    offload_threshold: int | None,
) -> tuple[list[bool], dependencies.Carried]:
    """SQLite's settle, one transaction: a fenced ``UPDATE`` per shape of move, for all the
    batch's moves of that shape (only the first move per job in a batch can be
    accepted), then the slots given back in key order. A result over
    ``offload_threshold`` is written to ``broker_payloads`` only when its move is
    accepted, in the same transaction. Also returns what it did to waiting jobs: those it
    made due (children whose last parent it completed) and those it cancelled."""
    now = from_us(now_us)
    first: dict[uuid.UUID, int] = {}
    for i, s in enumerate(settlements):
        first.setdefault(s.job_id, i)
    shapes: dict[tuple[Any, ...], tuple[str, list[str], bool, list[list[Any]]]] = {}
    moved: list[Payload] = []
    status_after: dict[str, JobStatus] = {}
    for i in first.values():
        s = settlements[i]
        move = settlement.settle(s, now)
        status_after[s.job_id.hex] = move.changes["status"]
        shape = (*move.shape, move.releases_slot)
        batch = shapes.get(shape)
        if batch is None:
            update, columns = _lite_update_batch(
                move,
                ["w_id", "w_lease"],
                "broker_jobs.id = w.w_id AND handoff_id = w.w_lease AND status = 'handed_off'",
                "broker_jobs.id, broker_jobs.concurrency_key, broker_jobs.has_dependents",
            )
            batch = shapes[shape] = (update, columns, move.releases_slot, [])
        values, offloaded = offload(s.job_id, encode_changes(move.changes), offload_threshold)
        moved += offloaded
        batch[3].append([s.job_id.hex, s.handoff_id.hex, *(values[c] for c in batch[1])])
    accepted: set[str] = set()
    released: Counter[str] = Counter()
    ended: list[tuple[uuid.UUID, JobStatus]] = []
    for update, _, releases, rows in shapes.values():
        for job_id, key, has_dependents in conn.execute(
            update, (_LITE_ROWS.encode(rows).decode(),)
        ):
            accepted.add(job_id)
            if releases and key is not None:
                released[key] += 1
            if has_dependents and dependencies.ends_parent(status_after[job_id]):
                ended.append((uuid.UUID(hex=job_id), status_after[job_id]))
    _lite_put(conn, [p for p in moved if p[0].hex in accepted])
    carried = dependencies.Carried(0, ())
    if ended:  # the dependents of the parents this settle ended, in its transaction
        links = LiteLinks(conn, now_us, offload_threshold, _lite_put)
        carried = complete_now(dependencies.propagate(links, ended))
    conn.executemany(
        "UPDATE broker_concurrency SET active = MAX(active - ?, 0) WHERE key = ?",
        [(n, key) for key, n in sorted(released.items())],
    )
    applied = [first[s.job_id] == i and s.job_id.hex in accepted for i, s in enumerate(settlements)]
    return applied, carried


def _save_checkpoints_lite(
    conn: sqlite3.Connection,
    saves: Sequence[CheckpointSave],
    now_us: int,
    offload_threshold: int | None,
) -> list[bool]:
    """SQLite's checkpoints, one transaction: a fenced ``UPDATE`` each, in order (so of
    two saves of one lease in a batch, the later and newer one ends up stored). A saved
    checkpoint over ``offload_threshold`` replaces the job's checkpoint payload; one kept
    in its row deletes it, so the checkpoint it replaces is never left behind."""
    now = from_us(now_us)
    saved = []
    for save in saves:
        move = settlement.save_checkpoint(save, now)
        update, columns = _lite_update(
            move, "id = ? AND handoff_id = ? AND status = 'handed_off' AND checkpoint_seq < ?"
        )
        values, moved = offload(save.job_id, encode_changes(move.changes), offload_threshold)
        fence = [save.job_id.hex, save.handoff_id.hex, save.seq]
        taken = conn.execute(update, [values[c] for c in columns] + fence).rowcount == 1
        if taken and moved:
            _lite_put(conn, moved)
        elif taken:
            conn.execute(
                "DELETE FROM broker_payloads WHERE job_id = ? AND kind = 'checkpoint'",
                (save.job_id.hex,),
            )
        saved.append(taken)
    return saved


def _save_progress_lite(conn: sqlite3.Connection, updates: Sequence[ProgressUpdate]) -> list[bool]:
    return [
        _update_lite(
            conn,
            settlement.record_progress(update),
            "id = ? AND handoff_id = ? AND status = 'handed_off'",
            [update.job_id.hex, update.handoff_id.hex],
        )
        for update in updates
    ]


def _update_lite(
    conn: sqlite3.Connection, move: settlement.Move, where: str, fence: list[Any]
) -> bool:
    """Carry out ``move`` under the fence ``where`` (bound to ``fence``); says whether the
    row matched."""
    update, columns = _lite_update(move, where)
    values = encode_changes(move.changes)
    return conn.execute(update, [values[c] for c in columns] + fence).rowcount == 1


class SqliteDialect:
    """How the store's calls run on a SQLite file: each hot call one function on the hot
    connection (writes, in their turn among this store's writers, see
    :meth:`SqliteHot.write`) or on the read connection (dispatch's reads, beside any
    write). Writes through SQLAlchemy begin ``IMMEDIATE`` and queue on the same lock."""

    capabilities = Capabilities(
        skip_locked=False,
        listen_notify=False,
        shared_between_processes=True,
        leader_election=False,
    )
    insert = staticmethod(sqlite_dialect.insert)
    enqueue_order: sa.ColumnElement[Any] = sa.literal_column("broker_jobs.rowid")

    def __init__(
        self,
        resolved: URL,
        *,
        pool_size: int,
        echo: bool,
        create: bool,
        read_only: bool,
        now: Callable[[], int],
        offload_threshold: int | None,
        enqueue: EnqueueRule,
    ) -> None:
        self.errors = StoreErrors.for_sqlite(redact(resolved))
        self._now = now
        self._offload_threshold = offload_threshold
        self._enqueue = enqueue
        self._due_notice: Callable[[], None] | None = None
        self._end_notice: Callable[[list[uuid.UUID]], None] | None = None
        self.required_file: str | None = None
        """The SQLite file that must exist already (``create=False``), if it is a path."""
        if not create:
            if resolved.database and not resolved.query.get("uri"):
                self.required_file = resolved.database
            resolved = existing_file_url(resolved, read_only=read_only)
        self.engine: AsyncEngine = create_async_engine(
            resolved, echo=echo, pool_size=pool_size, execution_options={}, connect_args={}
        )
        self.write_lock: AbstractAsyncContextManager[Any] = asyncio.Lock()
        self._hot, self._reads = wire_sqlite(
            self.engine, resolved, create=create, read_only=read_only, write_lock=self.write_lock
        )
        self.write_engine = self.engine.execution_options(**{WRITE_OPTION: True})
        self.read_engine = self.engine

    # ------------------------------------------------------------------ lifecycle

    def before_migrate(self, conn: sa.Connection) -> None:
        """Nothing: the setup's write transaction holds the file's one write lock."""

    def lock_rows(self, select: sa.Select[Any]) -> sa.Select[Any]:
        """``select`` as is: a write transaction holds the whole file already."""
        return select

    async def close(self) -> None:
        await self._hot.close()
        await self._reads.close()

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
        params, test = _lite_wanted(modes, queues, exclude)
        params += (self._now(), limit, json.dumps([job_id.hex for job_id in skip]))
        params += (None if tasks is None else json.dumps(sorted(set(tasks))),)
        params += (json.dumps([list(pair) for pair in exclude_keys]) if exclude_keys else None,)
        statement = _LITE_ELIGIBLE_BY_TEST[test]
        rows = await self._reads.run(
            lambda conn: _lite_select_eligible(conn, statement, params, limit)
        )
        return [_lite_job(r) for r in rows]

    async def next_run_at(
        self,
        modes: Collection[ExecutionMode],
        queues: Collection[str] | None,
        exclude: Sequence[str],
    ) -> datetime | None:
        params, test = _lite_wanted(modes, queues, exclude)
        statement = _LITE_NEXT_RUN_BY_TEST[test]
        if test == 0:
            params = params[:1]  # the statement reads no ?2
        value = await self._reads.run(lambda conn: conn.execute(statement, params).fetchall()[0][0])
        return None if value is None else from_us(value)

    async def claim(self, claims: list[Claim], epoch: int | None) -> list[Job]:
        now_us = self._now()
        return await self._hot.write(lambda conn: _claim_lite(conn, claims, now_us))

    # ------------------------------------------------------------------ fenced reports

    async def settle(
        self, settlements: Sequence[Settlement], now_us: int, epoch: int | None
    ) -> list[bool]:
        threshold = self._offload_threshold
        applied, carried = await self._hot.write(
            lambda conn: _settle_lite(conn, settlements, now_us, threshold)
        )
        if carried.released and self._due_notice is not None:
            self._due_notice()
        self._ended(carried)
        return applied

    def _ended(self, carried: dependencies.Carried) -> None:
        if carried.cancelled and self._end_notice is not None:
            self._end_notice(list(carried.cancelled))

    def on_ended(self, notice: Callable[[list[uuid.UUID]], None]) -> None:
        """See :class:`broker.storage.SupportsEndNotice`."""
        self._end_notice = notice

    def on_due(self, notice: Callable[[], None]) -> None:
        """See :class:`broker.storage.SupportsDueNotice`: SQLite has no notifications, and
        one main writes the store, so its settles are what make children due (a cancel's
        walk that lets a child run anyway is found at the next poll)."""
        self._due_notice = notice

    async def save_checkpoints(self, saves: Sequence[CheckpointSave], now_us: int) -> list[bool]:
        threshold = self._offload_threshold
        return await self._hot.write(
            lambda conn: _save_checkpoints_lite(conn, saves, now_us, threshold)
        )

    async def save_progress(self, updates: Sequence[ProgressUpdate]) -> list[bool]:
        return await self._hot.write(lambda conn: _save_progress_lite(conn, updates))

    # ------------------------------------------------------------------ enqueue

    async def enqueue(
        self, specs: Sequence[JobSpec], claims: Sequence[Claim | None], epoch: int | None
    ) -> list[EnqueueResult]:
        return await self._hot.write(lambda conn: self._enqueue_lite(conn, specs, claims))

    def _enqueue_lite(
        self, conn: sqlite3.Connection, specs: Sequence[JobSpec], claims: Sequence[Claim | None]
    ) -> list[EnqueueResult]:
        """The enqueue rule as one transaction on the hot connection, in one hop.

        The rule is a coroutine (:meth:`EnqueueRule.run`); over ``sqlite3`` none of its
        awaits suspends, so it runs to the end on the hot thread (``complete_now``).
        """

        async def insert(rows: list[dict[str, Any]], moved: list[Payload]) -> set[uuid.UUID]:
            stored: set[uuid.UUID] = set()
            for chunk in in_chunks(rows, _LITE_INSERT_ROWS):
                values = [_lite_value(row.get(name)) for row in chunk for name in INSERT_COLUMNS]
                found = conn.execute(_lite_insert(len(chunk)), values).fetchall()
                stored.update(uuid.UUID(hex=job_id) for (job_id,) in found)
            _lite_put(conn, kept(moved, stored))
            return stored

        async def find(missing: Sequence[JobSpec]) -> list[Job | None]:
            found = conn.execute(
                f"SELECT {_LITE_COLUMNS} FROM broker_jobs "
                "WHERE id IN (SELECT value FROM json_each(?)) "
                "OR idempotency_key IN (SELECT value FROM json_each(?)) "
                "OR (unique_key IN (SELECT value FROM json_each(?)) "
                "AND status IN ('handed_off', 'queued'))",
                (
                    json.dumps([s.id.hex for s in missing]),
                    json.dumps([s.idempotency_key for s in missing if s.idempotency_key]),
                    json.dumps([s.unique_key for s in missing if s.unique_key is not None]),
                ),
            ).fetchall()
            bodies = _lite_bodies(conn, found)
            return match_holders(missing, [_lite_job(r, bodies) for r in found])

        link = None
        if linked(specs):
            link = LiteLinks(conn, self._now(), self._offload_threshold, _lite_put).link
        return complete_now(self._enqueue.run(insert, find, specs, claims, link=link))

    async def propagate(self, ended: Sequence[tuple[uuid.UUID, JobStatus]] | None) -> None:
        """Walk the dependents of ``ended`` (parents a cancel ended; ``None``: every parent
        left with an edge to count, at start-up) in a transaction of its own."""
        now_us, threshold = self._now(), self._offload_threshold

        def walk(conn: sqlite3.Connection) -> dependencies.Carried:
            links = LiteLinks(conn, now_us, threshold, _lite_put)
            parents = complete_now(links.stranded()) if ended is None else ended
            if not parents:
                return dependencies.Carried(0, ())
            return complete_now(dependencies.propagate(links, parents))

        self._ended(await self._hot.write(walk))

    def driver_enqueue(self) -> NoReturn:
        """None: an application's asyncpg connection reaches a PostgreSQL store only."""
        raise ConfigurationError("an asyncpg connection reaches a PostgreSQL store only")

    async def enqueue_one_on_driver(self, conn: Any, spec: JobSpec, limit: int | None) -> NoReturn:
        """None: an application's asyncpg connection reaches a PostgreSQL store only."""
        self.driver_enqueue()

    async def enqueue_columns_on_driver(self, conn: Any, jobs: SpecColumns) -> NoReturn:
        """None: an application's asyncpg connection reaches a PostgreSQL store only."""
        self.driver_enqueue()

    async def enqueue_columns(self, chunks: Iterator[SpecColumns], count: int) -> bool:
        """``False``: SQLite writes a bulk enqueue one spec each (its rows go in one
        ``executemany`` on the hot thread, where the columns would save little)."""
        return False

    def note_inserts(self, count: int) -> None:
        """Nothing: SQLite's planner needs no fresh statistics to use the dispatch index."""

    # ------------------------------------------------------------------ leadership, notifications

    async def warm_up(self) -> None:
        """Nothing to open: one main holds the file, with its connections from the start."""

    async def elect(self, holder: str, address: str, ttl: float) -> LeaderRecord | None:
        _no_election()

    async def renew(self, holder: str, epoch: int, ttl: float) -> bool:
        _no_election()

    async def resign(self, holder: str, epoch: int) -> None:
        _no_election()

    def listen(
        self, on_wake: Callable[[], None], where: object
    ) -> AbstractAsyncContextManager[None]:
        raise ConfigurationError(
            "listen() needs PostgreSQL LISTEN/NOTIFY; a SQLite store has no "
            "notifications (check capabilities.listen_notify and poll instead)"
        )


def _no_election() -> NoReturn:
    raise ConfigurationError("leader election needs PostgreSQL; a SQLite file holds one main only")
