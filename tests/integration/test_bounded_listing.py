"""Bounded listings (issue 15, finding 4): ``list_jobs`` leaves payloads out unless asked,
pages by a byte budget as well as a count, and never holds the main's loop for long.

One ``list_jobs`` with ``limit`` 1000 over jobs with 1 MiB arguments used to load every
job whole, encode the reply, and halve the page until it fitted in a line: 1.65 GB and
a 15 s stall of the loop, long enough for the main to judge its workers silent. These
tests run a real main over TCP on a SQLite file and on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pytest

from adapters.memory import MemoryAdapter
from adapters.sql import SQLAlchemyAdapter
from broker.client.client import MAX_REPLY_BYTES, Client
from broker.jobs import Claim, Clock, Job, JobSpec
from broker.main.main import Main
from broker.main.settings import MainSettings
from broker.storage import JobFilter, JobPage, StorageAdapter
from broker.testing.conformance import CHECKS, Check, run_check
from broker.wire import codec
from broker.wire import framing as wire
from broker.wire import messages as protocol
from tests.conftest import POSTGRES_URL
from tests.integration.test_operator import _cli, _cli_json, _closed_port

T = TypeVar("T")

PAYLOAD = ("args", "kwargs", "result")
MiB = 1 << 20


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StorageAdapter]:
    if request.param == "sqlite":
        adapter = SQLAlchemyAdapter(f"sqlite+aiosqlite:///{tmp_path / 'listing.db'}")
        await adapter.setup()
        yield adapter
        await adapter.close()
        return
    adapter = SQLAlchemyAdapter(POSTGRES_URL, schema=request.getfixturevalue("pg_schema"))
    await adapter.setup()
    try:
        yield adapter
    finally:
        await adapter.close()


@contextlib.asynccontextmanager
async def _main(store: StorageAdapter, **overrides: Any) -> AsyncIterator[Main]:
    main = Main(store, MainSettings(port=0, **overrides), retention=None)
    await main.start()
    try:
        yield main
    finally:
        await main.stop()


async def _longest_stall(work: Awaitable[T]) -> tuple[T, float]:
    """``work``'s result and the most CPU the loop's thread spent between two of its turns
    meanwhile. The main runs on this loop, so that is the longest the main held it.

    CPU time of this thread, not the wall clock: on a loaded machine the scheduler may
    keep the whole process off a core for a second, which is no stall of the main's
    making (``make test-loaded`` runs this beside CPU spinners). A walk of a large
    listing on the loop costs its CPU whatever the load."""
    longest = 0.0
    done = asyncio.Event()

    async def tick() -> None:
        nonlocal longest
        last = time.thread_time()
        while not done.is_set():
            await asyncio.sleep(0.005)
            now = time.thread_time()
            longest = max(longest, now - last)
            last = now

    ticker = asyncio.create_task(tick())
    try:
        result = await work
    finally:
        done.set()
        await ticker
    return result, longest


class _RawClient:
    """A client connection that keeps each reply's line, to measure it."""

    def __init__(self, lines: wire.LineReader, out: wire.MessageWriter) -> None:
        self.lines = lines
        self.out = out

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, port: int) -> AsyncIterator[_RawClient]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=MAX_REPLY_BYTES + 2)
        lines = wire.LineReader(reader, max_line_bytes=MAX_REPLY_BYTES)
        out = wire.MessageWriter(writer)
        try:
            assert isinstance(await wire.read_message(lines), protocol.Challenge)
            await out.send(
                protocol.Hello(role=protocol.Role.CLIENT, protocol=protocol.PROTOCOL_VERSION)
            )
            assert isinstance(await wire.read_message(lines), protocol.Welcome)
            yield cls(lines, out)
        finally:
            out.abort()

    async def list_jobs(self, **fields: Any) -> tuple[protocol.JobList, int]:
        """One page and the length of the line it came in (its newline included)."""
        await self.out.send(protocol.ListJobs(request_id="r1", **fields))
        line = await asyncio.wait_for(self.lines.read_line(), 30)
        assert line is not None
        reply = codec.decode(line)
        assert isinstance(reply, protocol.JobList), reply
        return reply, len(line) + 1


async def _enqueue(store: StorageAdapter, specs: list[JobSpec]) -> list[Job]:
    return [r.job for r in await store.enqueue_many(specs)]


def _newest_first(jobs: list[Job]) -> list[uuid.UUID]:
    """Listing order: newest first, ties (one batch, one instant) broken by id."""
    return [j.id for j in sorted(jobs, key=lambda j: (j.created_at, j.id.bytes), reverse=True)]


# ------------------------------------------------------------------ (a) the stall is gone


async def test_one_listing_of_large_jobs_is_quick_small_and_never_stalls_the_loop(
    store: StorageAdapter,
) -> None:
    # 30 jobs of 1 MB arguments, ten per transaction. Half a million numbers each, so that
    # reading and writing them costs what real data would (about 50 ms a job, where a
    # string of 1 MB costs 2 ms): the old listing spent 1.5 s on them without a break.
    zeros = [0] * 500_000  # one list shared by every spec: little memory for the test
    made: list[Job] = []
    for _ in range(3):
        made += await _enqueue(
            store, [JobSpec(task="t", args=[zeros], kwargs={"n": i}) for i in range(10)]
        )
    async with _main(store) as main, Client("127.0.0.1", main.port) as client:
        page, stall = await _longest_stall(
            asyncio.wait_for(client.list_jobs(limit=1000), timeout=20)
        )
        order = _newest_first(made)
        assert [uuid.UUID(j["id"]) for j in page.jobs] == order
        assert page.next_cursor is None, "a summary of 30 jobs fits in one page"
        assert not [key for job in page.jobs for key in PAYLOAD if key in job], "no payload"
        assert stall < 1.0, f"the main's loop stalled for {stall:.2f} s"

        whole, stall = await _longest_stall(
            asyncio.wait_for(client.list_jobs(limit=1000, include_payload=True), timeout=20)
        )
        assert len(whole.jobs) == 1, "a 1 MiB budget holds one job of 1 MiB arguments"
        first = next(job for job in made if job.id == order[0])
        assert whole.jobs[0]["args"] == list(first.args) and whole.jobs[0]["kwargs"] == first.kwargs
        assert whole.next_cursor is not None
        assert stall < 1.0, f"the main's loop stalled for {stall:.2f} s"

        # The full job is still one request away.
        job = await client.get_job(made[0].id)
        assert job is not None and job["args"] == list(made[0].args)


# ------------------------------------------------------- (b) paging by bytes loses nothing


async def test_paging_with_payloads_returns_every_job_once_and_no_line_over_the_limit(
    store: StorageAdapter,
) -> None:
    # The 1 MiB payload limit and 2 MiB lines these sizes are chosen against.
    settings = {"list_page_bytes": 256 << 10, "max_payload_bytes": MiB, "max_line_bytes": 2 * MiB}
    small = await _enqueue(store, [JobSpec(task="small", args=[i]) for i in range(8)])
    large = await _enqueue(
        store, [JobSpec(task="large", args=[str(i) * 300_000]) for i in range(5)]
    )
    # Arguments and a result of 1 MiB each: alone over the 2 MiB line, so it is listed
    # without its payload (and marked) rather than blocking every later page.
    [huge] = await _enqueue(store, [JobSpec(task="huge", args=["a" * (MiB - 100)])])
    lease = uuid.uuid4()
    await store.mark_handed_off_many([Claim(huge.id, lease, "w")])
    assert await store.complete(huge.id, lease, "r" * (MiB - 100))
    more = await _enqueue(store, [JobSpec(task="small", args=[i]) for i in range(8, 12)])
    expected = {job.id: job for job in [*small, *large, huge, *more]}

    async with _main(store, **settings) as main, _RawClient.connect(main.port) as raw:
        max_line = main.settings.max_line_bytes
        seen: list[dict[str, Any]] = []
        lines: list[int] = []
        cursor: str | None = None

        async def follow_every_page() -> None:
            nonlocal cursor
            while True:
                page, size = await raw.list_jobs(limit=1000, cursor=cursor, include_payload=True)
                assert page.jobs, "every page makes progress"
                seen.extend(page.jobs)
                lines.append(size)
                if (cursor := page.next_cursor) is None:
                    return

        _, stall = await _longest_stall(follow_every_page())

    assert [uuid.UUID(j["id"]) for j in seen] == _newest_first(list(expected.values())), (
        "newest first, every job exactly once"
    )
    assert max(lines) <= max_line, f"a line of {max(lines)} bytes, over {max_line}"
    assert len(lines) >= 6, "five 300 KB jobs and the huge one cannot share 256 KiB pages"
    for job in seen:
        stored = expected[uuid.UUID(job["id"])]
        if stored.id == huge.id:
            assert job["payload_omitted"] is True and not set(PAYLOAD) & set(job)
        else:
            assert "payload_omitted" not in job
            assert job["args"] == list(stored.args) and job["kwargs"] == stored.kwargs
    assert stall < 1.0, f"the main's loop stalled for {stall:.2f} s"


async def test_summary_pages_split_by_the_byte_budget_lose_nothing() -> None:
    memory = MemoryAdapter()
    made = await _enqueue(memory, [JobSpec(task="t", args=[i]) for i in range(25)])
    ids: list[str] = []
    sizes: list[int] = []
    cursor: str | None = None
    async with _main(memory, list_page_bytes=2000) as main, _RawClient.connect(main.port) as raw:
        while True:
            page, size = await raw.list_jobs(limit=1000, cursor=cursor)
            assert page.jobs and not any(set(PAYLOAD) & set(job) for job in page.jobs)
            ids += [job["id"] for job in page.jobs]
            sizes.append(size)
            if (cursor := page.next_cursor) is None:
                break
    assert sorted(ids) == sorted(str(job.id) for job in made) and len(ids) == len(set(ids))
    assert len(sizes) > 5, "a 2000-byte budget holds a few summaries per page"
    assert max(sizes) < 2000 + 200, "the budget bounds the page, give or take the envelope"


def test_the_page_budget_is_a_positive_setting() -> None:
    assert MainSettings().list_page_bytes == MiB
    with pytest.raises(Exception, match="list_page_bytes must be positive"):
        MainSettings(list_page_bytes=0).validate()


# ------------------------------------------------------------- (c) the conformance checks


class _ListsEverythingWhole(MemoryAdapter):
    """An adapter that ignores ``include_payload``, as every adapter did before it."""

    async def list_jobs(
        self,
        job_filter: JobFilter | None = None,
        *,
        limit: int = 50,
        cursor: str | None = None,
        include_payload: bool = True,
    ) -> JobPage:
        return await super().list_jobs(job_filter, limit=limit, cursor=cursor)


class _CursorAtTheJob(MemoryAdapter):
    """An adapter whose ``cursor_after`` would repeat the job it names."""

    def cursor_after(self, job: Job) -> str:
        return super().cursor_after(replace(job, id=uuid.UUID(int=(job.id.int + 1) % 2**128)))


class _MemoryHarness:
    def __init__(self, kind: Callable[..., MemoryAdapter]) -> None:
        self.kind = kind

    async def open(self, clock: Clock) -> StorageAdapter:
        return self.kind(clock=clock)

    async def close(self) -> None:
        pass


def _check(name: str) -> Check:
    (found,) = (check for check in CHECKS if check.name == name)
    return found


@pytest.mark.parametrize(
    ("name", "broken"),
    [
        ("summary_listing_leaves_the_payload_out", _ListsEverythingWhole),
        ("cursor_after_continues_right_after_any_listed_job", _CursorAtTheJob),
    ],
)
async def test_the_conformance_checks_catch_an_adapter_that_breaks_them(
    name: str, broken: Callable[..., MemoryAdapter]
) -> None:
    """Every shipped store passes these checks (``tests/conformance``); here they are
    shown to fail on a store that breaks the rule, so they really check it."""
    await run_check(_check(name), _MemoryHarness(MemoryAdapter))
    with pytest.raises(AssertionError):
        await run_check(_check(name), _MemoryHarness(broken))


# --------------------------------------------------------------- (d) the operator's CLI


async def _store_with_a_finished_job(url: str) -> tuple[SQLAlchemyAdapter, Job]:
    store = SQLAlchemyAdapter(url)
    await store.setup()
    [job] = await _enqueue(store, [JobSpec(task="app.sum", args=[1, 2], kwargs={"k": "v"})])
    lease = uuid.uuid4()
    await store.mark_handed_off_many([Claim(job.id, lease, "w")])
    assert await store.complete(job.id, lease, {"total": 3})
    return store, job


def _assert_listings(summary: Any, whole: Any, job: Job) -> None:
    [listed] = summary["jobs"]
    assert listed["id"] == str(job.id) and not set(PAYLOAD) & set(listed)
    [listed] = whole["jobs"]
    assert (listed["args"], listed["kwargs"], listed["result"]) == (
        [1, 2],
        {"k": "v"},
        {"total": 3},
    )


async def test_broker_jobs_shows_payloads_only_with_the_flag(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'cli.db'}"
    store, job = await _store_with_a_finished_job(url)
    try:
        async with _main(store) as main:
            on_main = ("--main", f"127.0.0.1:{main.port}")
            _assert_listings(
                await _cli_json(*on_main, "jobs"),
                await _cli_json(*on_main, "jobs", "--with-payload"),
                job,
            )
            code, out, _ = await _cli(*on_main, "jobs")
            assert code == 0 and "app.sum" in out and "ARGS" not in out and "total" not in out
            code, out, _ = await _cli(*on_main, "jobs", "--with-payload")
            assert code == 0 and "ARGS" in out and json.dumps({"total": 3}) in out

        on_store = ("--main", f"127.0.0.1:{_closed_port()}", "--database-url", url)
        _assert_listings(
            await _cli_json(*on_store, "jobs"),
            await _cli_json(*on_store, "jobs", "--with-payload"),
            job,
        )
    finally:
        await store.close()


def test_the_listing_request_defaults_to_a_summary_and_old_peers_still_decode() -> None:
    """A peer that never heard of ``include_payload`` sends none: it gets a summary."""
    old = codec.decode('{"type":"list_jobs","request_id":"r1"}')
    assert isinstance(old, protocol.ListJobs) and old.include_payload is False
    asked = codec.decode('{"type":"list_jobs","request_id":"r1","include_payload":true}')
    assert isinstance(asked, protocol.ListJobs) and asked.include_payload is True
    with pytest.raises(codec.DecodeError, match="include_payload"):
        codec.decode('{"type":"list_jobs","request_id":"r1","include_payload":1}')
