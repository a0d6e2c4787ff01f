"""Retention: finished jobs are pruned by age (completed/cancelled sooner, dead later) and by
an optional row cap, in batches, never an active job; the table stays bounded under load."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Collection
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from adapters.memory import MemoryAdapter
from adapters.sql import SQLAlchemyAdapter
from broker.exceptions import ConfigurationError, StorageError
from broker.jobs import Claim, Job, JobSpec, JobStatus, Outcome, Settlement
from broker.main.main import DEFAULT_RETENTION, Main
from broker.main.retention import Retention, prune_once, run_retention
from broker.main.settings import MainSettings
from broker.ops import cli
from broker.storage import StorageAdapter
from broker.testing import FakeClock
from tests.conftest import drop_schema, fresh_schema_name, require_postgres
from tests.support import until

START = datetime(2030, 1, 1, tzinfo=UTC)
DAY = 86400


async def _finish(store: StorageAdapter, how: JobStatus, **kw: Any) -> Job:
    job = (await store.enqueue(JobSpec(task="t", max_attempts=1, **kw))).job
    lease = uuid.uuid4()
    assert await store.mark_handed_off(job.id, lease, "w") is not None
    if how is JobStatus.COMPLETED:
        assert await store.complete(job.id, lease)
    elif how is JobStatus.FAILED:
        assert await store.fail(job.id, lease, "x", None)
    else:
        assert await store.cancel(job.id) is not None
    return job


async def _ids(store: StorageAdapter) -> set[uuid.UUID]:
    return {j.id for j in (await store.list_jobs(limit=1000)).jobs}


def test_defaults_and_validation() -> None:
    r = Retention()
    assert r.completed_ttl == timedelta(days=7) and r.dead_ttl == timedelta(days=30)
    assert r.max_terminal_rows is None and r.interval == 60 and r.batch_size == 1000
    assert r == DEFAULT_RETENTION
    for bad in (
        {"completed_ttl": timedelta(0)},
        {"dead_ttl": timedelta(seconds=-1)},
        {"max_terminal_rows": -1},
        {"interval": 0},
        {"batch_size": 0},
    ):
        with pytest.raises(ConfigurationError):
            Retention(**bad)


async def test_each_class_goes_after_its_own_age_and_active_jobs_never() -> None:
    clock = FakeClock(START)
    store = MemoryAdapter(clock=clock)
    done = await _finish(store, JobStatus.COMPLETED)
    cancelled = await _finish(store, JobStatus.CANCELLED)
    dead = await _finish(store, JobStatus.FAILED)
    queued = (await store.enqueue(JobSpec(task="t"))).job
    running = (await store.enqueue(JobSpec(task="t"))).job
    assert await store.mark_handed_off(running.id, uuid.uuid4(), "w") is not None
    active = {queued.id, running.id}

    clock.advance(6 * DAY)
    assert await prune_once(store, Retention(), clock) == {
        "completed_cancelled": 0,
        "dead": 0,
    }
    clock.advance(1 * DAY + 1)
    assert (await prune_once(store, Retention(), clock))["completed_cancelled"] == 2
    assert await _ids(store) == active | {dead.id}
    clock.advance(23 * DAY)
    assert (await prune_once(store, Retention(), clock))["dead"] == 1
    assert await _ids(store) == active
    assert {done.id, cancelled.id}.isdisjoint(await _ids(store))


async def test_a_ttl_of_none_keeps_that_class_and_the_cap_keeps_the_newest() -> None:
    clock = FakeClock(START)
    store = MemoryAdapter(clock=clock)
    finished = []
    for i in range(10):
        finished.append(await _finish(store, JobStatus.COMPLETED, args=[i]))
        clock.advance(1)
    queued = (await store.enqueue(JobSpec(task="t"))).job
    clock.advance(365 * DAY)
    forever = Retention(completed_ttl=None, dead_ttl=None)
    assert await prune_once(store, forever, clock) == {}
    assert len(await _ids(store)) == 11
    capped = Retention(completed_ttl=None, dead_ttl=None, max_terminal_rows=3)
    assert await prune_once(store, capped, clock) == {"over_cap": 7}
    assert await _ids(store) == {j.id for j in finished[-3:]} | {queued.id}


class _FlakyPrune(MemoryAdapter):
    def __init__(self, failures: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.failures = failures
        self.calls: list[tuple[Collection[JobStatus] | None, int]] = []

    async def prune(self, **kw: Any) -> int:
        self.calls.append((kw.get("statuses"), kw["batch_size"]))
        if self.failures > 0:
            self.failures -= 1
            raise StorageError("injected: the store is down")
        return await super().prune(**kw)


async def test_the_loop_logs_deletions_and_survives_store_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock(START)
    store = _FlakyPrune(failures=2, clock=clock)
    job = await _finish(store, JobStatus.COMPLETED)
    clock.advance(8 * DAY)
    settings = Retention(interval=0.01, batch_size=17)
    caplog.set_level(logging.INFO, logger="broker.retention")
    loop = asyncio.create_task(run_retention(store, settings, clock))
    try:
        for _ in range(500):
            if await store.get_job(job.id) is None:
                break
            await asyncio.sleep(0.01)
        assert await store.get_job(job.id) is None
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    assert loop.cancelled()
    text = caplog.text
    assert "retention pass failed" in text and "injected" in text
    assert "retention pruned completed_cancelled=1" in text
    assert all(size == 17 for _, size in store.calls), "prune is asked for batches"


async def test_the_main_runs_retention_unless_told_not_to() -> None:
    clock = FakeClock(START)
    store = MemoryAdapter(clock=clock)
    job = await _finish(store, JobStatus.COMPLETED)
    clock.advance(2)
    quick = Retention(completed_ttl=timedelta(seconds=1), interval=0.01)
    main = Main(store, MainSettings(port=0), clock=clock, retention=quick)
    await main.start()
    try:

        async def pruned() -> bool:
            return await store.get_job(job.id) is None

        assert await until(pruned), "the main's retention loop pruned the old job"
    finally:
        await main.stop()
    off = Main(MemoryAdapter(), MainSettings(port=0), retention=None)
    assert off.leader.retention is None, "retention=None: the main runs no retention loop"
    assert Main(MemoryAdapter()).leader.retention == Retention()


def test_cli_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    args = cli.main_parser().parse_args([])
    assert args.retention_completed == timedelta(days=7)
    assert args.retention_dead == timedelta(days=30)
    assert args.retention_max_rows is None and args.retention_interval == 60
    monkeypatch.setenv("BROKER_RETENTION_COMPLETED", "3600")
    monkeypatch.setenv("BROKER_RETENTION_MAX_ROWS", "100000")
    args = cli.main_parser().parse_args(["--retention-dead", "0", "--retention-interval", "5"])
    assert args.retention_completed == timedelta(hours=1) and args.retention_max_rows == 100000
    assert args.retention_dead is None, "0 keeps dead jobs forever"
    assert args.retention_interval == 5
    text = cli.main_parser().format_help()
    for var in ("COMPLETED", "DEAD", "MAX_ROWS", "INTERVAL"):
        assert f"BROKER_RETENTION_{var}" in text
    with pytest.raises(SystemExit):
        cli.main_parser().parse_args(["--retention-completed", "-1"])


async def test_broker_main_builds_its_retention_from_the_flags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[Main] = []

    async def fake_start(self: Main) -> None:
        seen.append(self)
        raise asyncio.CancelledError

    monkeypatch.setattr(Main, "start", fake_start)
    args = cli.main_parser().parse_args(
        [
            "--database-url",
            "memory://",
            "--port",
            "0",
            "--retention-completed",
            "60",
            "--retention-dead",
            "0",
            "--retention-max-rows",
            "500",
            "--retention-interval",
            "2.5",
        ]
    )
    with pytest.raises(asyncio.CancelledError):
        await cli.run_main(args)
    assert seen[0].leader.retention == Retention(
        completed_ttl=timedelta(seconds=60), dead_ttl=None, max_terminal_rows=500, interval=2.5
    )


async def test_sql_prune_deletes_in_batches_of_the_given_size(tmp_path: Path) -> None:
    clock = FakeClock(START)
    store = SQLAlchemyAdapter(f"sqlite+aiosqlite:///{tmp_path / 'batches.db'}", clock=clock)
    await store.setup()
    try:
        for i in range(23):
            await _finish(store, JobStatus.COMPLETED, args=[i])
        queued = (await store.enqueue(JobSpec(task="t"))).job
        deletes: list[str] = []

        def count(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
            if statement.lstrip().upper().startswith("DELETE FROM BROKER_JOBS"):
                deletes.append(statement)

        event.listen(store._engine.sync_engine, "before_cursor_execute", count)
        assert await store.prune(older_than=START + timedelta(days=1), batch_size=5) == 23
        assert len(deletes) == 5, "23 rows in batches of 5: 5, 5, 5, 5, 3"
        assert all(d.count("?") <= 5 for d in deletes), "no delete names more than a batch"
        assert await _ids(store) == {queued.id}
    finally:
        await store.close()


# --------------------------------------------------------------------------- under load

TOTAL = 50_000
BATCH = 500
CAP = 1500
SENTINELS = 20


@pytest.mark.soak
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_retention_keeps_the_table_bounded_through_50000_jobs(
    backend: str, tmp_path: Path
) -> None:
    """50,000 jobs go enqueue -> claim -> complete (a tenth die, one in 100 is cancelled)
    in batches of 500, while retention runs beside them with a 4 s TTL (the clock moves 1 s
    a batch) and a cap of 1,500 finished rows. The row count is sampled after every batch:
    it stays within the cap plus a batch or two in flight, and no active job ever goes."""
    clock = FakeClock(START)
    schema = None
    if backend == "postgres":
        url, schema = require_postgres(), fresh_schema_name()
    else:
        url = f"sqlite+aiosqlite:///{tmp_path / 'bounded.db'}"
    store = SQLAlchemyAdapter(url, clock=clock, schema=schema)
    await store.setup()
    settings = Retention(
        completed_ttl=timedelta(seconds=4),
        dead_ttl=timedelta(seconds=8),
        max_terminal_rows=CAP,
        interval=0.05,
        batch_size=BATCH,
    )
    bound = CAP + 2 * BATCH + 2 * SENTINELS  # observed: CAP + BATCH + the sentinels
    try:
        # Active jobs that live through the whole run: queued for later, and running.
        later = await store.enqueue_many(
            [JobSpec(task="later", run_at=START + timedelta(days=1)) for _ in range(SENTINELS)]
        )
        running = await store.enqueue_many([JobSpec(task="long") for _ in range(SENTINELS)])
        leases = {r.job.id: uuid.uuid4() for r in running}
        claimed = await store.mark_handed_off_many([Claim(j, h, "w") for j, h in leases.items()])
        assert len(claimed) == SENTINELS
        sentinels = {r.job.id for r in later} | set(leases)

        retention = asyncio.create_task(run_retention(store, settings, clock))
        samples: list[int] = []
        try:
            for n in range(TOTAL // BATCH):
                specs = [
                    JobSpec(task="t", args=[n, i], max_attempts=1 if i % 10 == 0 else 3)
                    for i in range(BATCH)
                ]
                made = await store.enqueue_many(specs)
                assert not any(r.duplicate for r in made)
                claims = [Claim(s.id, uuid.uuid4(), "w") for s in specs]
                got = await store.mark_handed_off_many(claims)
                assert len(got) == BATCH, "every job just enqueued is still there to claim"
                settle = [
                    Settlement(c.job_id, c.handoff_id, Outcome.FAIL, error="x")
                    if i % 10 == 0
                    else Settlement(c.job_id, c.handoff_id, Outcome.COMPLETE, result=i)
                    for i, c in enumerate(claims)
                    if i % 100 != 5
                ]
                assert all(await store.settle_many(settle)), "no handed-off job vanished"
                for c in claims[5::100]:
                    cancelled = await store.cancel(c.job_id)
                    assert cancelled is not None and cancelled.status is JobStatus.CANCELLED
                clock.advance(1)
                # Sustained load at the pace retention is configured for: one interval per
                # batch. Without it the test measures which task the event loop favours.
                await asyncio.sleep(settings.interval)
                rows = sum(c.count for c in await store.count_jobs())
                samples.append(rows)
                assert rows <= bound, f"batch {n}: {rows} rows, over the bound {bound}"
                if n % 10 == 0:
                    assert await _present(store, sentinels) == sentinels
        finally:
            retention.cancel()
            await asyncio.gather(retention, return_exceptions=True)
        await prune_once(store, settings, clock)
        counts = {c.status: c.count for c in await store.count_jobs() if c.queue == "default"}
        terminal = sum(n for s, n in counts.items() if s.is_terminal)
        assert terminal <= CAP
        assert counts.get(JobStatus.QUEUED) == SENTINELS
        assert counts.get(JobStatus.HANDED_OFF) == SENTINELS
        assert await _present(store, sentinels) == sentinels
        assert max(samples) > CAP, "the load did outrun a single pass now and then"
        logging.getLogger(__name__).warning(
            "bounded run on %s: max %d rows, mean %.0f, bound %d",
            backend,
            max(samples),
            sum(samples) / len(samples),
            bound,
        )
    finally:
        await store.close()
        if schema is not None:
            await drop_schema(schema)


async def _present(store: StorageAdapter, ids: set[uuid.UUID]) -> set[uuid.UUID]:
    found = set()
    for job_id in ids:
        job = await store.get_job(job_id)
        if job is not None and job.status.is_active:
            found.add(job_id)
    return found
