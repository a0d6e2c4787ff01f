"""SQL-specific behaviour of :class:`adapters.sql.SQLAlchemyAdapter` on SQLite and PostgreSQL.

The behavioural contract is covered by the conformance suite; these tests target what
only a SQL store can get wrong: races between separate engines (as separate processes
would have), the stored representation, setup and migrations, driver errors, LISTEN.
Every test runs on a SQLite file and on PostgreSQL (a fresh schema per test).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
import threading
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from adapters.sql import SQLAlchemyAdapter
from adapters.sql.rows import (
    NULL_ROW,
    ROW_COLUMNS,
    job_from_record,
    job_from_row,
    loads,
    new_row,
    selected_job,
)
from adapters.sql.schema import CREATED_INDEX, HOLLOW, QUIET_INSERTS_SETTING, notify_channel
from broker.exceptions import (
    ConfigurationError,
    DeposedError,
    MissingDriverError,
    SchemaVersionError,
    StorageError,
    StorageRejectedError,
)
from broker.jobs import Claim, ExecutionMode, Job, JobSpec, JobStatus, new_job_fields
from broker.storage import SCHEMA_VERSION, JobFilter, StorageAdapter, SupportsNotify
from broker.testing import FakeClock

REPO = Path(__file__).resolve().parents[2]
POSTGRES_URL = os.environ.get(
    "BROKER_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
)
START = datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)
ALL_MODES = frozenset(ExecutionMode)
WORKER = "worker-a"


# --------------------------------------------------------------------------- fixtures


def _asyncpg_dsn() -> str:
    return POSTGRES_URL.replace("postgresql+asyncpg://", "postgresql://", 1)


_probe: list[str | None] = []


def _postgres_unreachable() -> str | None:
    """Why PostgreSQL cannot be used, or None; probed once, on a thread of its own."""
    if not _probe:
        reason: list[str | None] = [None]

        async def probe() -> None:
            import asyncpg

            conn = await asyncio.wait_for(asyncpg.connect(_asyncpg_dsn()), timeout=5)
            await conn.close()

        def run() -> None:
            try:
                asyncio.run(probe())
            except Exception as exc:
                reason[0] = f"PostgreSQL at {POSTGRES_URL} is unreachable: {exc!r}"

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        _probe.append(reason[0])
    return _probe[0]


async def _drop_schema(schema: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(_asyncpg_dsn())
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


class Backend:
    """One empty store; ``open`` gives a new adapter (its own engine) on it each time."""

    def __init__(
        self, kind: str, url: str, schema: str | None, clock: FakeClock, *, owned: bool = True
    ) -> None:
        self.kind = kind
        self.url = url
        self.schema = schema
        self.owned = owned
        """Whether the schema is this backend's, to drop (not ``pg_schema``'s)."""
        self.clock = clock
        self._opened: list[SQLAlchemyAdapter] = []

    @property
    def is_pg(self) -> bool:
        return self.kind == "postgres"

    def adapter(self, **kw: Any) -> SQLAlchemyAdapter:
        kw.setdefault("clock", self.clock)
        store = SQLAlchemyAdapter(self.url, schema=self.schema, **kw)
        self._opened.append(store)
        return store

    async def open(self, **kw: Any) -> SQLAlchemyAdapter:
        store = self.adapter(**kw)
        await store.setup()
        return store

    async def close(self) -> None:
        for store in self._opened:
            await store.close()
        if self.schema is not None and self.owned:
            await _drop_schema(self.schema)


def _require_postgres() -> None:
    reason = _postgres_unreachable()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason} (CI=true: PostgreSQL tests must run, not skip)")
        pytest.skip(reason)


def _new_backend(kind: str, tmp_path: Path) -> Backend:
    clock = FakeClock(START)
    if kind == "sqlite":
        return Backend("sqlite", f"sqlite+aiosqlite:///{tmp_path / 'broker.db'}", None, clock)
    _require_postgres()
    return Backend("postgres", POSTGRES_URL, f"broker_test_{uuid.uuid4().hex[:12]}", clock)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    """A fresh store; on PostgreSQL, a test that takes the ``store`` fixture uses the store
    as it is (no migration, no DDL), so it gets the emptied ``pg_schema``, saving ~1 s."""
    if request.param == "postgres" and "store" in request.fixturenames:
        schema = request.getfixturevalue("pg_schema")
        b = Backend("postgres", POSTGRES_URL, schema, FakeClock(START), owned=False)
    else:
        b = _new_backend(request.param, tmp_path)
    try:
        yield b
    finally:
        await b.close()


@pytest.fixture
async def sqlite_backend(tmp_path: Path) -> AsyncIterator[Backend]:
    b = _new_backend("sqlite", tmp_path)
    try:
        yield b
    finally:
        await b.close()


@pytest.fixture
async def pg_backend(tmp_path: Path) -> AsyncIterator[Backend]:
    b = _new_backend("postgres", tmp_path)
    try:
        yield b
    finally:
        await b.close()


@pytest.fixture
async def store(backend: Backend) -> SQLAlchemyAdapter:
    return await backend.open()


async def _enqueue(store: StorageAdapter, **kw: Any) -> Job:
    kw.setdefault("task", "tests.noop")
    result = await store.enqueue(JobSpec(**kw))
    assert not result.duplicate
    return result.job


async def _claim(store: StorageAdapter, job: Job, worker: str = WORKER) -> Job:
    claimed = await store.mark_handed_off(job.id, uuid.uuid4(), worker)
    assert claimed is not None
    return claimed


def _sql(store: SQLAlchemyAdapter, sql: str) -> sa.TextClause:
    """Raw SQL naming tables as ``{s}broker_jobs``, qualified with the store's schema."""
    return sa.text(sql.format(s=f'"{store._schema}".' if store._schema else ""))


async def _scalar(store: SQLAlchemyAdapter, sql: str, **params: Any) -> Any:
    async with store._read("test") as conn:
        return (await conn.execute(_sql(store, sql), params)).scalar()


# --------------------------------------------------------------------------- the row


def test_an_enqueues_row_leaves_its_nulls_out() -> None:
    """The row an enqueue inserts names only the columns that are not NULL (PostgreSQL's
    enqueue sends its rows as JSON, where the nulls were half the text); filled back with
    NULLs it reads as the job. A JSON null inside the args is a value, not a NULL."""
    job_fields = new_job_fields(JobSpec("app.t", args=[None]), START)
    job = Job(**job_fields)
    row = new_row(job_fields)
    assert None not in row.values() and "handoff_id" not in row and row["args"] == "[null]"
    assert job_from_row({**NULL_ROW, **row}) == job


def test_a_selected_row_reads_as_the_general_decoding_reads_it() -> None:
    """Dispatch's selection sets the hollow payloads to their empty values instead of
    decoding them (:func:`selected_job`): the job is the one the general decoding makes
    of the same row, and each job's kwargs a dict of its own."""
    spec = JobSpec("app.t", args=[1], kwargs={"a": 1}, trace_context={"traceparent": "x"})
    row = {**NULL_ROW, **new_row(new_job_fields(spec, START)), **HOLLOW, "seq": 7}
    record = [*(row[column] for column in ROW_COLUMNS), row["seq"]]
    job = selected_job(record)
    assert job == job_from_record(record) == job_from_row(row)
    assert job.args == () and job.kwargs == {} and job.trace_context == {"traceparent": "x"}
    assert selected_job(record).kwargs is not job.kwargs


async def test_every_field_round_trips_through_the_row(store: SQLAlchemyAdapter) -> None:
    plus_two = timezone(timedelta(hours=2))
    run_at = datetime(2030, 1, 1, 13, 59, 30, 123456, tzinfo=plus_two)  # 11:59:30 UTC
    spec = JobSpec(
        task="app.send",
        args=[1, "two", {"three": [3.25, None, True]}, "\ud800 lone surrogate"],
        kwargs={"unicode": "é✓ 雪", "big": 2**62, "neg": -1.5e-300},
        queue="mail",
        priority=-(2**31),
        run_at=run_at,
        max_attempts=2**40,
        idempotency_key="idem-✓",
        concurrency_key="acct-9",
        concurrency_limit=3,
        timeout=0.25,
        execution_mode=ExecutionMode.FORKED,
    )
    enqueued = (await store.enqueue(spec)).job
    stored = await store.get_job(spec.id)
    assert stored == enqueued
    assert stored.run_at == run_at and stored.run_at.tzinfo is UTC
    assert stored.args == tuple(spec.args) and stored.kwargs == spec.kwargs
    assert stored.priority == -(2**31) and stored.max_attempts == 2**40
    assert stored.timeout == 0.25 and stored.execution_mode is ExecutionMode.FORKED
    # Times are integer microseconds since the epoch in the row itself.
    expected_us = (run_at - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)
    raw_us = await _scalar(store, "SELECT run_at_us FROM {s}broker_jobs WHERE task = 'app.send'")
    assert raw_us == expected_us

    store._clock.advance(1.5)
    lease = uuid.uuid4()
    claimed = await store.mark_handed_off(spec.id, lease, "worker-✓")
    assert claimed is not None
    assert claimed.handed_off_at == START + timedelta(seconds=1.5)
    result = {"nested": [1, {"x": None}], "text": "done ✓"}
    assert await store.complete(spec.id, lease, result)
    done = await store.get_job(spec.id)
    assert done is not None
    assert done.result == result and done.status is JobStatus.COMPLETED
    assert done.handoff_id == lease and done.worker_id == "worker-✓"
    assert done.handed_off_at == claimed.handed_off_at
    assert done == (await store.list_jobs()).jobs[0]


@pytest.mark.parametrize(
    "text",
    [
        '[1,"two",{"a":[3.25,null,true]}]',
        '["\\ud800 lone"]',
        "[1e400]",
        "[1.5e-320]",
        '{"a":1,"a":2}',
        "[123456789012345678901234567890]",
        '"\\u00e9"',
    ],
)
def test_stored_json_decodes_as_json_loads_does(text: str) -> None:
    """Rows decode their JSON in C, falling back to ``json.loads`` for what the C decoder
    refuses (an escaped lone surrogate, a number past a float's range): same values."""
    assert repr(loads(text)) == repr(json.loads(text))


def test_stored_text_that_is_not_json_raises_as_json_loads_does() -> None:
    with pytest.raises(json.JSONDecodeError):
        loads("[1,")


async def test_json_null_result_and_no_result_read_back_as_none(store: SQLAlchemyAdapter) -> None:
    for result in (None, [None], 0, ""):
        job = await _claim(store, await _enqueue(store))
        assert job.handoff_id is not None
        assert await store.complete(job.id, job.handoff_id, result)
        stored = await store.get_job(job.id)
        assert stored is not None and stored.result == result


# --------------------------------------------------------------------------- leases


async def test_exact_supplied_leases_are_persisted(backend: Backend) -> None:
    store = await backend.open()
    jobs = [await _enqueue(store, args=[i]) for i in range(5)]
    claims = [Claim(j.id, uuid.uuid4(), f"w{i % 2}") for i, j in enumerate(jobs)]
    # The same job named twice in one batch: the first claim wins, the second loses.
    claims.append(Claim(jobs[0].id, uuid.uuid4(), "w-dup"))
    claimed = await store.mark_handed_off_many(claims)
    assert [j.id for j in claimed] == [j.id for j in jobs]
    other = await backend.open()
    for claim in claims[:-1]:
        stored = await other.get_job(claim.job_id)
        assert stored is not None
        assert (stored.handoff_id, stored.worker_id) == (claim.handoff_id, claim.worker_id)
        assert stored.status is JobStatus.HANDED_OFF
    assert {j.id for j in await other.handoffs_for_worker("w0")} == {
        jobs[0].id,
        jobs[2].id,
        jobs[4].id,
    }


async def test_fenced_reports_reject_wrong_stale_and_repeated_leases(
    store: SQLAlchemyAdapter,
) -> None:
    job = await _claim(store, await _enqueue(store, max_attempts=5))
    lease = job.handoff_id
    assert lease is not None
    wrong = uuid.uuid4()
    assert await store.complete(job.id, wrong, 1) is False
    assert await store.fail(job.id, wrong, "x", START) is False
    assert await store.reschedule(job.id, wrong, START) is False
    assert await store.return_to_queue(job.id, wrong) is False
    assert await store.get_job(job.id) == job, "a fenced-out report changes nothing"

    assert await store.return_to_queue(job.id, lease) is True
    assert await store.return_to_queue(job.id, lease) is False, "a repeated return is a no-op"
    returned = await store.get_job(job.id)
    assert returned is not None and returned.status is JobStatus.QUEUED
    assert returned.handoff_id == lease, "the last lease stays on the row"

    newer = await _claim(store, returned, worker="worker-b")
    assert newer.handoff_id is not None
    for stale in (
        store.complete(job.id, lease, "stale"),
        store.fail(job.id, lease, "stale", None),
        store.reschedule(job.id, lease, START),
        store.return_to_queue(job.id, lease),
    ):
        assert await stale is False
    assert await store.get_job(job.id) == newer

    assert await store.fail(job.id, newer.handoff_id, "boom", START + timedelta(seconds=9))
    assert await store.fail(job.id, newer.handoff_id, "boom again", None) is False
    failed = await store.get_job(job.id)
    assert failed is not None
    assert (failed.status, failed.attempts, failed.last_error) == (JobStatus.QUEUED, 1, "boom")
    assert failed.run_at == START + timedelta(seconds=9)


# --------------------------------------------------------------------------- races


async def test_concurrent_idempotent_enqueues_from_many_engines_make_one_job(
    backend: Backend,
) -> None:
    handles = [await backend.open() for _ in range(4)]

    async def enqueue(i: int) -> list[Any]:
        specs = [JobSpec("t", idempotency_key="race", args=[1])]
        if i % 3 == 0:  # some in batches that also hold a key of their own
            specs.append(JobSpec("t", idempotency_key=f"own-{i}"))
            return await handles[i % 4].enqueue_many(specs)
        return [await handles[i % 4].enqueue(specs[0])]

    results = [r for batch in await asyncio.gather(*(enqueue(i) for i in range(24))) for r in batch]
    racing = [r for r in results if r.job.idempotency_key == "race"]
    assert len({r.job.id for r in racing}) == 1
    assert sum(not r.duplicate for r in racing) == 1
    count = await _scalar(
        handles[0], "SELECT COUNT(*) FROM {s}broker_jobs WHERE idempotency_key = 'race'"
    )
    assert count == 1
    assert await _scalar(handles[0], "SELECT COUNT(*) FROM {s}broker_jobs") == 1 + 8


async def test_an_enqueue_reusing_an_existing_job_id_returns_that_job(
    store: SQLAlchemyAdapter,
) -> None:
    first = await _enqueue(store, args=[1])
    again = await store.enqueue(JobSpec("other", id=first.id))
    assert again.duplicate is True and again.job == first


async def test_pruning_a_key_frees_it_for_a_new_job(store: SQLAlchemyAdapter) -> None:
    job = await _claim(store, await _enqueue(store, idempotency_key="k"))
    assert await store.complete(job.id, job.handoff_id or uuid.uuid4())
    assert (await store.enqueue(JobSpec("tests.noop", idempotency_key="k"))).duplicate is True
    assert await store.prune() == 1
    fresh = await store.enqueue(JobSpec("t", idempotency_key="k"))
    assert fresh.duplicate is False and fresh.job.id != job.id


async def test_concurrent_claimers_on_separate_engines_have_one_winner_per_job(
    backend: Backend,
) -> None:
    store = await backend.open()
    handles = [store, *[await backend.open() for _ in range(4)]]
    jobs = [await _enqueue(store, args=[i]) for i in range(20)]

    async def single(i: int, job: Job) -> Job | None:
        return await handles[i % len(handles)].mark_handed_off(job.id, uuid.uuid4(), f"s{i}")

    async def batch(h: int) -> list[Job]:
        order = jobs if h % 2 else list(reversed(jobs))
        claims = [Claim(j.id, uuid.uuid4(), f"b{h}") for j in order]
        return await handles[h].mark_handed_off_many(claims)

    singles = [single(i, job) for i, job in enumerate(jobs * 3)]
    outcomes = await asyncio.gather(*singles, *(batch(h) for h in range(len(handles))))
    won: list[Job] = []
    for outcome in outcomes:
        if isinstance(outcome, list):
            won.extend(outcome)
        elif outcome is not None:
            won.append(outcome)
    assert sorted(j.id for j in won) == sorted(j.id for j in jobs), "each job exactly once"
    for job in won:
        stored = await store.get_job(job.id)
        assert stored is not None and stored.handoff_id == job.handoff_id


async def test_concurrency_limit_holds_across_engines_through_many_rounds(
    backend: Backend,
) -> None:
    store = await backend.open()
    handles = [store, *[await backend.open() for _ in range(3)]]
    limit = 3
    for i in range(24):
        await _enqueue(store, concurrency_key="shared", concurrency_limit=limit, args=[i])
        await _enqueue(store, concurrency_key=f"solo-{i % 2}", concurrency_limit=1, args=[i])
    finished = 0
    for round_no in range(12):
        eligible = await store.select_eligible(modes=ALL_MODES, limit=100)

        async def grab(h: int, eligible: list[Job] = eligible) -> list[Job]:
            claims = [Claim(j.id, uuid.uuid4(), f"w{h}") for j in eligible[h::2] + eligible]
            return await handles[h].mark_handed_off_many(claims)

        await asyncio.gather(*(grab(h) for h in range(len(handles))))
        running = (
            await store.list_jobs(JobFilter(statuses=[JobStatus.HANDED_OFF]), limit=100)
        ).jobs
        per_key: dict[str, int] = {}
        for job in running:
            assert job.concurrency_key is not None
            per_key[job.concurrency_key] = per_key.get(job.concurrency_key, 0) + 1
        assert per_key.get("shared", 0) <= limit
        assert per_key.get("solo-0", 0) <= 1 and per_key.get("solo-1", 0) <= 1
        # The counters agree with the rows.
        for key, n in per_key.items():
            active = await _scalar(
                store, "SELECT active FROM {s}broker_concurrency WHERE key = :k", k=key
            )
            assert active == n
        # Let every job go, by a different transition each round, from every handle.
        for i, job in enumerate(running):
            lease = job.handoff_id or uuid.uuid4()
            h = handles[i % len(handles)]
            if round_no % 3 == 0:
                assert await h.complete(job.id, lease)
                finished += 1
            elif round_no % 3 == 1:
                assert await h.return_to_queue(job.id, lease)
            else:
                assert await h.cancel(job.id) is not None
                finished += 1
    assert finished > 0
    assert await _scalar(store, "SELECT COALESCE(SUM(active), 0) FROM {s}broker_concurrency") == 0


async def test_sqlite_writers_in_another_process_are_waited_for(sqlite_backend: Backend) -> None:
    backend = sqlite_backend
    store = await backend.open()
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        sys.path.insert(0, {str(REPO)!r})
        from adapters.sql import SQLAlchemyAdapter
        from broker.jobs import JobSpec

        async def main():
            store = SQLAlchemyAdapter({backend.url!r})
            await store.setup()
            for i in range(100):
                await store.enqueue(JobSpec("from-child", args=[i]))
            await store.close()

        asyncio.run(main())
        """
    )
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", script)
    for i in range(100):
        await store.enqueue(JobSpec("from-parent", args=[i]))
        if i % 10 == 0:
            await asyncio.sleep(0)
    assert await asyncio.wait_for(child.wait(), timeout=60) == 0
    assert await _scalar(store, "SELECT COUNT(*) FROM {s}broker_jobs") == 200


async def test_sqlite_connections_are_wal_and_fully_synchronous(sqlite_backend: Backend) -> None:
    store = await sqlite_backend.open()
    assert await _scalar(store, "PRAGMA journal_mode") == "wal"
    assert await _scalar(store, "PRAGMA synchronous") == 2  # FULL
    assert await _scalar(store, "PRAGMA busy_timeout") == 5000
    assert store.capabilities.skip_locked is False
    assert store.capabilities.listen_notify is False
    assert store.capabilities.shared_between_processes is True


async def test_sqlite_hot_queries_use_their_partial_indexes(sqlite_backend: Backend) -> None:
    """Statistics-free SQLite must still pick the dispatch index and need no sort step.

    (PostgreSQL's choice depends on statistics, so it is not pinned down here.)
    """
    store = await sqlite_backend.open()
    await store.enqueue_many([JobSpec("t", args=[i]) for i in range(50)])

    async def plan(stmt: sa.Executable) -> str:
        async with store._engine.connect() as conn:
            sql = str(stmt.compile(conn.sync_connection, compile_kwargs={"literal_binds": True}))
            rows = (await conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}")).all()
        return "\n".join(str(row[-1]) for row in rows)

    from adapters.sql.sqlite import (
        _LITE_ELIGIBLE,
        _LITE_ELIGIBLE_IN_QUEUES,
        _LITE_LEVEL,
        _LITE_NEXT_RUN_BY_TEST,
    )

    async def lite_plan(statement: str, params: tuple[Any, ...]) -> str:
        async with store._engine.connect() as conn:
            found = await conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", params)
            return "\n".join(str(row[-1]) for row in found.all())

    for statement in (_LITE_ELIGIBLE, _LITE_ELIGIBLE_IN_QUEUES):
        # any task, or those the workers declared; no key left out, or one
        for tasks, keys in ((None, None), ('["t"]', None), (None, '[["t", "acme"]]')):
            # One priority level (?8), as a range of the dispatch index up to now (?3).
            params = ('["pooled"]', '["default"]', 0, 50, "[]", tasks, keys, 0)
            eligible = await lite_plan(statement, params)
            assert "ix_broker_jobs_dispatch (priority=? AND run_at_us<?)" in eligible, eligible
            assert "TEMP B-TREE" not in eligible, eligible
    level = await lite_plan(_LITE_LEVEL, (0,))
    assert "ix_broker_jobs_dispatch (priority<?)" in level, level
    for test, statement in enumerate(_LITE_NEXT_RUN_BY_TEST):
        params = ('["pooled"]',) if test == 0 else ('["pooled"]', '["default"]')
        next_run = await lite_plan(statement, params)
        assert "ix_broker_jobs_due (execution_mode=?)" in next_run, next_run
        assert "TEMP B-TREE" not in next_run, next_run
    from adapters.sql.schema import IS_HANDED_OFF, IS_TERMINAL, jobs

    worker = await plan(sa.select(jobs).where(jobs.c.worker_id == "w", IS_HANDED_OFF))
    assert "ix_broker_jobs_worker" in worker
    pruning = await plan(sa.select(jobs.c.id).where(IS_TERMINAL, jobs.c.updated_us < 5).limit(9))
    assert "ix_broker_jobs_terminal_updated" in pruning
    from adapters.sql.schema import IS_ACTIVE

    holder = await plan(sa.select(jobs.c.id).where(jobs.c.unique_key == "k", IS_ACTIVE))
    assert "ux_broker_jobs_unique_key_active" in holder


# --------------------------------------------------------------------------- ordering


async def test_the_jobs_being_claimed_are_left_out_of_a_read(store: SQLAlchemyAdapter) -> None:
    """The dispatcher passes the jobs of its claims under way; the read goes past them
    instead of returning them for the plan to skip."""
    batch = await store.enqueue_many([JobSpec("t", args=[i]) for i in range(6)])
    ids = [r.job.id for r in batch]
    found = await store.select_eligible(modes=ALL_MODES, limit=3, skip=[*ids[:2], ids[3]])
    assert [j.id for j in found] == [ids[2], ids[4], ids[5]]
    queued = await store.select_eligible(modes=ALL_MODES, queues=["default"], skip=ids[1:])
    assert [j.id for j in queued] == ids[:1]


async def test_dispatch_order_and_fifo_within_one_enqueue_batch(
    store: SQLAlchemyAdapter, backend: Backend
) -> None:
    batch = await store.enqueue_many([JobSpec("t", args=[i]) for i in range(12)])
    urgent = await _enqueue(store, priority=1)
    early = await _enqueue(store, run_at=START - timedelta(seconds=1))
    future = await _enqueue(store, priority=9, run_at=START + timedelta(seconds=5))
    order = [j.id for j in await store.select_eligible(modes=ALL_MODES)]
    assert order == [urgent.id, early.id, *(r.job.id for r in batch)]
    assert await store.next_run_at(modes=ALL_MODES) == START - timedelta(seconds=1)
    backend.clock.advance(5)
    assert (await store.select_eligible(modes=ALL_MODES, limit=1))[0].id == future.id


async def test_list_jobs_pages_through_ties_in_creation_time(store: SQLAlchemyAdapter) -> None:
    made = [r.job for r in await store.enqueue_many([JobSpec("t", args=[i]) for i in range(11)])]
    seen: list[uuid.UUID] = []
    cursor: str | None = None
    while True:
        page = await store.list_jobs(limit=4, cursor=cursor)
        seen.extend(j.id for j in page.jobs)
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert sorted(seen) == sorted(j.id for j in made) and len(seen) == len(set(seen))
    full = await store.list_jobs(limit=11)
    assert len(full.jobs) == 11 and full.next_cursor is None
    with pytest.raises(ValueError, match="cursor"):
        await store.list_jobs(cursor="not a cursor!")


async def test_handed_off_jobs_page_newest_first_among_a_queued_backlog(
    store: SQLAlchemyAdapter, backend: Backend
) -> None:
    """The listing a main's start-up makes (handed-off jobs, in pages) reads them from
    their own index, sorted, rather than in the creation order of every row: the same
    jobs, newest first, each once, across pages."""
    made = [r.job for r in await store.enqueue_many([JobSpec("t", args=[i]) for i in range(30)])]
    held = []
    for job in made[::4]:
        held.append(await store.mark_handed_off(job.id, uuid.uuid4(), "w"))
        backend.clock.advance(1)
    seen: list[uuid.UUID] = []
    cursor: str | None = None
    while True:
        page = await store.list_jobs(
            JobFilter(statuses=[JobStatus.HANDED_OFF]), limit=3, cursor=cursor
        )
        seen.extend(j.id for j in page.jobs)
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    newest_first = sorted(held, key=lambda j: (j.created_at, j.id), reverse=True)
    assert seen == [j.id for j in newest_first if j is not None]


async def test_pg_moves_write_no_creation_index(pg_backend: Backend) -> None:
    """PostgreSQL keeps no full index that only listings read (schema version 12): each
    claim and settlement writes a new row version into every full index. Listings still
    page newest first (the test above), without it."""
    store = await pg_backend.open()
    found = await _scalar(
        store,
        "SELECT count(*) FROM pg_indexes WHERE indexname = :name"
        " AND schemaname = coalesce(:schema, current_schema())",
        name=CREATED_INDEX,
        schema=store._schema,
    )
    assert found == 0


# --------------------------------------------------------------------------- pruning


async def test_prune_deletes_only_terminal_rows_in_batches(
    store: SQLAlchemyAdapter, backend: Backend
) -> None:
    active = [await _enqueue(store), await _claim(store, await _enqueue(store))]
    terminal: list[uuid.UUID] = []
    for i in range(23):
        job = await _claim(
            store, await _enqueue(store, max_attempts=1, concurrency_key="k", concurrency_limit=1)
        )
        lease = job.handoff_id or uuid.uuid4()
        if i % 3 == 0:
            assert await store.complete(job.id, lease)
        elif i % 3 == 1:
            assert await store.fail(job.id, lease, "x", None)
        else:
            assert await store.cancel(job.id) is not None
        terminal.append(job.id)
        backend.clock.advance(1)
    assert await store.prune(statuses=[JobStatus.QUEUED, JobStatus.HANDED_OFF]) == 0
    assert await store.prune(keep_latest=30) == 0
    assert await store.prune(keep_latest=20, batch_size=2) == 3
    assert await store.prune(older_than=START + timedelta(seconds=10), batch_size=4) == 7
    assert await store.prune(statuses=[JobStatus.FAILED], batch_size=1) == 5
    assert await store.prune(keep_latest=0, batch_size=5) == 8
    left = {j.id for j in (await store.list_jobs(limit=100)).jobs}
    assert left == {j.id for j in active}
    # Idle concurrency counters are cleaned up with the jobs.
    assert await _scalar(store, "SELECT COUNT(*) FROM {s}broker_concurrency") == 0


# --------------------------------------------------------------------------- setup


async def test_setup_is_safe_when_many_engines_race_on_a_fresh_store(backend: Backend) -> None:
    handles = [backend.adapter() for _ in range(5)]
    await asyncio.gather(*(h.setup() for h in handles))
    await asyncio.gather(*(h.setup() for h in handles))
    assert await _scalar(handles[0], "SELECT version FROM {s}broker_schema") == SCHEMA_VERSION
    job = await _enqueue(handles[1])
    assert await handles[4].get_job(job.id) == job


async def test_a_store_from_a_newer_broker_is_refused(backend: Backend) -> None:
    store = await backend.open()

    await store._write(
        "test",
        lambda conn: conn.execute(
            _sql(store, "UPDATE {s}broker_schema SET version = :v"), {"v": 99}
        ),
    )
    newer = backend.adapter()
    with pytest.raises(SchemaVersionError) as raised:
        await newer.setup()
    message = str(raised.value)
    assert "99" in message and str(SCHEMA_VERSION) in message and "upgrade" in message


async def test_an_older_store_is_migrated_forward(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    from adapters.sql import schema as _sql_schema

    store = await backend.open()
    job = await _enqueue(store)
    ran: list[int] = []
    nxt = SCHEMA_VERSION + 1
    monkeypatch.setattr(
        _sql_schema, "MIGRATIONS", (*_sql_schema.MIGRATIONS, (nxt, lambda c, s: ran.append(nxt)))
    )
    monkeypatch.setattr("adapters.sql.adapter.SCHEMA_VERSION", nxt)
    await backend.adapter().setup()
    assert ran == [nxt]
    assert await _scalar(store, "SELECT version FROM {s}broker_schema") == nxt
    await backend.adapter().setup()
    assert ran == [nxt], "a migration runs once"
    assert await store.get_job(job.id) == job


async def test_a_version_1_store_is_migrated_to_unique_keys(backend: Backend) -> None:
    """A store written by a version-1 broker (built by the v1 migration alone) gains the
    unique_key column and its partial index, keeps its jobs, and enforces the key."""
    from adapters.sql import schema as _sql_schema

    old = backend.adapter()

    def create_v1(conn: sa.Connection) -> None:
        if old._schema is not None:
            conn.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{old._schema}"')
        _sql_schema._v1_initial(conn, old._schema)
        conn.execute(_sql_schema.schema_version.update().values(version=1))
        v1_jobs = _sql_schema._define(sa.MetaData(), 1)[0]
        assert "unique_key" not in v1_jobs.c
        row = {c.name: None for c in v1_jobs.c if c.name != "seq"}
        row.update(
            id=uuid.UUID(int=7),
            task="legacy.task",
            args="[1]",
            kwargs="{}",
            queue="default",
            priority=0,
            status="queued",
            attempts=0,
            max_attempts=3,
            run_at_us=0,
            created_us=0,
            updated_us=0,
            execution_mode="pooled",
        )
        conn.execute(v1_jobs.insert().values(**row))

    await old._write("test", lambda conn: conn.run_sync(create_v1))
    assert await _scalar(old, "SELECT version FROM {s}broker_schema") == 1

    store = await backend.open()  # setup() migrates 1 -> SCHEMA_VERSION
    assert await _scalar(store, "SELECT version FROM {s}broker_schema") == SCHEMA_VERSION
    legacy = await store.get_job(uuid.UUID(int=7))
    assert legacy is not None and legacy.task == "legacy.task" and legacy.unique_key is None
    assert list(legacy.args) == [1]

    first = await store.enqueue(JobSpec(task="t", unique_key="acct-1"))
    again = await store.enqueue(JobSpec(task="t", unique_key="acct-1"))
    assert not first.duplicate and again.duplicate and again.job.id == first.job.id
    # The partial unique index itself refuses a second active row, even from raw SQL.
    jobs = _sql_schema.jobs
    with pytest.raises(StorageError) as raised:

        async def in_transaction(conn: AsyncConnection) -> None:
            await conn.execute(
                sa.update(jobs).where(jobs.c.id == legacy.id).values(unique_key="acct-1")
            )

        await store._write("test", in_transaction)
    assert isinstance(raised.value.__cause__, sa.exc.IntegrityError)
    claimed = await _claim(store, first.job)
    assert await store.complete(claimed.id, claimed.handoff_id or uuid.uuid4())
    fresh = await store.enqueue(JobSpec(task="t", unique_key="acct-1"))
    assert not fresh.duplicate, "a finished job's unique key is free again"
    await backend.adapter().setup()  # already current: nothing runs twice
    assert await _scalar(store, "SELECT version FROM {s}broker_schema") == SCHEMA_VERSION


async def test_pg_enqueue_creates_the_counters_of_its_keys(pg_backend: Backend) -> None:
    """An enqueue in a statement of its own creates the counters of its jobs' concurrency
    keys (at zero, an existing one untouched), so their claims decide in one statement;
    one inside an application's transaction leaves them to the first claim, never
    holding a counter uncommitted for as long as that transaction."""
    import asyncpg  # type: ignore[import-untyped]

    store = await pg_backend.open()
    counters = "SELECT count(*) FROM {s}broker_concurrency WHERE key = :key"
    one = await store.enqueue(JobSpec("t", concurrency_key="solo", concurrency_limit=1))
    batch = await store.enqueue_many(
        [JobSpec("t", concurrency_key=k, concurrency_limit=2) for k in ("b", "a", "b")]
        + [JobSpec("t")]
    )
    for key in ("solo", "a", "b"):
        assert await _scalar(store, counters, key=key) == 1
    claimed = await store.mark_handed_off_many(
        [Claim(r.job.id, uuid.uuid4(), "w") for r in [one, *batch]]
    )
    assert len(claimed) == 5
    active = "SELECT active FROM {s}broker_concurrency WHERE key = :key"
    assert await _scalar(store, active, key="b") == 2
    again = await store.enqueue(JobSpec("t", concurrency_key="b", concurrency_limit=2))
    assert await _scalar(store, active, key="b") == 2, "an existing counter is left as it is"
    assert await store.mark_handed_off(again.job.id, uuid.uuid4(), "w") is None

    dsn = POSTGRES_URL.replace("postgresql+asyncpg://", "postgresql://", 1)
    conn = await asyncpg.connect(dsn)
    try:
        if store._schema is not None:
            await conn.execute(f'SET search_path = "{store._schema}"')
        async with conn.transaction():
            [held] = await store.enqueue_on_driver_connection(
                conn, [JobSpec("t", concurrency_key="in-tx", concurrency_limit=1)]
            )
        assert await _scalar(store, counters, key="in-tx") == 0
    finally:
        await conn.close()
    assert await store.mark_handed_off(held.job.id, uuid.uuid4(), "w") is not None
    assert await _scalar(store, active, key="in-tx") == 1


async def test_a_version_18_store_is_migrated_to_the_due_index(backend: Backend) -> None:
    """A store written at version 18, with queued jobs (due, scheduled ahead, of two
    modes) and one handed off, gains the due index from its rows (version 19): the
    next run time and the eligible read answer from it as before the upgrade."""
    from adapters.sql import schema as _sql_schema

    old = backend.adapter()
    v18_jobs = _sql_schema._define(sa.MetaData(), 18)[0]
    now_us = int(START.timestamp() * 1_000_000)

    def row(n: int, **values: Any) -> dict[str, Any]:
        base = {
            "id": uuid.UUID(int=n),
            "task": "legacy.task",
            "args": f"[{n}]",
            "kwargs": "{}",
            "queue": "default",
            "priority": 0,
            "status": "queued",
            "attempts": 0,
            "max_attempts": 3,
            "run_at_us": now_us - 1_000_000,
            "created_us": now_us - 1_000_000 + n,
            "updated_us": now_us,
            "execution_mode": "pooled",
        }
        return {**base, **values}

    rows = [
        row(1, priority=2),
        row(2),
        row(3, priority=5, run_at_us=now_us + 60_000_000),
        row(4, execution_mode="inline", run_at_us=now_us - 5_000_000),
        row(
            5,
            status="handed_off",
            run_at_us=now_us - 9_000_000,
            worker_id="w",
            handoff_id=uuid.UUID(int=50),
            handed_off_us=now_us,
        ),
    ]

    def create_v18(conn: sa.Connection) -> None:
        if old._schema is not None:
            conn.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{old._schema}"')
        for _version, step in _sql_schema.MIGRATIONS[:18]:
            step(conn, old._schema)
        conn.execute(_sql_schema.schema_version.update().values(version=18))
        conn.execute(v18_jobs.insert(), rows)

    await old._write("test", lambda conn: conn.run_sync(create_v18))
    assert await _scalar(old, "SELECT version FROM {s}broker_schema") == 18

    store = await backend.open()  # setup() migrates 18 -> 19
    assert await _scalar(store, "SELECT version FROM {s}broker_schema") == SCHEMA_VERSION
    if backend.is_pg:
        indexes = "SELECT count(*) FROM pg_indexes WHERE indexname = :name" + (
            " AND schemaname = coalesce(:schema, current_schema())"
        )
        found = await _scalar(store, indexes, name=_sql_schema.DUE_INDEX, schema=store._schema)
    else:
        found = await _scalar(
            store,
            "SELECT count(*) FROM sqlite_master WHERE name = :name",
            name=_sql_schema.DUE_INDEX,
        )
    assert found == 1
    assert await store.next_run_at(modes=ALL_MODES) == START - timedelta(seconds=5)
    assert await store.next_run_at(modes=[ExecutionMode.POOLED]) == START - timedelta(seconds=1)
    read = await store.select_eligible(modes=[ExecutionMode.POOLED])
    assert [j.id for j in read] == [uuid.UUID(int=1), uuid.UUID(int=2)]
    fresh = await store.enqueue(JobSpec("t", run_at=START - timedelta(seconds=30)))
    assert await store.next_run_at(modes=[ExecutionMode.POOLED]) == fresh.job.run_at
    await backend.adapter().setup()  # already current: nothing runs twice


async def test_driver_errors_become_storage_errors(backend: Backend, tmp_path: Path) -> None:
    store = await backend.open()

    async def in_transaction(conn: AsyncConnection) -> None:
        for table in ("broker_payloads", "broker_job_links", "broker_job_edges"):
            await conn.execute(_sql(store, f"DROP TABLE {{s}}{table}"))  # refer to the jobs
        await conn.execute(_sql(store, "DROP TABLE {s}broker_jobs"))

    await store._write("test", in_transaction)
    with pytest.raises(StorageError, match="get_job failed"):
        await store.get_job(uuid.uuid4())
    with pytest.raises(StorageError, match="enqueue failed"):
        await store.enqueue(JobSpec("t"))
    if backend.is_pg:
        url = "postgresql+asyncpg://postgres@127.0.0.1:1/nowhere"
    else:
        url = f"sqlite:///{tmp_path / 'missing-dir' / 'x.db'}"
    unreachable = SQLAlchemyAdapter(url)
    try:
        with pytest.raises(StorageError, match="setup failed"):
            await unreachable.setup()
    finally:
        await unreachable.close()


# --------------------------------------------------------------------------- notify


async def test_listen_wakes_on_inserts_from_another_engine_and_raw_sql(backend: Backend) -> None:
    store = await backend.open()
    if not backend.is_pg:
        with pytest.raises(ConfigurationError, match="PostgreSQL"):
            store.listen(lambda: None)
        return
    assert isinstance(store, SupportsNotify) and store.capabilities.listen_notify
    other = await backend.open()
    woken = asyncio.Event()
    async with store.listen(woken.set):
        await _enqueue(other)
        await asyncio.wait_for(woken.wait(), timeout=5)
        woken.clear()
        await other.enqueue_many([JobSpec("t") for _ in range(3)])
        await asyncio.wait_for(woken.wait(), timeout=5)
        woken.clear()
        import asyncpg

        raw = await asyncpg.connect(_asyncpg_dsn())
        try:
            await raw.execute(
                f'INSERT INTO "{backend.schema}".broker_jobs (id, task, args, kwargs, queue, '
                "priority, status, attempts, max_attempts, run_at_us, created_us, updated_us, "
                "execution_mode) VALUES ($1, 'raw', '[]', '{}', 'default', 0, 'queued', 0, 1, "
                "0, 0, 0, 'inline')",
                uuid.uuid4(),
            )
        finally:
            await raw.close()
        await asyncio.wait_for(woken.wait(), timeout=5)
    # A store in another schema uses another channel and is not woken.
    assert notify_channel(backend.schema or "") != notify_channel("public")
    assert len(notify_channel("s" * 63)) <= 63


@pytest.mark.postgres
async def test_a_mains_own_enqueues_notify_no_listener(pg_backend: Backend) -> None:
    """A main wakes its own dispatcher after each enqueue, so its adapter (single_main)
    inserts quietly; every other writer still notifies. Notifications reach a listener
    in commit order, so one from the quiet insert would arrive before the raw insert's."""
    import asyncpg

    main_store = await pg_backend.open(single_main=True)
    await _enqueue(main_store)
    await main_store.enqueue_many([JobSpec("t") for _ in range(3)])
    listener = await asyncpg.connect(_asyncpg_dsn())
    raw = await asyncpg.connect(_asyncpg_dsn())
    heard: list[int] = []
    raw_heard = asyncio.Event()

    def note(_conn: object, pid: int, _channel: str, _payload: str) -> None:
        heard.append(pid)
        if pid == raw.get_server_pid():
            raw_heard.set()

    try:
        await listener.add_listener(notify_channel(pg_backend.schema or ""), note)
        await _enqueue(main_store)  # quiet
        await raw.execute(
            f'INSERT INTO "{pg_backend.schema}".broker_jobs (id, task, args, kwargs, queue, '
            "priority, status, attempts, max_attempts, run_at_us, created_us, updated_us, "
            "execution_mode) VALUES ($1, 'raw', '[]', '{}', 'default', 0, 'queued', 0, 1, "
            "0, 0, 0, 'inline')",
            uuid.uuid4(),
        )
        await asyncio.wait_for(raw_heard.wait(), timeout=5)
        assert heard == [raw.get_server_pid()]
        # Another process's adapter (not a main's) still notifies.
        other = await pg_backend.open()
        woken = asyncio.Event()
        async with main_store.listen(woken.set):
            await _enqueue(other)
            await asyncio.wait_for(woken.wait(), timeout=5)
    finally:
        await listener.close()
        await raw.close()


@pytest.mark.postgres
async def test_a_quiet_insert_does_not_start_the_notify_function(pg_backend: Backend) -> None:
    """The quiet test is the trigger's WHEN clause (schema 13), so a main's own insert
    skips the plpgsql function altogether, not merely its body; a plain insert still
    runs it. Counted by the server for the open transaction (``track_functions``)."""
    import asyncpg

    await pg_backend.open()  # creates the schema
    insert = (
        f'INSERT INTO "{pg_backend.schema}".broker_jobs (id, task, args, kwargs, queue, '
        "priority, status, attempts, max_attempts, run_at_us, created_us, updated_us, "
        "execution_mode) VALUES ($1, 'raw', '[]', '{}', 'default', 0, 'queued', 0, 1, "
        "0, 0, 0, 'inline')"
    )
    calls = (
        "SELECT coalesce(pg_stat_get_xact_function_calls("
        f"'\"{pg_backend.schema}\".broker_jobs_notify'::regproc), 0)"
    )

    async def calls_for_one_insert(settings: dict[str, str]) -> int:
        conn = await asyncpg.connect(
            _asyncpg_dsn(), server_settings={"track_functions": "pl", **settings}
        )
        try:
            async with conn.transaction():
                await conn.execute(insert, uuid.uuid4())
                return int(await conn.fetchval(calls))
        finally:
            await conn.close()

    assert await calls_for_one_insert({}) == 1
    assert await calls_for_one_insert({QUIET_INSERTS_SETTING: "on"}) == 0


@pytest.mark.postgres
async def test_without_a_schema_tables_and_channel_follow_the_search_path(
    pg_backend: Backend,
) -> None:
    backend = pg_backend
    import asyncpg

    database = f"broker_test_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(_asyncpg_dsn())
    try:
        await admin.execute(f'CREATE DATABASE "{database}"')
        url = sa.make_url(POSTGRES_URL).set(database=database).render_as_string(False)
        first = SQLAlchemyAdapter(url, clock=backend.clock)
        second = SQLAlchemyAdapter(url, clock=backend.clock)
        try:
            await first.setup()
            await second.setup()
            assert await _scalar(first, "SELECT to_regclass('public.broker_jobs') IS NOT NULL")
            woken = asyncio.Event()
            async with first.listen(woken.set):
                await _enqueue(second)
                await asyncio.wait_for(woken.wait(), timeout=5)
        finally:
            await first.close()
            await second.close()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        await admin.close()


# --------------------------------------------------------------------------- configuration


def test_missing_drivers_say_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "aiosqlite", None)
    with pytest.raises(MissingDriverError, match="pip install aiosqlite"):
        SQLAlchemyAdapter(f"sqlite:///{tmp_path / 'x.db'}")
    monkeypatch.setitem(sys.modules, "asyncpg", None)
    with pytest.raises(MissingDriverError, match="pip install asyncpg"):
        SQLAlchemyAdapter("postgresql://u@localhost/db")


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("mysql://u@h/db", "sqlite\\+aiosqlite:///"),
        ("postgresql+psycopg://u@h/db", "postgresql\\+asyncpg://"),
        ("sqlite://", "in-memory"),
        ("sqlite:///:memory:", "in-memory"),
        ("::::", "cannot parse"),
    ],
)
def test_unsupported_urls_are_configuration_errors(url: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        SQLAlchemyAdapter(url)


async def test_url_aliases_and_options(tmp_path: Path) -> None:
    for url in ("postgres://u@h/db", "postgresql://u@h/db", "postgresql+asyncpg://u@h/db"):
        pg = SQLAlchemyAdapter(url, schema="s")
        assert "postgresql+asyncpg://u@h/db" in repr(pg)
        assert pg.capabilities.skip_locked and pg.capabilities.listen_notify
        await pg.close()
    lite = SQLAlchemyAdapter(f"sqlite:///{tmp_path / 'a.db'}")
    assert "sqlite+aiosqlite" in repr(lite)
    await lite.close()
    with pytest.raises(ConfigurationError, match="PostgreSQL only"):
        SQLAlchemyAdapter(f"sqlite:///{tmp_path / 'a.db'}", schema="s")
    with pytest.raises(ConfigurationError, match="pool_size"):
        SQLAlchemyAdapter(f"sqlite:///{tmp_path / 'a.db'}", pool_size=0)
    secret = SQLAlchemyAdapter("postgresql://u:hunter2@h/db")
    assert "hunter2" not in repr(secret)
    await secret.close()


async def test_a_batch_of_several_statements_is_one_batch_in_order_with_its_duplicates(
    store: SQLAlchemyAdapter,
) -> None:
    """On PostgreSQL a big batch is written a chunk at a time (each built while the one
    before is written): the jobs still come back, and dispatch, in batch order, and a key
    taken in an earlier chunk, or before the batch, makes a duplicate as in one statement."""
    held = await _enqueue(store, unique_key="held")
    specs = [JobSpec("t", args=[i]) for i in range(700)]
    specs[10] = JobSpec("t", args=[10], unique_key="u")
    specs[610] = JobSpec("t", args=[610], unique_key="u")  # two chunks after the first
    specs[300] = JobSpec("t", args=[300], unique_key="held")
    results = await store.enqueue_many(specs)
    assert [r.duplicate for r in results].count(True) == 2
    assert results[610].duplicate and results[610].job.id == results[10].job.id
    assert results[300].duplicate and results[300].job.id == held.id
    fresh = [r.job for r in results if not r.duplicate]
    assert [j.args for j in fresh] == [(i,) for i in range(700) if i not in (300, 610)]
    order = [j.id for j in await store.select_eligible(modes=ALL_MODES, limit=1000)]
    assert order == [held.id, *(j.id for j in fresh)]


async def test_a_row_refused_in_a_late_chunk_stores_nothing_of_the_batch(
    pg_backend: Backend,
) -> None:
    store = await pg_backend.open()
    specs = [JobSpec("t", args=[i]) for i in range(700)]
    specs[650] = JobSpec("t", concurrency_key="k", concurrency_limit=2**70)  # bigint refuses
    with pytest.raises(StorageRejectedError):
        await store.enqueue_many(specs)
    assert await store.select_eligible(modes=ALL_MODES) == []
    assert len(await store.enqueue_many(specs[:3])) == 3  # the connections still work


def test_decoding_an_enum_column_keeps_the_enums_own_answers() -> None:
    """The dict lookup in front of the enum's call changes nothing it answers: a member
    for each stored value, ``ValueError`` for a value no member has (a hand-edited row)."""
    from adapters.sql.rows import enum_decoder

    decode = enum_decoder(ExecutionMode)
    assert [decode(m.value) for m in ExecutionMode] == list(ExecutionMode)
    with pytest.raises(ValueError):
        decode("teleported")


@pytest.mark.postgres
async def test_a_batch_goes_in_one_plain_insert_unless_something_stands_in_the_way(
    pg_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of new jobs is one plain ``INSERT`` committed on its own; a key taken in
    the store or repeated in the batch fails that statement, which stores nothing, and
    the batch goes the careful way: its duplicates found, the rest stored once."""
    store = await pg_backend.open(single_main=True)
    answers = _plain_insert_answers(store, monkeypatch)
    fresh = [JobSpec("t", args=[i]) for i in range(3)]
    results = await store.enqueue_many(fresh)
    assert answers == [True]
    assert [r.job_id for r in results] == [s.id for s in fresh]
    assert [r.job for r in results] == [await store.get_job(s.id) for s in fresh]

    held = JobSpec("t", args=["held"], idempotency_key="k")
    await store.enqueue_many([held, JobSpec("t")])
    again = [JobSpec("t", args=["new"]), JobSpec("t", args=["held"], idempotency_key="k")]
    repeated = [JobSpec("t", unique_key="u"), JobSpec("t", unique_key="u")]
    for batch in (again, repeated):
        results = await store.enqueue_many(batch)
        assert answers[-1] is False
        assert [r.duplicate for r in results] == [False, True]
        assert await store.get_job(batch[0].id) is not None
    assert results[1].job_id == repeated[0].id
    page = await store.list_jobs(limit=100)
    assert len(page.jobs) == 3 + 2 + 1 + 1  # every job stored once


@pytest.mark.postgres
async def test_a_plain_batch_stores_each_jobs_every_field_by_column(
    pg_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plain insert sends a batch by column (one array per column, a column of one
    value encoded once): every field of every job is stored as the row by row way
    writes it, equal values of different types apart, a column NULL in some rows."""
    store = await pg_backend.open(single_main=True)
    answers = _plain_insert_answers(store, monkeypatch)
    later = datetime(2031, 5, 6, 7, 8, 9, 123456, tzinfo=UTC)
    shared = (1,)
    batch = [
        JobSpec("t", args=shared),
        JobSpec("t", args=shared, kwargs={"k": [1.5, None]}, priority=-3, run_at=later),
        JobSpec("t", args=[True], timeout=2.5, max_recoveries=0, local_state=True),
        JobSpec("u", args=[1.0], queue="q", concurrency_key="c", concurrency_limit=2),
        JobSpec("t", args=["é\n"], trace_context={"traceparent": "00-a-b-01"}, rate_key="r"),
        JobSpec("t", idempotency_key="i", unique_key="u", execution_mode=ExecutionMode.INLINE),
    ]
    results = await store.enqueue_many(batch)
    assert answers == [True]
    stored = [await store.get_job(s.id) for s in batch]
    assert [r.job for r in results] == stored
    # repr: 1, True and 1.0 are equal, but not the same argument
    assert [repr(r.job) for r in results] == [repr(j) for j in stored]
    assert [repr(j.args) for j in stored if j is not None][:4] == [
        "(1,)",
        "(1,)",
        "(True,)",
        "(1.0,)",
    ]


def _plain_insert_answers(store: Any, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each batch went as plain inserts (``True``) or the careful way, in order."""
    answers: list[bool] = []
    dialect = store._dialect
    every = dialect._enqueue_every

    async def noted(*args: Any) -> Any:
        answer = await every(*args)
        answers.append(answer is not None)
        return answer

    monkeypatch.setattr(dialect, "_enqueue_every", noted)
    return answers


@pytest.mark.postgres
async def test_a_batch_over_one_statement_goes_chunk_by_chunk_all_or_none(
    pg_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch larger than one plain statement takes (``_EVERY_AT_ONCE``) goes in one
    transaction, a statement per chunk; a key taken or a payload to offload in a late
    chunk rolls back the chunks before it, and the batch goes the careful way: its
    duplicate found, every other job stored once, the large payload offloaded."""
    import adapters.sql.postgres as postgres

    monkeypatch.setattr(postgres, "_EVERY_AT_ONCE", 300)  # 700 jobs: three chunks of 250
    store = await pg_backend.open(single_main=True, offload_threshold=1000)
    answers = _plain_insert_answers(store, monkeypatch)
    fresh = [
        JobSpec("t", args=[i], concurrency_key=f"k{i % 3}", concurrency_limit=1) for i in range(700)
    ]
    results = await store.enqueue_many(fresh)
    assert answers == [True]
    assert [r.job_id for r in results] == [s.id for s in fresh]
    assert [r.job for r in results[::233]] == [await store.get_job(s.id) for s in fresh[::233]]

    held = JobSpec("t", args=["held"], idempotency_key="held")
    await store.enqueue_many([held])
    taken = [JobSpec("t", args=[i]) for i in range(700)]
    taken[650] = JobSpec("t", args=["held"], idempotency_key="held")
    big = [JobSpec("t", args=[i]) for i in range(700)]
    big[600] = JobSpec("t", args=["b" * 1001])
    for batch, duplicates in ((taken, [650]), (big, [])):
        results = await store.enqueue_many(batch)
        assert answers[-1] is False
        assert [i for i, r in enumerate(results) if r.duplicate] == duplicates
    assert results[600].job.args == ("b" * 1001,)
    assert (await store.get_job(big[600].id)) == results[600].job
    page = await store.list_jobs(limit=5000, include_payload=False)
    assert len(page.jobs) == 700 + 1 + 699 + 700  # every job stored once


@pytest.mark.postgres
async def test_jobs_written_handed_off_at_enqueue_are_fenced_alone_and_in_a_batch(
    pg_backend: Backend,
) -> None:
    """A job written handed off at enqueue is fenced as a claim is, whether it goes alone
    (the one-job statement, parameters for its columns) or in a batch (the JSON one):
    under a superseded epoch the enqueue raises and stores nothing; under the current
    one the row holds the lease minted before the insert."""
    store = await pg_backend.open()
    first = await store.elect("main-a", "a:1", 30.0)
    assert first is not None and first.holder == "main-a"
    await store.resign("main-a", first.epoch)
    second = await store.elect("main-b", "b:1", 30.0)
    assert second is not None and second.epoch == first.epoch + 1

    def leased(n: int) -> tuple[list[JobSpec], list[Claim | None]]:
        specs = [JobSpec(task="tests.noop", args=(i,)) for i in range(n)]
        return specs, [Claim(s.id, uuid.uuid4(), "worker-1") for s in specs]

    store.fence(first.epoch)
    for n in (1, 2):
        specs, claims = leased(n)
        with pytest.raises(DeposedError):
            await store.enqueue_handed_off(specs, claims)
        assert [await store.get_job(s.id) for s in specs] == [None] * n

    store.fence(second.epoch)
    for n in (1, 2):
        specs, claims = leased(n)
        results = await store.enqueue_handed_off(specs, claims)
        assert [r.duplicate for r in results] == [False] * n
        for spec, claim in zip(specs, claims, strict=True):
            job = await store.get_job(spec.id)
            assert claim is not None and job is not None
            assert (job.status, job.handoff_id, job.worker_id) == (
                JobStatus.HANDED_OFF,
                claim.handoff_id,
                "worker-1",
            )
