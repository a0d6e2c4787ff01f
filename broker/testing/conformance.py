"""The behavioural conformance suite every storage adapter must pass.

It checks what the operations *do* (exact leases, fencing, idempotent returns,
races, ordering, pruning), not which methods exist. It imports no test framework:
give :func:`run_check` a :class:`StoreHarness` for your store and call it once per
entry of :data:`CHECKS`; a failed check raises ``AssertionError`` whose message starts
with the rule it enforces (``conformance rule 'enqueue defaults' is broken: ...``), a check that
needs a capability your adapter does not declare raises :class:`CheckSkipped`.
``docs/adapters.md`` shows the few lines that wire it into pytest.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol, runtime_checkable

from broker.exceptions import (
    DeposedError,
    IdempotencyConflictError,
    InvalidJobError,
    StorageError,
    UniqueKeyTakenError,
)
from broker.jobs import (
    CheckpointSave,
    Claim,
    Clock,
    ExecutionMode,
    Job,
    JobSpec,
    JobStatus,
    JSONValue,
    Outcome,
    ParentFailure,
    ParentResults,
    ProgressUpdate,
    Settlement,
    SpecColumns,
)
from broker.model.rates import Rate
from broker.storage import (
    INTEGRITY_ERROR,
    JobFilter,
    PayloadIntegrityError,
    QueueSettings,
    StorageAdapter,
    SupportsEnqueueColumns,
    SupportsEnqueueHandedOff,
    SupportsLeadership,
    SupportsNotify,
    SupportsOffload,
    SupportsQueueSettings,
    SupportsWorkflows,
)
from broker.testing import FakeClock
from broker.testing.faults import ClaimFault, FaultyAdapter

WORKER = "worker-a"
ALL_MODES = frozenset(ExecutionMode)


class StoreHarness(Protocol):
    """One fresh, empty store, opened as many times as a check needs."""

    async def open(self, clock: Clock) -> StorageAdapter:
        """A new, set-up handle on this harness's store.

        Called more than once for checks that race several handles (for a SQL store
        each call should create its own engine, as another process would).
        """

    async def close(self) -> None:
        """Close every handle and remove the store."""


@runtime_checkable
class TampersPayloads(Protocol):
    """Optional, for a harness whose store offloads: edit one stored value behind the
    store's back, as a hand edit of the store (or a corrupted disk) would. The checks of
    payload integrity run only on a harness that offers it."""

    async def tamper_payload(
        self, job_id: uuid.UUID, kind: str, edit: Callable[[str], str], *, rehash: bool = False
    ) -> None:
        """Replace the stored text of job ``job_id``'s offloaded ``kind`` (``args``,
        ``kwargs``, ``result`` or ``checkpoint``) by ``edit(text)``; its stored SHA-256
        is kept, or with ``rehash`` replaced by the new text's (an edit that forged it)."""


class CheckSkipped(Exception):
    """The adapter does not declare a capability this check needs."""


@dataclass
class Context:
    """What a check receives: the store under test, a clock it controls, and peers."""

    harness: StoreHarness
    clock: FakeClock
    store: StorageAdapter
    _peers: list[StorageAdapter] = field(default_factory=list)

    async def peer(self) -> StorageAdapter:
        """Another handle on the same store, as a second process would have."""
        handle = await self.harness.open(self.clock)
        self._peers.append(handle)
        return handle

    def require(self, capability: str) -> None:
        if not getattr(self.store.capabilities, capability):
            raise CheckSkipped(f"adapter does not declare the {capability!r} capability")


CheckFn = Callable[[Context], Awaitable[None]]


@dataclass(frozen=True)
class Check:
    name: str
    run: CheckFn

    @property
    def rule(self) -> str:
        """The rule the check enforces, in words: its docstring's first line, else its name."""
        doc = (self.run.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else self.name.replace("_", " ")


CHECKS: list[Check] = []


def _check(fn: CheckFn) -> CheckFn:
    CHECKS.append(Check(fn.__name__.removeprefix("check_"), fn))
    return fn


START = datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)


async def run_check(check: Check, harness: StoreHarness) -> None:
    """Run one check on a fresh store; closes every handle it opened."""
    clock = FakeClock(START)
    store = await harness.open(clock)
    ctx = Context(harness=harness, clock=clock, store=store)
    try:
        await check.run(ctx)
    except AssertionError as exc:
        # The rule in words, whatever runs the check (a test id names it only under pytest).
        detail = str(exc) or "a condition of the rule does not hold"
        raise AssertionError(f"conformance rule {check.rule!r} is broken: {detail}") from exc
    finally:
        for handle in [*ctx._peers, store]:
            await handle.close()
        await harness.close()


def _spec(task: str = "tests.noop", **kw: object) -> JobSpec:
    return JobSpec(task=task, **kw)  # type: ignore[arg-type]


async def _enqueue(store: StorageAdapter, task: str = "tests.noop", **kw: object) -> Job:
    result = await store.enqueue(_spec(task, **kw))
    assert not result.duplicate
    return result.job


async def _claim(store: StorageAdapter, job: Job, worker: str = WORKER) -> Job:
    lease = uuid.uuid4()
    claimed = await store.mark_handed_off(job.id, lease, worker)
    assert claimed is not None, "a queued, due job must be claimable"
    assert claimed.handoff_id == lease
    return claimed


async def _get(store: StorageAdapter, job_id: uuid.UUID) -> Job:
    job = await store.get_job(job_id)
    assert job is not None, f"job {job_id} vanished"
    return job


# --- enqueue and the job row -------------------------------------------------------


TRACE_CONTEXT = {
    "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "tracestate": "vendor=é✓",
}
"""A job's W3C trace context, as a client's enqueue inside a span gives it one."""


@_check
async def check_enqueue_round_trips_every_field(ctx: Context) -> None:
    run_at = START + timedelta(seconds=30, microseconds=123456)
    spec = JobSpec(
        task="app.tasks.send_email",
        args=[1, "two", {"three": [3.5, None, True]}],
        kwargs={"to": "a@example.com", "nested": {"k": [1, 2]}, "unicode": "é✓"},
        queue="mail",
        priority=7,
        run_at=run_at,
        max_attempts=4,
        idempotency_key="mail-1",
        concurrency_key="account-9",
        concurrency_limit=2,
        timeout=12.5,
        execution_mode=ExecutionMode.FORKED,
        unique_key="mail:a@example.com",
        trace_context=TRACE_CONTEXT,
    )
    result = await ctx.store.enqueue(spec)
    assert result.duplicate is False
    for job in (result.job, await _get(ctx.store, spec.id)):
        assert job.id == spec.id
        assert job.task == "app.tasks.send_email"
        assert list(job.args) == [1, "two", {"three": [3.5, None, True]}]
        assert job.kwargs == {"to": "a@example.com", "nested": {"k": [1, 2]}, "unicode": "é✓"}
        assert job.queue == "mail"
        assert job.priority == 7
        assert job.status is JobStatus.QUEUED
        assert job.attempts == 0
        assert job.max_attempts == 4
        assert job.run_at == run_at
        assert job.created_at == START and job.updated_at == START
        assert job.execution_mode is ExecutionMode.FORKED
        assert job.handoff_id is None and job.worker_id is None and job.handed_off_at is None
        assert job.last_error is None and job.result is None
        assert job.idempotency_key == "mail-1"
        assert job.concurrency_key == "account-9" and job.concurrency_limit == 2
        assert job.timeout == 12.5
        assert job.unique_key == "mail:a@example.com"
        assert job.trace_context == TRACE_CONTEXT
    claimed = await _claim(ctx.store, await _enqueue(ctx.store, trace_context=TRACE_CONTEXT))
    assert claimed.trace_context == TRACE_CONTEXT, "the claim hands the context to the worker"


@_check
async def check_enqueue_defaults(ctx: Context) -> None:
    job = await _enqueue(ctx.store)
    assert job.unique_key is None
    assert job.queue == "default"
    assert job.priority == 0
    assert job.execution_mode is ExecutionMode.POOLED
    assert job.max_attempts == 11
    assert job.run_at == START


@_check
async def check_enqueue_many_is_ordered_and_complete(ctx: Context) -> None:
    specs = [_spec(args=[i]) for i in range(25)]
    results = await ctx.store.enqueue_many(specs)
    assert [r.job.id for r in results] == [s.id for s in specs]
    assert not any(r.duplicate for r in results)
    page = await ctx.store.list_jobs(limit=100)
    assert {j.id for j in page.jobs} == {s.id for s in specs}


@_check
async def check_idempotency_key_returns_the_existing_job(ctx: Context) -> None:
    first = await ctx.store.enqueue(_spec(idempotency_key="k1", args=[1]))
    # A faithful repeat: a fresh id and a later run_at (a delay resolved again) are the
    # same request.
    again = await ctx.store.enqueue(
        _spec(idempotency_key="k1", args=[1], run_at=START + timedelta(seconds=5))
    )
    assert first.duplicate is False
    assert again.duplicate is True
    assert again.job.id == first.job.id
    assert list(again.job.args) == [1]
    claimed = await _claim(ctx.store, first.job)
    assert await ctx.store.complete(claimed.id, claimed.handoff_id or uuid.uuid4())
    after_completion = await ctx.store.enqueue(_spec(idempotency_key="k1", args=[1]))
    assert after_completion.duplicate is True, "a key stays taken while its job is stored"
    assert after_completion.job.id == first.job.id
    batch = await ctx.store.enqueue_many([_spec(idempotency_key="k2"), _spec(idempotency_key="k2")])
    assert [r.duplicate for r in batch] == [False, True]
    assert batch[0].job.id == batch[1].job.id
    page = await ctx.store.list_jobs(limit=10)
    assert len(page.jobs) == 2


@_check
async def check_idempotency_key_with_another_request_is_refused(ctx: Context) -> None:
    """A different task, arguments or options under a taken idempotency key raises
    IdempotencyConflictError with the holder's id, and stores nothing of its batch."""
    first = await ctx.store.enqueue(_spec(idempotency_key="k", args=[1], kwargs={"a": 1}))
    differs: list[dict[str, Any]] = [
        {"args": [2]},
        {"kwargs": {"a": 2}},
        {"task": "tests.other"},
        {"queue": "mail"},
        {"max_attempts": 1},
        {"priority": 5},
    ]
    for differ in differs:
        request = replace(_spec(idempotency_key="k", args=[1], kwargs={"a": 1}), **differ)
        try:
            await ctx.store.enqueue(request)
        except IdempotencyConflictError as exc:
            assert exc.existing_id == first.job.id, "the error names the job holding the key"
        else:
            raise AssertionError(f"a repeat with {differ} under a taken key was accepted")
        try:
            await ctx.store.enqueue_many([_spec(args=[9]), replace(request, id=uuid.uuid4())])
        except IdempotencyConflictError:
            pass
        else:
            raise AssertionError(f"a batch repeating the key with {differ} was accepted")
    try:
        await ctx.store.enqueue_many(
            [_spec(idempotency_key="b", args=[1]), _spec(idempotency_key="b", args=[2])]
        )
    except IdempotencyConflictError:
        pass
    else:
        raise AssertionError("one batch with one key for two different jobs was accepted")
    page = await ctx.store.list_jobs(limit=10)
    assert [j.id for j in page.jobs] == [first.job.id], "a refused batch stores nothing"
    same = await ctx.store.enqueue(_spec(idempotency_key="k", args=[1], kwargs={"a": 1}))
    assert same.duplicate and same.job.id == first.job.id


@_check
async def check_task_catalog_keeps_each_workers_latest_declaration(ctx: Context) -> None:
    """The task catalog keeps one row per task and worker, the latest declaration and
    when it was seen; a worker's new declaration replaces its earlier one whole (a task
    it stops declaring goes), and leaves other workers' rows alone."""
    assert await ctx.store.task_catalog() == []
    later = START + timedelta(seconds=1)
    await ctx.store.declare_tasks(
        "w1", {"app.a": {"queue": "q", "max_attempts": 1}, "app.b": {"unique": True}}, START
    )
    await ctx.store.declare_tasks(
        "w2", {"app.a": {"queue": "r", "nested": [1, {"x": None}]}, "app.c": {}}, START
    )
    await ctx.store.declare_tasks("w1", {"app.a": {"queue": "q2"}}, later)
    records = await ctx.store.task_catalog()
    assert [(r.task, r.worker_id) for r in records] == [
        ("app.a", "w1"),
        ("app.a", "w2"),
        ("app.c", "w2"),
    ], "ordered by task, then worker id; w1's app.b is gone with its new declaration"
    assert (records[0].declaration, records[0].seen_at) == ({"queue": "q2"}, later)
    assert records[1].declaration == {"queue": "r", "nested": [1, {"x": None}]}
    assert records[2].seen_at == START
    if ctx.store.capabilities.shared_between_processes:
        other = await ctx.peer()
        assert await other.task_catalog() == records


@_check
async def check_task_catalog_reads_are_bounded(ctx: Context) -> None:
    """Reading the task catalog takes only the names asked for, or at most a limit of
    rows (the most recently seen): the main's start-up and its unknown-name check never
    read a catalog whole."""
    for i in range(5):
        await ctx.store.declare_tasks(
            f"w{i}", {"app.a": {"n": i}, f"app.only{i}": {}}, START + timedelta(seconds=i)
        )
    named = await ctx.store.task_catalog(tasks=["app.only3", "app.missing"])
    assert [(r.task, r.worker_id) for r in named] == [("app.only3", "w3")]
    newest = await ctx.store.task_catalog(limit=4)
    assert [(r.task, r.worker_id) for r in newest] == [
        ("app.a", "w3"),
        ("app.a", "w4"),
        ("app.only3", "w3"),
        ("app.only4", "w4"),
    ], "the 4 most recently seen, ordered by task then worker id"
    assert len(await ctx.store.task_catalog(tasks=["app.a"], limit=2)) == 2


@_check
async def check_forget_tasks_drops_workers_gone_for_the_grace(ctx: Context) -> None:
    """Forgetting gone workers marks the live workers' rows seen now, then deletes every
    row last seen before the cutoff: a worker connected all along keeps its declaration."""
    await ctx.store.declare_tasks("gone", {"app.a": {}, "app.b": {}}, START)
    await ctx.store.declare_tasks("live", {"app.a": {}}, START)
    await ctx.store.declare_tasks("recent", {"app.c": {}}, START + timedelta(hours=2))
    now = START + timedelta(hours=3)
    deleted = await ctx.store.forget_tasks(["live", "absent"], now, START + timedelta(hours=1))
    assert deleted == 2
    records = await ctx.store.task_catalog()
    assert [(r.task, r.worker_id, r.seen_at) for r in records] == [
        ("app.a", "live", now),
        ("app.c", "recent", START + timedelta(hours=2)),
    ]
    assert await ctx.store.forget_tasks([], now, START) == 0


@_check
async def check_idempotent_enqueue_under_concurrency(ctx: Context) -> None:
    handles = [ctx.store, *[await ctx.peer() for _ in range(3)]]
    results = await asyncio.gather(
        *(handles[i % len(handles)].enqueue(_spec(idempotency_key="race")) for i in range(24))
    )
    ids = {r.job.id for r in results}
    assert len(ids) == 1, f"one key must make one job, got {len(ids)}"
    assert sum(not r.duplicate for r in results) == 1
    page = await ctx.store.list_jobs(limit=50)
    assert len(page.jobs) == 1


# --- unique keys -------------------------------------------------------------------


@_check
async def check_unique_key_allows_one_active_job(ctx: Context) -> None:
    first = await ctx.store.enqueue(_spec(unique_key="u1", args=[1]))
    assert first.duplicate is False
    again = await ctx.store.enqueue(_spec(unique_key="u1", args=[2]))
    assert again.duplicate is True and again.job.id == first.job.id, "queued: returned"
    assert list(again.job.args) == [1]
    other = await ctx.store.enqueue(_spec(unique_key="u2"))
    assert other.duplicate is False, "another key is independent"
    running = await _claim(ctx.store, first.job)
    while_running = await ctx.store.enqueue(_spec(unique_key="u1"))
    assert while_running.duplicate is True and while_running.job.id == first.job.id
    assert while_running.job.status is JobStatus.HANDED_OFF
    assert running.handoff_id is not None
    assert await ctx.store.fail(running.id, running.handoff_id, "x", START), "retry: queued"
    assert (await ctx.store.enqueue(_spec(unique_key="u1"))).job.id == first.job.id
    retried = await _claim(ctx.store, await _get(ctx.store, first.job.id))
    assert await ctx.store.complete(retried.id, retried.handoff_id or uuid.uuid4())
    after = await ctx.store.enqueue(_spec(unique_key="u1", args=[3]))
    assert after.duplicate is False, "once the holder is terminal a new job may be enqueued"
    assert after.job.id != first.job.id and after.job.unique_key == "u1"
    assert (await _get(ctx.store, first.job.id)).unique_key == "u1", "the old job keeps its key"
    cancelled = await ctx.store.cancel(after.job.id)
    assert cancelled is not None and cancelled.status is JobStatus.CANCELLED
    dead = await _claim(ctx.store, await _enqueue(ctx.store, unique_key="u1", max_attempts=1))
    assert await ctx.store.fail(dead.id, dead.handoff_id or uuid.uuid4(), "fatal", None)
    assert (await ctx.store.enqueue(_spec(unique_key="u1"))).duplicate is False
    active = await ctx.store.list_jobs(
        JobFilter(statuses=[JobStatus.QUEUED, JobStatus.HANDED_OFF]), limit=50
    )
    assert sum(j.unique_key == "u1" for j in active.jobs) == 1


@_check
async def check_unique_key_in_one_batch_and_with_idempotency_keys(ctx: Context) -> None:
    batch = await ctx.store.enqueue_many(
        [_spec(unique_key="b", args=[0]), _spec(args=[1]), _spec(unique_key="b", args=[2])]
    )
    assert [r.duplicate for r in batch] == [False, False, True]
    assert batch[2].job.id == batch[0].job.id
    # A unique-key duplicate stores nothing, so its idempotency key stays free.
    blocked = await ctx.store.enqueue(_spec(unique_key="b", idempotency_key="idem-1"))
    assert blocked.duplicate is True and blocked.job.id == batch[0].job.id
    claimed = await _claim(ctx.store, batch[0].job)
    assert await ctx.store.complete(claimed.id, claimed.handoff_id or uuid.uuid4())
    made = await ctx.store.enqueue(_spec(unique_key="b", idempotency_key="idem-1"))
    assert made.duplicate is False and made.job.idempotency_key == "idem-1"
    # The idempotency key is checked first: it returns its own job, even a finished one.
    keyed = await _claim(ctx.store, made.job)
    assert await ctx.store.complete(keyed.id, keyed.handoff_id or uuid.uuid4())
    fresh = await ctx.store.enqueue(_spec(unique_key="b"))
    assert fresh.duplicate is False
    repeat = await ctx.store.enqueue(_spec(unique_key="b", idempotency_key="idem-1"))
    assert repeat.duplicate is True and repeat.job.id == made.job.id
    page = await ctx.store.list_jobs(limit=50)
    assert len(page.jobs) == 4


@_check
async def check_unique_enqueue_under_concurrency(ctx: Context) -> None:
    handles = [ctx.store, *[await ctx.peer() for _ in range(3)]]
    for round_ in range(2):
        results = await asyncio.gather(
            *(
                handles[i % len(handles)].enqueue(_spec(unique_key="race", args=[i]))
                for i in range(24)
            )
        )
        ids = {r.job.id for r in results}
        assert len(ids) == 1, f"one unique key must make one active job, got {len(ids)}"
        assert sum(not r.duplicate for r in results) == 1
        batches = await asyncio.gather(
            *(h.enqueue_many([_spec(unique_key="race"), _spec(unique_key="race")]) for h in handles)
        )
        assert {r.job.id for b in batches for r in b} == ids
        assert all(r.duplicate for b in batches for r in b)
        page = await ctx.store.list_jobs(limit=100)
        assert len(page.jobs) == round_ + 1
        holder = await _claim(ctx.store, results[0].job)
        assert await ctx.store.complete(holder.id, holder.handoff_id or uuid.uuid4())


@_check
async def check_retry_dead_refuses_while_the_unique_key_is_held(ctx: Context) -> None:
    dead = await _claim(ctx.store, await _enqueue(ctx.store, unique_key="acct", max_attempts=1))
    assert await ctx.store.fail(dead.id, dead.handoff_id or uuid.uuid4(), "fatal", None)
    holder = await _enqueue(ctx.store, unique_key="acct")
    try:
        await ctx.store.retry_dead(dead.id)
    except UniqueKeyTakenError as exc:
        assert exc.holder_id in (None, holder.id), "holder_id names the holder when known"
    else:
        raise AssertionError("retry_dead must refuse while another job holds the unique key")
    unchanged = await _get(ctx.store, dead.id)
    assert unchanged.status is JobStatus.FAILED and unchanged.attempts == 1
    running = await _claim(ctx.store, holder)
    assert await ctx.store.complete(running.id, running.handoff_id or uuid.uuid4())
    revived = await ctx.store.retry_dead(dead.id)
    assert revived is not None and revived.status is JobStatus.QUEUED
    assert revived.unique_key == "acct"
    again = await ctx.store.enqueue(_spec(unique_key="acct"))
    assert again.duplicate is True and again.job.id == dead.id, "the revived job holds the key"


# --- claims and exact leases ------------------------------------------------------


@_check
async def check_claim_persists_the_exact_supplied_lease(ctx: Context) -> None:
    job = await _enqueue(ctx.store)
    lease = uuid.uuid4()
    ctx.clock.advance(5)
    claimed = await ctx.store.mark_handed_off(job.id, lease, "worker-7")
    assert claimed is not None
    assert claimed.handoff_id == lease
    assert claimed.status is JobStatus.HANDED_OFF
    assert claimed.worker_id == "worker-7"
    assert claimed.handed_off_at == START + timedelta(seconds=5)
    stored = await _get(ctx.store, job.id)
    assert stored.handoff_id == lease and stored.status is JobStatus.HANDED_OFF
    assert stored.worker_id == "worker-7"


@_check
async def check_only_queued_due_jobs_are_claimable(ctx: Context) -> None:
    job = await _enqueue(ctx.store)
    first = await _claim(ctx.store, job)
    assert await ctx.store.mark_handed_off(job.id, uuid.uuid4(), WORKER) is None
    assert (await _get(ctx.store, job.id)).handoff_id == first.handoff_id
    later = await _enqueue(ctx.store, run_at=START + timedelta(minutes=5))
    assert await ctx.store.mark_handed_off(later.id, uuid.uuid4(), WORKER) is None
    ctx.clock.advance(300)
    assert await ctx.store.mark_handed_off(later.id, uuid.uuid4(), WORKER) is not None
    assert await ctx.store.mark_handed_off(uuid.uuid4(), uuid.uuid4(), WORKER) is None


@_check
async def check_batch_claim_gives_each_job_its_own_lease(ctx: Context) -> None:
    jobs = [await _enqueue(ctx.store, args=[i]) for i in range(6)]
    taken = await _claim(ctx.store, jobs[0])
    claims = [Claim(job.id, uuid.uuid4(), WORKER) for job in jobs]
    claims.append(Claim(jobs[3].id, uuid.uuid4(), WORKER))
    claimed = await ctx.store.mark_handed_off_many(claims)
    by_id = {job.id: job for job in claimed}
    assert jobs[0].id not in by_id, "a handed-off job is not claimed again"
    assert set(by_id) == {job.id for job in jobs[1:]}
    wanted = {c.handoff_id for c in claims}
    for job in claimed:
        assert job.handoff_id in wanted
        assert job.status is JobStatus.HANDED_OFF
        assert (await _get(ctx.store, job.id)).handoff_id == job.handoff_id
    assert (await _get(ctx.store, jobs[0].id)).handoff_id == taken.handoff_id
    assert await ctx.store.mark_handed_off_many([]) == []


@_check
async def check_concurrent_claimers_of_one_job_have_one_winner(ctx: Context) -> None:
    job = await _enqueue(ctx.store)
    handles = [ctx.store, *[await ctx.peer() for _ in range(3)]]
    leases = [uuid.uuid4() for _ in range(16)]
    results = await asyncio.gather(
        *(
            handles[i % len(handles)].mark_handed_off(job.id, lease, f"w{i}")
            for i, lease in enumerate(leases)
        )
    )
    winners = [r for r in results if r is not None]
    assert len(winners) == 1, f"exactly one claimer may win, {len(winners)} did"
    stored = await _get(ctx.store, job.id)
    assert stored.handoff_id == winners[0].handoff_id


@_check
async def check_overlapping_batch_claims_hand_each_job_out_once(ctx: Context) -> None:
    jobs = [await _enqueue(ctx.store, args=[i]) for i in range(30)]
    handles = [ctx.store, *[await ctx.peer() for _ in range(2)]]

    async def grab(handle: StorageAdapter, worker: str) -> list[Job]:
        return await handle.mark_handed_off_many(
            [Claim(job.id, uuid.uuid4(), worker) for job in jobs]
        )

    results = await asyncio.gather(*(grab(h, f"w{i}") for i, h in enumerate(handles)))
    claimed = [job for batch in results for job in batch]
    assert sorted(j.id for j in claimed) == sorted(j.id for j in jobs)
    for job in claimed:
        assert (await _get(ctx.store, job.id)).handoff_id == job.handoff_id


# --- fenced reports --------------------------------------------------------------


@_check
async def check_complete_is_fenced_by_lease(ctx: Context) -> None:
    job = await _claim(ctx.store, await _enqueue(ctx.store))
    lease = job.handoff_id
    assert lease is not None
    assert await ctx.store.complete(job.id, uuid.uuid4(), {"stale": True}) is False
    unchanged = await _get(ctx.store, job.id)
    assert unchanged.status is JobStatus.HANDED_OFF and unchanged.result is None
    ctx.clock.advance(1)
    assert await ctx.store.complete(job.id, lease, {"ok": [1, 2]}) is True
    done = await _get(ctx.store, job.id)
    assert done.status is JobStatus.COMPLETED
    assert done.result == {"ok": [1, 2]}
    assert done.updated_at == START + timedelta(seconds=1)
    assert done.handoff_id == lease, "the row keeps its last lease so repeats can be told apart"
    assert await ctx.store.complete(job.id, lease, {"again": True}) is False
    assert (await _get(ctx.store, job.id)).result == {"ok": [1, 2]}
    assert await ctx.store.fail(job.id, lease, "late", None) is False
    assert await ctx.store.return_to_queue(job.id, lease) is False
    assert (await _get(ctx.store, job.id)).status is JobStatus.COMPLETED


@_check
async def check_fail_retries_then_dies(ctx: Context) -> None:
    job = await _claim(ctx.store, await _enqueue(ctx.store, max_attempts=2))
    assert job.handoff_id is not None
    assert await ctx.store.fail(job.id, uuid.uuid4(), "stale", START) is False
    assert (await _get(ctx.store, job.id)).attempts == 0
    retry_at = START + timedelta(seconds=10)
    assert await ctx.store.fail(job.id, job.handoff_id, "boom 1", retry_at) is True
    queued = await _get(ctx.store, job.id)
    assert queued.status is JobStatus.QUEUED
    assert queued.attempts == 1 and queued.last_error == "boom 1"
    assert queued.run_at == retry_at
    assert await ctx.store.fail(job.id, job.handoff_id, "repeat", retry_at) is False
    assert (await _get(ctx.store, job.id)).attempts == 1
    assert await ctx.store.mark_handed_off(job.id, uuid.uuid4(), WORKER) is None, "not due yet"
    ctx.clock.advance(10)
    second = await _claim(ctx.store, queued)
    assert second.handoff_id is not None
    assert await ctx.store.fail(second.id, second.handoff_id, "boom 2", None) is True
    dead = await _get(ctx.store, job.id)
    assert dead.status is JobStatus.FAILED
    assert dead.attempts == 2 and dead.last_error == "boom 2"


@_check
async def check_reschedule_does_not_count_an_attempt(ctx: Context) -> None:
    job = await _claim(ctx.store, await _enqueue(ctx.store))
    assert job.handoff_id is not None
    later = START + timedelta(minutes=2)
    assert await ctx.store.reschedule(job.id, uuid.uuid4(), later) is False
    assert await ctx.store.reschedule(job.id, job.handoff_id, later) is True
    stored = await _get(ctx.store, job.id)
    assert stored.status is JobStatus.QUEUED
    assert stored.attempts == 0 and stored.run_at == later
    assert await ctx.store.reschedule(job.id, job.handoff_id, later) is False


@_check
async def check_return_to_queue_is_exact_and_idempotent(ctx: Context) -> None:
    job = await _claim(ctx.store, await _enqueue(ctx.store))
    first = job.handoff_id
    assert first is not None
    assert await ctx.store.return_to_queue(job.id, uuid.uuid4()) is False
    assert (await _get(ctx.store, job.id)).status is JobStatus.HANDED_OFF
    assert await ctx.store.return_to_queue(job.id, first) is True
    returned = await _get(ctx.store, job.id)
    assert returned.status is JobStatus.QUEUED and returned.attempts == 0
    assert await ctx.store.return_to_queue(job.id, first) is False
    newer = await _claim(ctx.store, returned)
    assert await ctx.store.return_to_queue(job.id, first) is False, "a newer lease stays"
    current = await _get(ctx.store, job.id)
    assert current.status is JobStatus.HANDED_OFF and current.handoff_id == newer.handoff_id
    assert await ctx.store.return_to_queue(uuid.uuid4(), first) is False


@_check
async def check_a_lost_attempt_counts_a_recovery_fenced_in_its_move(ctx: Context) -> None:
    """``LOST``: one more ``recoveries`` (never ``attempts``), queued at its time with
    its state holder, or dead with its error; only under the current lease; a claim
    clears the holder and an operator's retry zeroes the count."""
    job = await _claim(ctx.store, await _enqueue(ctx.store))
    lease = job.handoff_id
    assert lease is not None
    lost = Settlement(job.id, lease, Outcome.LOST, error="lost", run_at=START, state_holder="w")
    stale = replace(lost, handoff_id=uuid.uuid4())
    assert await ctx.store.settle_many([stale]) == [False]
    assert (await _get(ctx.store, job.id)).recoveries == 0, "a stale lease counts nothing"
    assert await ctx.store.settle_many([lost]) == [True]
    assert await ctx.store.settle_many([lost]) == [False], "counted once"
    queued = await _get(ctx.store, job.id)
    assert queued.status is JobStatus.QUEUED and queued.run_at == START
    assert (queued.recoveries, queued.attempts) == (1, 0)
    assert queued.state_holder == "w" and queued.last_error == "lost"
    again = await _claim(ctx.store, queued)
    assert again.state_holder is None and (await _get(ctx.store, job.id)).state_holder is None
    assert again.handoff_id is not None
    dead = Settlement(job.id, again.handoff_id, Outcome.LOST, error="limit", run_at=None)
    assert await ctx.store.settle_many([dead]) == [True]
    stored = await _get(ctx.store, job.id)
    assert stored.status is JobStatus.FAILED and stored.last_error == "limit"
    assert (stored.recoveries, stored.attempts) == (2, 0)
    revived = await ctx.store.retry_dead(job.id)
    assert revived is not None and revived.recoveries == 0


@_check
async def check_settle_many_fences_each_move_and_commits_together(ctx: Context) -> None:
    jobs = [await _claim(ctx.store, await _enqueue(ctx.store, args=[i])) for i in range(5)]
    leases = [j.handoff_id or uuid.uuid4() for j in jobs]
    later = START + timedelta(minutes=1)
    settlements = [
        Settlement(jobs[0].id, leases[0], Outcome.COMPLETE, result={"n": 0}),
        Settlement(jobs[1].id, uuid.uuid4(), Outcome.COMPLETE, result="stale"),
        Settlement(jobs[2].id, leases[2], Outcome.FAIL, error="e", run_at=later),
        Settlement(jobs[3].id, leases[3], Outcome.RESCHEDULE, run_at=later),
        Settlement(jobs[4].id, leases[4], Outcome.RETURN),
        Settlement(jobs[0].id, leases[0], Outcome.FAIL, error="repeat", run_at=None),
    ]
    assert await ctx.store.settle_many(settlements) == [True, False, True, True, True, False]
    after = [await _get(ctx.store, j.id) for j in jobs]
    assert after[0].status is JobStatus.COMPLETED and after[0].result == {"n": 0}
    assert after[1].status is JobStatus.HANDED_OFF
    assert after[2].status is JobStatus.QUEUED and after[2].attempts == 1
    assert after[2].run_at == later and after[2].last_error == "e"
    assert after[3].status is JobStatus.QUEUED and after[3].attempts == 0
    assert after[3].run_at == later
    assert after[4].status is JobStatus.QUEUED and after[4].run_at == START
    assert await ctx.store.settle_many([]) == []


@_check
async def check_settle_many_gives_back_every_concurrency_slot(ctx: Context) -> None:
    held = [
        await _claim(ctx.store, await _enqueue(ctx.store, concurrency_key="k", concurrency_limit=3))
        for _ in range(3)
    ]
    waiting = await _enqueue(ctx.store, concurrency_key="k", concurrency_limit=3)
    assert await ctx.store.mark_handed_off(waiting.id, uuid.uuid4(), WORKER) is None
    moves = [Settlement(j.id, j.handoff_id or uuid.uuid4(), Outcome.COMPLETE) for j in held[:2]] + [
        Settlement(held[2].id, uuid.uuid4(), Outcome.COMPLETE)
    ]
    assert await ctx.store.settle_many(moves) == [True, True, False]
    more = [await _enqueue(ctx.store, concurrency_key="k", concurrency_limit=3) for _ in range(2)]
    claims = [await ctx.store.mark_handed_off(j.id, uuid.uuid4(), WORKER) for j in [waiting, *more]]
    assert sum(c is not None for c in claims) == 2, "two slots came back, not more or fewer"


@_check
async def check_a_repeated_batch_at_the_same_instant_is_fenced(ctx: Context) -> None:
    held = [
        await _claim(ctx.store, await _enqueue(ctx.store, concurrency_key="r", concurrency_limit=5))
        for _ in range(5)
    ]
    moves = [Settlement(j.id, j.handoff_id or uuid.uuid4(), Outcome.COMPLETE) for j in held]
    assert await ctx.store.settle_many(moves[:3]) == [True, True, True]
    assert await ctx.store.settle_many(moves) == [False, False, False, True, True]
    extra = [await _enqueue(ctx.store, concurrency_key="r", concurrency_limit=5) for _ in range(6)]
    claims = [await ctx.store.mark_handed_off(j.id, uuid.uuid4(), WORKER) for j in extra]
    assert sum(c is not None for c in claims) == 5, "each slot was given back exactly once"


@_check
async def check_settle_batches_committing_at_once_apply_each_move_once(ctx: Context) -> None:
    """Two settle batches committing at once apply each move once, each slot back once.

    Every method of a store is safe to call concurrently: two batches at once, sharing a
    concurrency key and one resent copy of a report, are fenced and counted as one
    after the other would be."""
    held = [
        await _claim(ctx.store, await _enqueue(ctx.store, concurrency_key="p", concurrency_limit=6))
        for _ in range(6)
    ]
    moves = [Settlement(j.id, j.handoff_id or uuid.uuid4(), Outcome.COMPLETE) for j in held]
    first, second = moves[:4], [moves[3], *moves[4:]]
    answers = await asyncio.gather(ctx.store.settle_many(first), ctx.store.settle_many(second))
    assert answers[0][:3] == [True] * 3 and answers[1][1:] == [True] * 2
    assert [answers[0][3], answers[1][0]].count(True) == 1, "the resent copy applied once"
    assert {(await _get(ctx.store, j.id)).status for j in held} == {JobStatus.COMPLETED}
    extra = [await _enqueue(ctx.store, concurrency_key="p", concurrency_limit=6) for _ in range(7)]
    claims = [await ctx.store.mark_handed_off(j.id, uuid.uuid4(), WORKER) for j in extra]
    assert sum(c is not None for c in claims) == 6, "each slot was given back exactly once"


# --- ambiguous claims ------------------------------------------------------------


# --- checkpoints and progress ------------------------------------------------------


@_check
async def check_checkpoints_are_fenced_by_lease_and_number(ctx: Context) -> None:
    """A checkpoint is stored only under the current lease and only if it is newer."""
    job = await _claim(ctx.store, await _enqueue(ctx.store))
    lease = job.handoff_id
    assert lease is not None and job.checkpoint_seq == 0 and job.checkpoint is None
    ctx.clock.advance(1)
    saved = await ctx.store.save_checkpoints(
        [
            CheckpointSave(job.id, lease, 1, {"step": 1}),
            CheckpointSave(job.id, uuid.uuid4(), 2, {"stale": True}),
            CheckpointSave(job.id, lease, 2, {"step": 2}),
        ]
    )
    assert saved == [True, False, True], "each save is fenced on its own, in order"
    stored = await _get(ctx.store, job.id)
    assert (stored.checkpoint, stored.checkpoint_seq) == ({"step": 2}, 2)
    assert stored.checkpoint_at == START + timedelta(seconds=1)
    assert stored.status is JobStatus.HANDED_OFF and stored.updated_at == job.updated_at
    again = await ctx.store.save_checkpoints([CheckpointSave(job.id, lease, 1, {"step": 1})])
    assert again == [False], "an older checkpoint never replaces a newer one"
    assert (await _get(ctx.store, job.id)).checkpoint == {"step": 2}
    assert await ctx.store.complete(job.id, lease, "done")
    late = await ctx.store.save_checkpoints([CheckpointSave(job.id, lease, 3, {"step": 3})])
    assert late == [False], "a settled lease saves nothing"
    done = await _get(ctx.store, job.id)
    assert (done.status, done.checkpoint, done.checkpoint_seq) == (
        JobStatus.COMPLETED,
        {"step": 2},
        2,
    ), "a finished job keeps its last checkpoint"


@_check
async def check_the_next_attempt_receives_the_last_checkpoint(ctx: Context) -> None:
    """A checkpoint outlives its run: a retry, a return and a list all carry it."""
    job = await _claim(ctx.store, await _enqueue(ctx.store))
    assert job.handoff_id is not None
    assert await ctx.store.save_checkpoints([CheckpointSave(job.id, job.handoff_id, 1, [1, "a"])])
    assert await ctx.store.fail(job.id, job.handoff_id, "boom", ctx.clock())
    [again] = await ctx.store.mark_handed_off_many([Claim(job.id, uuid.uuid4(), WORKER)])
    assert (again.checkpoint, again.checkpoint_seq) == ([1, "a"], 1), "the claim carries it"
    assert again.handoff_id is not None
    assert await ctx.store.save_checkpoints([CheckpointSave(job.id, again.handoff_id, 2, None)])
    assert await ctx.store.return_to_queue(job.id, again.handoff_id)
    [third] = await ctx.store.select_eligible(modes=[job.execution_mode])
    assert (third.checkpoint, third.checkpoint_seq) == (None, 2), "null is a checkpoint too"
    [listed] = (await ctx.store.list_jobs(include_payload=False)).jobs
    assert listed.checkpoint is None and listed.checkpoint_seq == 2, "a summary leaves it out"


@_check
async def check_progress_is_fenced_by_lease(ctx: Context) -> None:
    """Progress is recorded only under the current lease."""
    job = await _claim(ctx.store, await _enqueue(ctx.store))
    lease = job.handoff_id
    assert lease is not None
    stale = ProgressUpdate(job.id, uuid.uuid4(), 0.9, "stale")
    taken = await ctx.store.save_progress([ProgressUpdate(job.id, lease, 0.25, "a"), stale])
    assert taken == [True, False]
    stored = await _get(ctx.store, job.id)
    assert (stored.progress, stored.progress_message) == (0.25, "a")
    assert await ctx.store.save_progress([ProgressUpdate(job.id, lease, 0.875, "b")]) == [True]
    assert await ctx.store.complete(job.id, lease)
    assert await ctx.store.save_progress([ProgressUpdate(job.id, lease, 0.5, "late")]) == [False]
    done = await _get(ctx.store, job.id)
    assert (done.progress, done.progress_message) == (1.0, "b"), "a completed job is done"


@_check
async def check_completion_sets_progress_done_in_a_mixed_batch(ctx: Context) -> None:
    """A completion settled alongside other outcomes sets its progress done too; the
    failure in the batch keeps the progress its run reported."""
    done = await _claim(ctx.store, await _enqueue(ctx.store))
    failed = await _claim(ctx.store, await _enqueue(ctx.store))
    assert done.handoff_id is not None and failed.handoff_id is not None
    progress = [
        ProgressUpdate(done.id, done.handoff_id, 0.5, "half"),
        ProgressUpdate(failed.id, failed.handoff_id, 0.5, "half"),
    ]
    assert await ctx.store.save_progress(progress) == [True, True]
    settlements = [
        Settlement(done.id, done.handoff_id, Outcome.COMPLETE, result=1),
        Settlement(failed.id, failed.handoff_id, Outcome.FAIL, error="boom"),
    ]
    assert await ctx.store.settle_many(settlements) == [True, True]
    assert (await _get(ctx.store, done.id)).progress == 1.0
    assert (await _get(ctx.store, failed.id)).progress == 0.5


async def _queued_copies(store: StorageAdapter, job_id: uuid.UUID) -> int:
    page = await store.list_jobs(JobFilter(statuses=[JobStatus.QUEUED]), limit=1000)
    return sum(1 for job in page.jobs if job.id == job_id)


async def _ambiguous_claim(ctx: Context, fault: ClaimFault) -> tuple[FaultyAdapter, Job, uuid.UUID]:
    faulty = FaultyAdapter(ctx.store)
    job = await _enqueue(ctx.store)
    lease = uuid.uuid4()
    faulty.fail_next_claims(fault)
    try:
        await faulty.mark_handed_off(job.id, lease, WORKER)
    except StorageError:
        pass
    else:
        raise AssertionError("the injected fault should have raised")
    return faulty, job, lease


@_check
async def check_ambiguous_claim_that_committed_is_returned_once(ctx: Context) -> None:
    faulty, job, lease = await _ambiguous_claim(ctx, ClaimFault.AFTER_COMMIT)
    stored = await _get(ctx.store, job.id)
    assert stored.status is JobStatus.HANDED_OFF and stored.handoff_id == lease
    assert await faulty.return_to_queue(job.id, lease) is True
    assert await faulty.return_to_queue(job.id, lease) is False
    assert (await _get(ctx.store, job.id)).status is JobStatus.QUEUED
    assert await _queued_copies(ctx.store, job.id) == 1
    assert len(await ctx.store.select_eligible(modes=ALL_MODES)) == 1
    assert await ctx.store.mark_handed_off(job.id, uuid.uuid4(), WORKER) is not None


@_check
async def check_ambiguous_claim_that_never_committed_is_a_no_op(ctx: Context) -> None:
    faulty, job, lease = await _ambiguous_claim(ctx, ClaimFault.BEFORE_COMMIT)
    before = await _get(ctx.store, job.id)
    assert before.status is JobStatus.QUEUED and before.handoff_id is None
    assert await faulty.return_to_queue(job.id, lease) is False
    after = await _get(ctx.store, job.id)
    assert after == before, "returning a lease that never committed changes nothing"
    assert await _queued_copies(ctx.store, job.id) == 1
    assert await ctx.store.mark_handed_off(job.id, uuid.uuid4(), WORKER) is not None


@_check
async def check_late_return_of_an_ambiguous_lease_spares_a_newer_one(ctx: Context) -> None:
    for fault in (ClaimFault.AFTER_COMMIT, ClaimFault.BEFORE_COMMIT):
        faulty, job, lease = await _ambiguous_claim(ctx, fault)
        if fault is ClaimFault.AFTER_COMMIT:
            assert await faulty.return_to_queue(job.id, lease) is True
        newer = await _claim(ctx.store, await _get(ctx.store, job.id), worker="worker-b")
        assert await faulty.return_to_queue(job.id, lease) is False
        current = await _get(ctx.store, job.id)
        assert current.status is JobStatus.HANDED_OFF
        assert current.handoff_id == newer.handoff_id and current.worker_id == "worker-b"


@_check
async def check_return_retried_after_store_errors_lands_once(ctx: Context) -> None:
    faulty, job, lease = await _ambiguous_claim(ctx, ClaimFault.AFTER_COMMIT)
    faulty.return_failures = 3
    outcomes: list[bool] = []
    for _ in range(10):
        try:
            outcomes.append(await faulty.return_to_queue(job.id, lease))
        except StorageError:
            continue
        break
    assert outcomes == [True]
    assert await _queued_copies(ctx.store, job.id) == 1


# --- concurrency keys --------------------------------------------------------------


@_check
async def check_concurrency_limit_holds_and_slots_come_back(ctx: Context) -> None:
    jobs = [
        await _enqueue(ctx.store, concurrency_key="acct", concurrency_limit=2, args=[i])
        for i in range(5)
    ]
    free = await _enqueue(ctx.store, args=["free"])
    a = await _claim(ctx.store, jobs[0])
    b = await _claim(ctx.store, jobs[1])
    assert await ctx.store.mark_handed_off(jobs[2].id, uuid.uuid4(), WORKER) is None
    eligible = await ctx.store.select_eligible(modes=ALL_MODES)
    assert [j.id for j in eligible] == [free.id], "a full key's jobs are not eligible"
    transitions: list[Callable[[Job], Awaitable[bool]]] = [
        lambda j: ctx.store.complete(j.id, j.handoff_id or uuid.uuid4()),
        lambda j: ctx.store.fail(j.id, j.handoff_id or uuid.uuid4(), "x", START),
        lambda j: ctx.store.return_to_queue(j.id, j.handoff_id or uuid.uuid4()),
        lambda j: ctx.store.reschedule(j.id, j.handoff_id or uuid.uuid4(), START),
    ]
    holders = [a, b]
    for transition in transitions:
        assert await transition(holders.pop(0)) is True
        waiting = [j for j in await ctx.store.select_eligible(modes=ALL_MODES) if j.concurrency_key]
        attempts = [await ctx.store.mark_handed_off(j.id, uuid.uuid4(), WORKER) for j in waiting]
        won = [j for j in attempts if j is not None]
        assert len(won) == 1, f"one released slot admits exactly one job, {len(won)} got in"
        holders.append(won[0])
    cancelled = await ctx.store.cancel(holders[0].id)
    assert cancelled is not None and cancelled.status is JobStatus.CANCELLED
    assert [j for j in await ctx.store.select_eligible(modes=ALL_MODES) if j.concurrency_key]


@_check
async def check_concurrency_limit_holds_under_concurrent_claims(ctx: Context) -> None:
    jobs = [
        await _enqueue(ctx.store, concurrency_key="shared", concurrency_limit=3, args=[i])
        for i in range(12)
    ]
    handles = [ctx.store, *[await ctx.peer() for _ in range(3)]]

    async def claim_one(i: int, job: Job) -> Job | None:
        return await handles[i % len(handles)].mark_handed_off(job.id, uuid.uuid4(), f"w{i}")

    async def claim_batch(i: int) -> list[Job]:
        return await handles[i % len(handles)].mark_handed_off_many(
            [Claim(job.id, uuid.uuid4(), f"b{i}") for job in jobs]
        )

    singles = await asyncio.gather(*(claim_one(i, job) for i, job in enumerate(jobs)))
    batches = await asyncio.gather(*(claim_batch(i) for i in range(4)))
    won = [j for j in singles if j is not None] + [j for b in batches for j in b]
    assert len(won) == 3, f"limit 3 must hold under concurrent claims, {len(won)} won"
    page = await ctx.store.list_jobs(JobFilter(statuses=[JobStatus.HANDED_OFF]), limit=50)
    assert len(page.jobs) == 3


# --- selection and ordering ---------------------------------------------------------


@_check
async def check_selection_order_priority_then_run_at_then_creation(ctx: Context) -> None:
    low = await _enqueue(ctx.store, priority=0, args=["low"])
    ctx.clock.advance(1)
    high_late = await _enqueue(ctx.store, priority=5, run_at=START, args=["high-late-created"])
    ctx.clock.advance(1)
    high_early = await _enqueue(
        ctx.store, priority=5, run_at=START - timedelta(seconds=30), args=["high-early"]
    )
    ctx.clock.advance(1)
    high_same = await _enqueue(ctx.store, priority=5, run_at=START, args=["high-same-run-at"])
    future = await _enqueue(ctx.store, priority=9, run_at=START + timedelta(hours=1))
    order = [j.id for j in await ctx.store.select_eligible(modes=ALL_MODES)]
    assert order == [high_early.id, high_late.id, high_same.id, low.id]
    assert future.id not in order
    assert [j.id for j in await ctx.store.select_eligible(modes=ALL_MODES, limit=2)] == order[:2]


@_check
async def check_selection_spans_priority_levels_past_future_jobs(ctx: Context) -> None:
    """A read whose limit takes more than one priority level reads them from the highest
    down, each in its order, leaving out jobs not yet due at any level, jobs of other
    modes between the levels, and jobs handed off: the SQL stores read level by level
    with a due bound (issue 35), which must pick what one sort of every due job picks."""
    later = START + timedelta(hours=1)
    due: dict[int, list[Job]] = {}
    for priority in (7, 3, -2):
        await _enqueue(ctx.store, priority=priority, run_at=later)
        due[priority] = [await _enqueue(ctx.store, priority=priority) for _ in range(2)]
        ctx.clock.advance(1)
    await _enqueue(ctx.store, priority=9, run_at=later)  # a level with nothing due
    await _enqueue(ctx.store, priority=5, execution_mode=ExecutionMode.INLINE)
    await _claim(ctx.store, await _enqueue(ctx.store, priority=4))
    best = [j.id for p in (7, 3, -2) for j in due[p]]
    pooled = [ExecutionMode.POOLED]
    assert [j.id for j in await ctx.store.select_eligible(modes=pooled)] == best
    for limit in (1, 3, 5):
        read = await ctx.store.select_eligible(modes=pooled, limit=limit)
        assert [j.id for j in read] == best[:limit]
    skip = {due[7][0].id, due[3][1].id}
    read = await ctx.store.select_eligible(modes=pooled, limit=3, skip=skip)
    assert [j.id for j in read] == [i for i in best if i not in skip][:3]
    ctx.clock.advance(3600)
    assert len(await ctx.store.select_eligible(modes=pooled)) == 10


@_check
async def check_selection_filters_modes_and_queues(ctx: Context) -> None:
    inline = await _enqueue(ctx.store, execution_mode=ExecutionMode.INLINE)
    pooled = await _enqueue(ctx.store, queue="reports")
    forked = await _enqueue(ctx.store, execution_mode=ExecutionMode.FORKED, queue="reports")

    def ids(jobs: list[Job]) -> set[uuid.UUID]:
        return {j.id for j in jobs}

    assert ids(await ctx.store.select_eligible(modes=[ExecutionMode.INLINE])) == {inline.id}
    assert ids(await ctx.store.select_eligible(modes=ALL_MODES, queues=["reports"])) == {
        pooled.id,
        forked.id,
    }
    assert ids(
        await ctx.store.select_eligible(
            modes=[ExecutionMode.POOLED, ExecutionMode.INLINE], queues=["reports"]
        )
    ) == {pooled.id}
    assert await ctx.store.select_eligible(modes=[]) == []


@_check
async def check_selection_leaves_out_tasks_not_asked_for(ctx: Context) -> None:
    """``tasks=`` names the tasks some connected worker declared: jobs of other tasks are
    left out of the read, ahead of the limit, so a backlog no worker can run never hides
    the jobs behind it (routing by task, :mod:`broker.core.placement`)."""
    for _ in range(3):
        await _enqueue(ctx.store, task="nobody.runs")
    runnable = await _enqueue(ctx.store, task="some.runs")
    read = await ctx.store.select_eligible(modes=ALL_MODES, limit=1, tasks=["some.runs"])
    assert [j.id for j in read] == [runnable.id]
    assert len(await ctx.store.select_eligible(modes=ALL_MODES, tasks=None)) == 4
    assert await ctx.store.select_eligible(modes=ALL_MODES, tasks=[]) == []


@_check
async def check_next_run_at_finds_the_earliest_queued_job(ctx: Context) -> None:
    assert await ctx.store.next_run_at(modes=ALL_MODES) is None
    soon = START + timedelta(minutes=1)
    await _enqueue(ctx.store, run_at=START + timedelta(hours=1))
    await _enqueue(ctx.store, run_at=soon)
    await _enqueue(
        ctx.store, run_at=START + timedelta(seconds=1), execution_mode=ExecutionMode.INLINE
    )
    assert await ctx.store.next_run_at(modes=[ExecutionMode.POOLED]) == soon
    assert await ctx.store.next_run_at(modes=[ExecutionMode.POOLED], queues=["other"]) is None
    earliest = START - timedelta(hours=1)
    claimed = await _claim(ctx.store, await _enqueue(ctx.store, run_at=earliest))
    assert claimed.status is JobStatus.HANDED_OFF
    assert await ctx.store.next_run_at(modes=[ExecutionMode.POOLED]) == soon, (
        "a job handed off has no next run"
    )
    assert await ctx.store.next_run_at(modes=ALL_MODES) == START + timedelta(seconds=1)
    await _enqueue(ctx.store, run_at=earliest, queue="other", priority=-5)
    assert await ctx.store.next_run_at(modes=ALL_MODES) == earliest
    assert await ctx.store.next_run_at(modes=ALL_MODES, queues=["default"]) == START + timedelta(
        seconds=1
    )


# --- dependencies: a job waits for its parents, and is made due exactly once ------------


async def _finish(
    store: StorageAdapter, job: Job, outcome: Outcome = Outcome.COMPLETE, result: JSONValue = None
) -> Job:
    """Claim ``job`` and settle it with ``outcome`` (dead, for a failure); the claimed job."""
    claimed = await _claim(store, job)
    assert claimed.handoff_id is not None
    [ok] = await store.settle_many(
        [Settlement(job.id, claimed.handoff_id, outcome, result=result, error="boom")]
    )
    assert ok, "a report under the current lease is applied"
    return claimed


@_check
async def check_a_job_waits_until_every_parent_completed(ctx: Context) -> None:
    """A job with parents waits until every one has completed, then is due with their results.

    It is stored ``waiting``, is never selected nor claimable while it waits, and the
    settle that completes its last parent makes it ``queued``, its parents' results (in
    ``depends_on`` order) first in its arguments."""
    store = ctx.store
    a, b = await _enqueue(store), await _enqueue(store)
    child = await _enqueue(
        store, args=["own"], depends_on=(a.id, b.id), parent_results=ParentResults.LIST_ARG
    )
    assert (await _get(store, child.id)).status is JobStatus.WAITING
    assert await store.mark_handed_off(child.id, uuid.uuid4(), WORKER) is None
    await _finish(store, b, result={"b": 2})
    assert (await _get(store, child.id)).status is JobStatus.WAITING, "one parent is left"
    assert child.id not in {j.id for j in await store.select_eligible(modes=ALL_MODES)}
    await _finish(store, a, result=[1])
    due = await _get(store, child.id)
    assert due.status is JobStatus.QUEUED
    assert due.args == ([[1], {"b": 2}], "own"), due.args
    assert (await _claim(store, due)).args == due.args


@_check
async def check_a_parent_that_did_not_complete_cancels_its_dependents_or_lets_them_run(
    ctx: Context,
) -> None:
    """A parent ending dead or cancelled cancels its dependents (naming it), down the chain.

    With ``on_parent_failure="run"`` the dependent counts it as ended instead and runs,
    the failed parent's result read as ``None``."""
    store = ctx.store
    a = await _enqueue(store)
    b = await _enqueue(store, depends_on=(a.id,), parent_results=ParentResults.FIRST_ARG)
    c = await _enqueue(store, depends_on=(b.id,))
    runs = await _enqueue(
        store,
        depends_on=(a.id,),
        parent_results=ParentResults.FIRST_ARG,
        on_parent_failure=ParentFailure.RUN,
    )
    await _finish(store, a, Outcome.FAIL)
    for job in (b, c):
        after = await _get(store, job.id)
        assert after.status is JobStatus.CANCELLED, (job is c, after.status)
        assert after.last_error is not None and "parent job" in after.last_error
    assert str(a.id) in ((await _get(store, b.id)).last_error or "")
    ran = await _get(store, runs.id)
    assert (ran.status, ran.args) == (JobStatus.QUEUED, (None,))
    d = await _enqueue(store)
    e = await _enqueue(store, depends_on=(d.id,))
    assert (await store.cancel(d.id)) is not None
    assert (await _get(store, e.id)).status is JobStatus.CANCELLED, "a cancel reaches dependents"
    waiting = await _enqueue(store, depends_on=(runs.id,))
    cancelled = await store.cancel(waiting.id)
    assert cancelled is not None and cancelled.status is JobStatus.CANCELLED, "waiting cancels"


@_check
async def check_parents_are_read_at_enqueue(ctx: Context) -> None:
    """Parents must be stored first; one already completed counts at once, one failed at once.

    An enqueue naming a job the store does not hold is refused with ``InvalidJobError``
    and stores nothing of its batch; a parent already completed counts (the child may be
    due at once, with its result), and parents earlier in the same batch may be named."""
    store = ctx.store
    done = await _enqueue(store)
    await _finish(store, done, result="r")
    child = await _enqueue(store, depends_on=(done.id,), parent_results=ParentResults.FIRST_ARG)
    got = await _get(store, child.id)
    assert (got.status, got.args) == (JobStatus.QUEUED, ("r",))
    dead = await _enqueue(store)
    await _finish(store, dead, Outcome.FAIL)
    assert (await _get(store, (await _enqueue(store, depends_on=(dead.id,))).id)).status is (
        JobStatus.CANCELLED
    )
    first = _spec()
    batch = [first, _spec(depends_on=(first.id,)), _spec(depends_on=(uuid.uuid4(),))]
    try:
        await store.enqueue_many(batch)
    except InvalidJobError:
        pass
    else:
        raise AssertionError("a parent not in the store was accepted")
    assert await store.get_job(first.id) is None, "the refused batch stored nothing"
    results = await store.enqueue_many(batch[:2])
    assert (await _get(store, results[1].job.id)).status is JobStatus.WAITING


@_check
async def check_a_repeated_stale_or_retried_report_releases_the_child_once(ctx: Context) -> None:
    """The last parent's report resent, stale or from an attempt lost and retried releases its
    child exactly once.

    Only the move the fence accepts counts the parent: a copy resent in the same batch
    or after, a report under an older lease, and a parent revived after its child was
    released change nothing of the child (not even its arguments)."""
    store = ctx.store
    a = await _enqueue(store)
    child = await _enqueue(store, depends_on=(a.id,), parent_results=ParentResults.FIRST_ARG)
    lost = await _claim(store, a)
    assert lost.handoff_id is not None
    [ok] = await store.settle_many([Settlement(a.id, lost.handoff_id, Outcome.LOST, run_at=START)])
    assert ok and (await _get(store, child.id)).status is JobStatus.WAITING
    retried = await _claim(store, a)
    assert retried.handoff_id is not None
    stale = Settlement(a.id, lost.handoff_id, Outcome.COMPLETE, result="stale")
    assert await store.settle_many([stale]) == [False]
    assert (await _get(store, child.id)).status is JobStatus.WAITING, "a stale report counts not"
    report = Settlement(a.id, retried.handoff_id, Outcome.COMPLETE, result="fresh")
    assert await store.settle_many([report, report]) == [True, False]
    due = await _get(store, child.id)
    assert (due.status, due.args) == (JobStatus.QUEUED, ("fresh",))
    running = await _claim(store, due)
    assert await store.settle_many([report]) == [False]
    again = await _get(store, child.id)
    assert (again.status, again.handoff_id, again.args) == (
        JobStatus.HANDED_OFF,
        running.handoff_id,
        ("fresh",),
    ), "a resent report released the child a second time"


@_check
async def check_last_parents_settling_at_once_release_the_child_once(ctx: Context) -> None:
    """Parents settled at once, from two handles, release their common child exactly once.

    On a store shared between processes the two settles run in parallel, and exactly
    one of them must see the child's count reach zero (a row lock, or one writer)."""
    peer = await ctx.peer()
    children = []
    pairs = []
    for _ in range(4):
        a = await _claim(ctx.store, await _enqueue(ctx.store))
        b = await _claim(ctx.store, await _enqueue(ctx.store))
        children.append(
            await _enqueue(
                ctx.store, depends_on=(a.id, b.id), parent_results=ParentResults.LIST_ARG
            )
        )
        pairs.append((a, b))
    settles = []
    for a, b in pairs:
        assert a.handoff_id is not None and b.handoff_id is not None
        settles.append(
            ctx.store.settle_many([Settlement(a.id, a.handoff_id, Outcome.COMPLETE, result="a")])
        )
        settles.append(
            peer.settle_many([Settlement(b.id, b.handoff_id, Outcome.COMPLETE, result="b")])
        )
    assert await asyncio.gather(*settles) == [[True]] * len(settles)
    for child in children:
        due = await _get(ctx.store, child.id)
        assert (due.status, due.args) == (JobStatus.QUEUED, (["a", "b"],)), (due.status, due.args)


@_check
async def check_retention_keeps_a_parent_while_a_child_waits(ctx: Context) -> None:
    """Pruning never deletes a parent whose result a waiting child will still read."""
    store = ctx.store
    a, b = await _enqueue(store), await _enqueue(store)
    child = await _enqueue(store, depends_on=(a.id, b.id), parent_results=ParentResults.LIST_ARG)
    await _finish(store, a, result="kept")
    ctx.clock.advance(3600)
    await store.prune(older_than=ctx.clock())
    assert await store.get_job(a.id) is not None, "a parent a child waits on was pruned"
    await _finish(store, b, result="b")
    assert (await _get(store, child.id)).args == (["kept", "b"],)
    ctx.clock.advance(3600)
    await store.prune(older_than=ctx.clock())
    assert await store.get_job(a.id) is None, "once the child is due its parent may go"


# --- workflows (optional: SupportsWorkflows) -----------------------------------------


def _workflows(ctx: Context) -> SupportsWorkflows:
    if not isinstance(ctx.store, SupportsWorkflows):
        raise CheckSkipped("adapter does not implement SupportsWorkflows")
    return ctx.store


async def _fan_in(store: StorageAdapter, members: int) -> tuple[uuid.UUID, list[Job], Job]:
    """A group of ``members`` and its fan-in, under one workflow id, in one enqueue."""
    workflow_id = uuid.uuid4()
    group = [_spec(workflow_id=workflow_id) for _ in range(members)]
    then = _spec(
        workflow_id=workflow_id,
        depends_on=tuple(s.id for s in group),
        parent_results=ParentResults.LIST_ARG,
    )
    results = await store.enqueue_many([*group, then])
    return workflow_id, [r.job for r in results[:-1]], results[-1].job


@_check
async def check_a_workflow_reads_back_with_its_members_and_edges(ctx: Context) -> None:
    """A workflow reads back whole: every member, parents first in enqueue order, and each edge.

    ``get_workflow``'s members come without their payloads, the read stops at ``limit``
    members (saying it was cut short), the id of a member reads its workflow, and an
    unknown id reads as ``None``."""
    store = _workflows(ctx)
    workflow_id, group, then = await _fan_in(ctx.store, 3)
    assert await store.get_workflow(uuid.uuid4(), limit=10) is None
    read = await store.get_workflow(workflow_id, limit=10)
    assert read is not None and not read.truncated
    assert [m.id for m in read.members] == [*(j.id for j in group), then.id]
    assert read.members[-1].status is JobStatus.WAITING
    assert [(e.child, e.parent, e.done) for e in read.edges] == [
        (then.id, j.id, False) for j in group
    ]
    await _finish(ctx.store, group[1], result={"big": "x" * 100})
    read = await store.get_workflow(workflow_id, limit=10)
    assert read is not None
    assert read.members[1].status is JobStatus.COMPLETED and read.members[1].result is None
    assert [e.done for e in read.edges] == [False, True, False]
    cut = await store.get_workflow(workflow_id, limit=2)
    assert cut is not None and cut.truncated and len(cut.members) == 2
    by_member = await store.get_workflow(then.id, limit=10)
    assert by_member is not None and by_member.workflow_id == workflow_id, "a member names it"
    assert [m.id for m in by_member.members] == [m.id for m in read.members]


@_check
async def check_a_workflow_retry_runs_its_dead_members_and_revives_their_dependents(
    ctx: Context,
) -> None:
    """A workflow's retry queues its dead members again and makes their cancelled dependents wait.

    ``retry_workflow`` changes it in one transaction. The continuation then becomes due
    once, when the retried member completes; a member an operator cancelled stays
    cancelled, and a retry with nothing dead changes nothing."""
    store = _workflows(ctx)
    workflow_id, group, then = await _fan_in(ctx.store, 3)
    await _finish(ctx.store, group[0], result=1)
    await _finish(ctx.store, group[1], Outcome.FAIL)
    cancelled = await _get(ctx.store, then.id)
    assert cancelled.status is JobStatus.CANCELLED
    await _finish(ctx.store, group[2], result=3)
    changed = await store.retry_workflow(workflow_id)
    assert changed == [group[1].id, then.id], changed
    again = await _get(ctx.store, group[1].id)
    assert (again.status, again.attempts) == (JobStatus.QUEUED, 0)
    waiting = await _get(ctx.store, then.id)
    assert (waiting.status, waiting.last_error) == (JobStatus.WAITING, None)
    assert await store.retry_workflow(workflow_id) == [], "nothing is dead any more"
    await _finish(ctx.store, again, result=2)
    due = await _get(ctx.store, then.id)
    assert due.status is JobStatus.QUEUED, due.status
    assert due.args == ([1, 2, 3],), due.args
    # An operator's cancel is not undone by a retry.
    workflow_id, group, then = await _fan_in(ctx.store, 2)
    await _finish(ctx.store, group[0], Outcome.FAIL)
    assert (await ctx.store.cancel(group[1].id)) is not None
    assert await store.retry_workflow(workflow_id) == [group[0].id]
    assert (await _get(ctx.store, then.id)).status is JobStatus.CANCELLED


# --- queue settings (optional: SupportsQueueSettings) --------------------------------


def _queue_settings(ctx: Context) -> SupportsQueueSettings:
    if not isinstance(ctx.store, SupportsQueueSettings):
        raise CheckSkipped("adapter does not implement SupportsQueueSettings")
    return ctx.store


@_check
async def check_queue_settings_are_kept_replaced_and_cleared(ctx: Context) -> None:
    """Queue settings are kept as saved, replaced whole, and a queue with nothing set has none."""
    store = _queue_settings(ctx)
    assert await store.queue_settings() == []
    mail = QueueSettings("mail", paused=True)
    api = QueueSettings("api", rate=Rate(50, "s", 10))
    await store.save_queue_settings(mail)
    await store.save_queue_settings(api)
    assert await store.queue_settings() == [api, mail], "every queue's settings, by name"
    await store.save_queue_settings(QueueSettings("mail", rate=Rate(5, "m")))
    assert await store.queue_settings() == [api, QueueSettings("mail", rate=Rate(5, "m"))]
    await store.save_queue_settings(QueueSettings("api"))
    assert await store.queue_settings() == [QueueSettings("mail", rate=Rate(5, "m"))]
    other = await ctx.peer()
    assert isinstance(other, SupportsQueueSettings)
    if ctx.store.capabilities.shared_between_processes:
        assert await other.queue_settings() == [QueueSettings("mail", rate=Rate(5, "m"))]


@_check
async def check_dispatch_reads_leave_out_the_queues_excluded(ctx: Context) -> None:
    """Dispatch reads (the selection and the next run time) leave out the queues excluded."""
    _queue_settings(ctx)
    store: Any = ctx.store
    held = await _enqueue(ctx.store, queue="held", priority=5)
    free = await _enqueue(ctx.store, queue="free", run_at=START + timedelta(seconds=30))
    ctx.clock.advance(60)
    found = await store.select_eligible(modes=ALL_MODES, exclude_queues=["held"])
    assert [job.id for job in found] == [free.id]
    found = await store.select_eligible(modes=ALL_MODES, queues=["held"], exclude_queues=["held"])
    assert found == [], "a queue both wanted and excluded is left out"
    assert await store.next_run_at(modes=ALL_MODES, exclude_queues=["held"]) == free.run_at
    assert await store.next_run_at(modes=ALL_MODES, exclude_queues=["held", "free"]) is None
    both = await store.select_eligible(modes=ALL_MODES, exclude_queues=[])
    assert [job.id for job in both] == [held.id, free.id]


@_check
async def check_dispatch_reads_leave_out_the_rate_keys_excluded(ctx: Context) -> None:
    """A job's rate key is kept, and a dispatch read leaves out the (task, key) pairs
    excluded (a job without a key is its task's key ``""``), and nothing else: the same
    key of another task, and other keys of the task, still come back."""
    _queue_settings(ctx)
    store: Any = ctx.store
    flood = await _enqueue(ctx.store, "tests.mail", rate_key="acme", priority=5)
    other = await _enqueue(ctx.store, "tests.mail", rate_key="globex")
    keyless = await _enqueue(ctx.store, "tests.mail")
    same_key = await _enqueue(ctx.store, "tests.sms", rate_key="acme")
    found = await store.select_eligible(modes=ALL_MODES)
    assert [job.id for job in found] == [flood.id, other.id, keyless.id, same_key.id]
    assert found[0].rate_key == "acme" and found[2].rate_key is None
    left = await store.select_eligible(
        modes=ALL_MODES, exclude_keys=[("tests.mail", "acme"), ("tests.mail", "")]
    )
    assert [job.id for job in left] == [other.id, same_key.id]
    got = await ctx.store.get_job(flood.id)
    assert got is not None and got.rate_key == "acme"


# --- worker handoffs, cancel, retry --------------------------------------------------


@_check
async def check_handoffs_for_worker_lists_only_its_live_leases(ctx: Context) -> None:
    mine = [await _claim(ctx.store, await _enqueue(ctx.store), worker="w1") for _ in range(3)]
    await _claim(ctx.store, await _enqueue(ctx.store), worker="w2")
    assert mine[0].handoff_id is not None
    assert await ctx.store.complete(mine[0].id, mine[0].handoff_id)
    listed = await ctx.store.handoffs_for_worker("w1")
    assert {(j.id, j.handoff_id) for j in listed} == {(j.id, j.handoff_id) for j in mine[1:]}
    assert await ctx.store.handoffs_for_worker("nobody") == []


@_check
async def check_cancel_fences_out_the_running_lease(ctx: Context) -> None:
    queued = await _enqueue(ctx.store)
    cancelled = await ctx.store.cancel(queued.id)
    assert cancelled is not None and cancelled.status is JobStatus.CANCELLED
    assert await ctx.store.mark_handed_off(queued.id, uuid.uuid4(), WORKER) is None
    running = await _claim(ctx.store, await _enqueue(ctx.store))
    assert running.handoff_id is not None
    stopped = await ctx.store.cancel(running.id)
    assert stopped is not None and stopped.status is JobStatus.CANCELLED
    assert await ctx.store.complete(running.id, running.handoff_id, "late") is False
    assert (await _get(ctx.store, running.id)).status is JobStatus.CANCELLED
    assert await ctx.store.cancel(uuid.uuid4()) is None
    again = await ctx.store.cancel(running.id)
    assert again is not None and again.status is JobStatus.CANCELLED


@_check
async def check_retry_dead_requeues_only_dead_jobs(ctx: Context) -> None:
    job = await _claim(ctx.store, await _enqueue(ctx.store, max_attempts=1))
    assert job.handoff_id is not None
    assert await ctx.store.fail(job.id, job.handoff_id, "fatal", None)
    revived = await ctx.store.retry_dead(job.id)
    assert revived is not None
    assert revived.status is JobStatus.QUEUED and revived.attempts == 0
    assert revived.last_error == "fatal"
    again = await ctx.store.retry_dead(job.id)
    assert again is not None and again.status is JobStatus.QUEUED
    assert await ctx.store.retry_dead(uuid.uuid4()) is None


# --- inspection and pruning -------------------------------------------------------


@_check
async def check_list_jobs_filters_and_pages(ctx: Context) -> None:
    made: list[Job] = []
    for i in range(7):
        made.append(await _enqueue(ctx.store, task="a" if i % 2 else "b", queue=f"q{i % 3}"))
        ctx.clock.advance(1)
    seen: list[uuid.UUID] = []
    cursor: str | None = None
    while True:
        page = await ctx.store.list_jobs(limit=3, cursor=cursor)
        seen.extend(j.id for j in page.jobs)
        cursor = page.next_cursor
        if cursor is None:
            break
    assert seen == [j.id for j in reversed(made)], "newest first, no gaps, no repeats"
    only_a = await ctx.store.list_jobs(JobFilter(tasks=["a"]), limit=10)
    assert {j.id for j in only_a.jobs} == {j.id for j in made if j.task == "a"}
    q0 = await ctx.store.list_jobs(JobFilter(queues=["q0"]), limit=10)
    assert {j.id for j in q0.jobs} == {j.id for j in made if j.queue == "q0"}
    await _claim(ctx.store, made[0])
    handed = await ctx.store.list_jobs(JobFilter(statuses=[JobStatus.HANDED_OFF]), limit=10)
    assert [j.id for j in handed.jobs] == [made[0].id]


@_check
async def check_summary_listing_leaves_the_payload_out(ctx: Context) -> None:
    done = await _claim(ctx.store, await _enqueue(ctx.store, args=[1, "two"], kwargs={"k": [3]}))
    assert await ctx.store.complete(done.id, done.handoff_id or uuid.uuid4(), {"out": 4})
    ctx.clock.advance(1)
    queued = await _enqueue(ctx.store, args=["x" * 1000], kwargs={"big": "y" * 1000})
    full = (await ctx.store.list_jobs(limit=10)).jobs
    summary = (await ctx.store.list_jobs(limit=10, include_payload=False)).jobs
    assert [j.id for j in summary] == [j.id for j in full] == [queued.id, done.id]
    assert full[0].args == ("x" * 1000,) and full[0].kwargs == {"big": "y" * 1000}
    assert full[1].args == (1, "two") and full[1].kwargs == {"k": [3]}
    assert full[1].result == {"out": 4}, "a full listing (the default) carries the payload"
    for whole, short in zip(full, summary, strict=True):
        assert (short.args, short.kwargs, short.result) == ((), {}, None), "no payload"
        assert short == replace(whole, args=(), kwargs={}, result=None), "every other field"
    assert (await _get(ctx.store, done.id)).result == {"out": 4}, "get_job returns it all"


@_check
async def check_cursor_after_continues_right_after_any_listed_job(ctx: Context) -> None:
    for i in range(6):  # pairs created in the same instant: the order must break ties
        await _enqueue(ctx.store, args=[i])
        if i % 2:
            ctx.clock.advance(1)
    listed = (await ctx.store.list_jobs(limit=10)).jobs
    for include_payload in (True, False):
        for i, job in enumerate(listed):
            rest = await ctx.store.list_jobs(
                limit=10, cursor=ctx.store.cursor_after(job), include_payload=include_payload
            )
            rest_ids = [j.id for j in rest.jobs]
            assert rest_ids == [j.id for j in listed[i + 1 :]], "the jobs after it, in order"
            assert rest.next_cursor is None


@_check
async def check_count_jobs_by_queue_and_status(ctx: Context) -> None:
    await _enqueue(ctx.store, queue="a", run_at=START - timedelta(minutes=3))
    await _enqueue(ctx.store, queue="a")
    done = await _claim(ctx.store, await _enqueue(ctx.store, queue="b"))
    assert await ctx.store.complete(done.id, done.handoff_id or uuid.uuid4())
    await _claim(ctx.store, await _enqueue(ctx.store, queue="b"))
    counts = {(c.queue, c.status): c for c in await ctx.store.count_jobs()}
    assert counts[("a", JobStatus.QUEUED)].count == 2
    assert counts[("a", JobStatus.QUEUED)].oldest_run_at == START - timedelta(minutes=3)
    assert counts[("b", JobStatus.COMPLETED)].count == 1
    assert counts[("b", JobStatus.HANDED_OFF)].count == 1
    assert ("b", JobStatus.QUEUED) not in counts


@_check
async def check_prune_never_touches_active_jobs(ctx: Context) -> None:
    queued = await _enqueue(ctx.store)
    running = await _claim(ctx.store, await _enqueue(ctx.store))
    terminal: list[uuid.UUID] = []
    for i in range(9):
        job = await _claim(ctx.store, await _enqueue(ctx.store, args=[i], max_attempts=1))
        assert job.handoff_id is not None
        if i % 3 == 0:
            assert await ctx.store.complete(job.id, job.handoff_id)
        elif i % 3 == 1:
            assert await ctx.store.fail(job.id, job.handoff_id, "x", None)
        else:
            assert await ctx.store.cancel(job.id) is not None
        terminal.append(job.id)
        ctx.clock.advance(60)
    assert await ctx.store.prune(keep_latest=4, batch_size=2) == 5
    remaining = {j.id for j in (await ctx.store.list_jobs(limit=100)).jobs}
    assert set(terminal[-4:]) <= remaining and not set(terminal[:5]) & remaining
    assert await ctx.store.prune(older_than=ctx.clock() + timedelta(days=1), batch_size=3) == 4
    remaining = {j.id for j in (await ctx.store.list_jobs(limit=100)).jobs}
    assert remaining == {queued.id, running.id}
    assert (await _get(ctx.store, running.id)).status is JobStatus.HANDED_OFF


@_check
async def check_prune_by_age_and_status(ctx: Context) -> None:
    old = await _claim(ctx.store, await _enqueue(ctx.store))
    assert await ctx.store.complete(old.id, old.handoff_id or uuid.uuid4())
    dead = await _claim(ctx.store, await _enqueue(ctx.store, max_attempts=1))
    assert await ctx.store.fail(dead.id, dead.handoff_id or uuid.uuid4(), "x", None)
    ctx.clock.advance(3600)
    new = await _claim(ctx.store, await _enqueue(ctx.store))
    assert await ctx.store.complete(new.id, new.handoff_id or uuid.uuid4())
    cutoff = START + timedelta(minutes=30)
    assert await ctx.store.prune(older_than=cutoff, statuses=[JobStatus.COMPLETED]) == 1
    assert await ctx.store.get_job(old.id) is None
    assert await ctx.store.get_job(dead.id) is not None
    assert await ctx.store.get_job(new.id) is not None
    assert await ctx.store.prune(older_than=cutoff, statuses=[JobStatus.QUEUED]) == 0


# --- offloaded payloads ------------------------------------------------------------


def _offloading(ctx: Context) -> tuple[SupportsOffload, int]:
    """The store as :class:`SupportsOffload`, and its threshold; skips an adapter without."""
    store = ctx.store
    if not isinstance(store, SupportsOffload) or store.offload_threshold is None:
        raise CheckSkipped("adapter does not offload large values (SupportsOffload)")
    return store, store.offload_threshold


async def _payloads(ctx: Context) -> int:
    return await _offloading(ctx)[0].count_payloads()


@_check
async def check_large_values_are_offloaded_and_loaded_wherever_a_job_is_read(
    ctx: Context,
) -> None:
    """Offloaded args, kwargs and results round-trip wherever a whole job is read"""
    _, threshold = _offloading(ctx)
    big = "x" * (threshold + 1)
    small = await _enqueue(ctx.store, args=["x" * (threshold // 2)])
    assert await _payloads(ctx) == 0, "a value within the threshold stays in the row"
    job = await _enqueue(ctx.store, args=[big, 1], kwargs={"k": big}, idempotency_key="big")
    assert (job.args, job.kwargs) == ((big, 1), {"k": big}), "the enqueue returns it whole"
    assert await _payloads(ctx) == 2, "args and kwargs, each over the threshold, moved out"
    again = await ctx.store.enqueue(_spec(args=[big, 1], kwargs={"k": big}, idempotency_key="big"))
    assert again.duplicate and again.job.args == (big, 1), "a duplicate returns the stored one"
    assert await _payloads(ctx) == 2, "a duplicate writes no payload"
    stored = await _get(ctx.store, job.id)
    assert (stored.args, stored.kwargs) == ((big, 1), {"k": big}), "get_job loads them"
    eligible = await ctx.store.select_eligible(modes=ALL_MODES)
    assert {j.id for j in eligible} == {small.id, job.id}, "selection sees offloaded jobs"
    claimed = await _claim(ctx.store, job)
    assert (claimed.args, claimed.kwargs) == ((big, 1), {"k": big}), "the claim loads them"
    [mine] = await ctx.store.handoffs_for_worker(WORKER)
    assert mine.args == (big, 1), "handoffs_for_worker loads them"
    result = {"out": big, "n": [1, 2]}
    assert claimed.handoff_id is not None
    assert not await ctx.store.complete(job.id, uuid.uuid4(), {"stale": big})
    assert await _payloads(ctx) == 2, "a result fenced out writes no payload"
    assert await ctx.store.complete(job.id, claimed.handoff_id, result)
    assert await _payloads(ctx) == 3, "a large result moved out"
    assert (await _get(ctx.store, job.id)).result == result, "get_job loads the result"
    [listed] = [j for j in (await ctx.store.list_jobs(limit=10)).jobs if j.id == job.id]
    assert (listed.args, listed.kwargs, listed.result) == ((big, 1), {"k": big}, result)
    [short] = [
        j
        for j in (await ctx.store.list_jobs(limit=10, include_payload=False)).jobs
        if j.id == job.id
    ]
    assert (short.args, short.kwargs, short.result) == ((), {}, None), "a summary leaves them out"
    cancelled = await ctx.store.cancel(small.id)
    assert cancelled is not None and cancelled.args == ("x" * (threshold // 2),)
    unchanged = await ctx.store.cancel(job.id)
    assert unchanged is not None and unchanged.result == result, "cancel returns them too"


@_check
async def check_offloaded_values_leave_with_their_jobs(ctx: Context) -> None:
    """Offloaded values are pruned with their jobs and never outlive them"""
    _, threshold = _offloading(ctx)
    big = "y" * (threshold + 1)
    ids = []
    for outcome in ("complete", "fail", "cancel", "retried"):
        job = await _claim(ctx.store, await _enqueue(ctx.store, args=[big], max_attempts=1))
        assert job.handoff_id is not None
        if outcome == "complete":
            assert await ctx.store.complete(job.id, job.handoff_id, [big])
        elif outcome == "fail":
            assert await ctx.store.fail(job.id, job.handoff_id, "boom", None)
        elif outcome == "cancel":
            assert await ctx.store.cancel(job.id) is not None
        else:
            assert await ctx.store.fail(job.id, job.handoff_id, "boom", None)
            revived = await ctx.store.retry_dead(job.id)
            assert revived is not None and revived.args == (big,), "revived whole"
            again = await _claim(ctx.store, revived)
            assert again.args == (big,), "a retried job is handed off whole"
            assert await ctx.store.complete(job.id, again.handoff_id or uuid.uuid4(), {"r": big})
            assert (await _get(ctx.store, job.id)).result == {"r": big}
        ids.append(job.id)
    assert await _payloads(ctx) == 6, "one args per job, one result per completed job"
    ctx.clock.advance(60)
    assert await ctx.store.prune(older_than=ctx.clock(), batch_size=2) == 4
    assert await _payloads(ctx) == 0, "pruning a job deletes its offloaded values"


@_check
async def check_large_checkpoints_are_offloaded_replaced_and_pruned(ctx: Context) -> None:
    """A large checkpoint is offloaded, reaches the next attempt, and leaves no payload behind"""
    _, threshold = _offloading(ctx)
    big = {"state": "c" * (threshold + 1)}
    bigger = {"state": "d" * (threshold + 2)}
    job = await _claim(ctx.store, await _enqueue(ctx.store, max_attempts=2))
    lease = job.handoff_id
    assert lease is not None

    async def save(*saves: tuple[uuid.UUID, int, JSONValue]) -> list[bool]:
        return await ctx.store.save_checkpoints([CheckpointSave(job.id, *s) for s in saves])

    assert await save((lease, 1, big)) == [True]
    assert await _payloads(ctx) == 1, "a checkpoint over the threshold moved out of its row"
    assert (await _get(ctx.store, job.id)).checkpoint == big, "get_job loads it"
    [mine] = await ctx.store.handoffs_for_worker(WORKER)
    assert mine.checkpoint == big, "handoffs_for_worker loads it"
    assert await save((uuid.uuid4(), 2, bigger)) == [False]
    assert (await _get(ctx.store, job.id)).checkpoint == big, "a fenced-out save writes nothing"
    assert await save((lease, 2, bigger)) == [True]
    assert await _payloads(ctx) == 1, "a large checkpoint replaces the payload of the last"
    assert await save((lease, 3, {"row": 3}), (uuid.uuid4(), 4, big)) == [True, False]
    assert await _payloads(ctx) == 0, "one kept in its row deletes the payload it replaces"
    assert (await _get(ctx.store, job.id)).checkpoint == {"row": 3}
    assert await save((lease, 4, big), (lease, 5, {"row": 5})) == [True, True]
    assert await _payloads(ctx) == 0, "the newest of a batch counts, and it is small"
    stale = (uuid.uuid4(), 7, big)
    assert await save((lease, 6, {"row": 6}), stale, (lease, 7, bigger)) == [True, False, True]
    assert await _payloads(ctx) == 1, "a stale lease's save in the batch writes no payload"
    assert await ctx.store.fail(job.id, lease, "boom", ctx.clock())
    [again] = await ctx.store.mark_handed_off_many([Claim(job.id, uuid.uuid4(), WORKER)])
    assert (again.checkpoint, again.checkpoint_seq) == (bigger, 7), "the next attempt gets it"
    [full] = (await ctx.store.list_jobs(limit=10)).jobs
    assert full.checkpoint == bigger, "a full listing loads it"
    [short] = (await ctx.store.list_jobs(limit=10, include_payload=False)).jobs
    assert short.checkpoint is None and short.checkpoint_seq == 7, "a summary leaves it out"
    assert again.handoff_id is not None
    assert await ctx.store.complete(job.id, again.handoff_id, None)
    assert (await _get(ctx.store, job.id)).checkpoint == bigger, "a finished job keeps it"
    cancelled = await _claim(ctx.store, await _enqueue(ctx.store))
    assert cancelled.handoff_id is not None
    assert await ctx.store.save_checkpoints(
        [CheckpointSave(cancelled.id, cancelled.handoff_id, 1, big)]
    )
    assert await ctx.store.save_checkpoints(
        [CheckpointSave(cancelled.id, cancelled.handoff_id, 2, bigger)]
    )
    gone = await ctx.store.cancel(cancelled.id)
    assert gone is not None and gone.checkpoint == bigger, "cancel returns it too"
    assert await _payloads(ctx) == 2
    ctx.clock.advance(60)
    assert await ctx.store.prune(older_than=ctx.clock(), batch_size=1) == 2
    assert await _payloads(ctx) == 0, "pruning a job deletes its checkpoint payload"


def _tamperer(ctx: Context) -> TampersPayloads:
    """The harness's way to edit a stored value; skips where there is none."""
    _offloading(ctx)
    if not isinstance(ctx.harness, TampersPayloads):
        raise CheckSkipped("the harness cannot edit stored payloads (TampersPayloads)")
    return ctx.harness


def _flip(text: str) -> str:
    """``text`` with one byte changed, still JSON: only its SHA-256 can tell."""
    at = text.index("x")
    return f"{text[:at]}y{text[at + 1 :]}"


async def _summaries(store: StorageAdapter) -> dict[uuid.UUID, Job]:
    """Every job as a summary listing shows it (which loads no offloaded value)."""
    return {j.id: j for j in (await store.list_jobs(limit=1000, include_payload=False)).jobs}


def _failed_its_check(job: Job, lease: uuid.UUID, kind: str) -> None:
    assert job.status is JobStatus.FAILED, f"a job whose {kind} failed its check is dead"
    assert job.handoff_id == lease, "failed under the lease its claim persisted"
    assert job.last_error is not None and job.last_error.startswith(INTEGRITY_ERROR), (
        f"its error says why: {job.last_error!r}"
    )
    assert kind in job.last_error, f"and names the value: {job.last_error!r}"


@_check
async def check_a_payload_failing_its_check_fails_only_its_job(ctx: Context) -> None:
    """A payload failing its integrity check fails its job dead, never its claim's batch

    A claim hands off the rest of the batch; the job is dead under the claim's lease
    with the error, its slot given back, and a read of the value says why."""
    tamper = _tamperer(ctx)
    _, threshold = _offloading(ctx)
    big = "x" * (threshold + 1)
    edited = await _enqueue(ctx.store, args=[big], concurrency_key="k", concurrency_limit=1)
    not_json = await _enqueue(ctx.store, kwargs={"k": big})
    others = [await _enqueue(ctx.store, args=[big if i % 2 else i]) for i in range(7)]
    await tamper.tamper_payload(edited.id, "args", _flip)
    await tamper.tamper_payload(not_json.id, "kwargs", lambda text: text[:-1], rehash=True)
    batch = [edited, *others[:3], not_json, *others[3:]]
    claims = [Claim(job.id, uuid.uuid4(), WORKER) for job in batch]
    won = await ctx.store.mark_handed_off_many(claims)
    assert [j.id for j in won] == [j.id for j in others], "the rest of the batch is handed off"
    assert [j.handoff_id for j in won] == [
        c.handoff_id for c in claims if c.job_id in {o.id for o in others}
    ]
    assert won[1].args == (big,), "a sound offloaded value in the same batch loads"
    stored = await _summaries(ctx.store)
    _failed_its_check(stored[edited.id], claims[0].handoff_id, "args")
    _failed_its_check(stored[not_json.id], claims[4].handoff_id, "kwargs")
    assert "JSON" in (stored[not_json.id].last_error or ""), "a body that is not JSON says so"
    assert stored[edited.id].attempts == 1, "the attempt that could not start is counted"
    assert await ctx.store.mark_handed_off(edited.id, uuid.uuid4(), WORKER) is None, "never again"
    keyed = await _enqueue(ctx.store, concurrency_key="k", concurrency_limit=1)
    assert (await _claim(ctx.store, keyed)).id == keyed.id, "its concurrency slot came back"
    try:
        await ctx.store.get_job(edited.id)
    except PayloadIntegrityError as exc:
        assert str(edited.id) in str(exc) and INTEGRITY_ERROR in str(exc), str(exc)
        assert exc.job_id == edited.id and exc.kind == "args"
    else:
        raise AssertionError("get_job of a value that fails its check must say so, not load it")


@_check
async def check_offloaded_results_and_checkpoints_are_checked_when_read(ctx: Context) -> None:
    """Offloaded checkpoints and results are checked too, wherever they are loaded

    A checkpoint that fails its check fails the next attempt dead at its claim; a
    result that fails it is an error where it is read, and the job stays as it was."""
    tamper = _tamperer(ctx)
    _, threshold = _offloading(ctx)
    big = {"state": "x" * (threshold + 1)}
    job = await _claim(ctx.store, await _enqueue(ctx.store, max_attempts=3))
    assert job.handoff_id is not None
    assert await ctx.store.save_checkpoints([CheckpointSave(job.id, job.handoff_id, 1, big)])
    assert await ctx.store.fail(job.id, job.handoff_id, "boom", ctx.clock())
    await tamper.tamper_payload(job.id, "checkpoint", _flip)
    lease = uuid.uuid4()
    assert await ctx.store.mark_handed_off_many([Claim(job.id, lease, WORKER)]) == []
    _failed_its_check((await _summaries(ctx.store))[job.id], lease, "checkpoint")
    done = await _claim(ctx.store, await _enqueue(ctx.store))
    assert done.handoff_id is not None
    assert await ctx.store.complete(done.id, done.handoff_id, big)
    assert (await _get(ctx.store, done.id)).result == big
    await tamper.tamper_payload(done.id, "result", lambda text: "{" + text, rehash=True)
    for read in (
        lambda: ctx.store.get_job(done.id),
        lambda: ctx.store.list_jobs(JobFilter(statuses=[JobStatus.COMPLETED]), limit=10),
    ):
        try:
            await read()
        except PayloadIntegrityError as exc:
            assert exc.job_id == done.id and exc.kind == "result", str(exc)
        else:
            raise AssertionError("a result that fails its check must be an error where read")
    assert (await _summaries(ctx.store))[done.id].status is JobStatus.COMPLETED, "kept as it was"


# --- lifecycle and capabilities ------------------------------------------------------


@_check
async def check_setup_is_idempotent_and_data_survives_reopening(ctx: Context) -> None:
    job = await _enqueue(ctx.store)
    await ctx.store.setup()
    ctx.require("shared_between_processes")
    other = await ctx.peer()
    await other.setup()
    assert (await _get(other, job.id)).id == job.id


@_check
async def check_listen_wakes_on_an_enqueue_from_another_handle(ctx: Context) -> None:
    ctx.require("listen_notify")
    store = ctx.store
    assert isinstance(store, SupportsNotify)
    woken = asyncio.Event()
    async with store.listen(woken.set):
        other = await ctx.peer()
        await _enqueue(other)
        await asyncio.wait_for(woken.wait(), timeout=5)


@_check
async def check_enqueue_handed_off_applies_only_the_claims_it_may(ctx: Context) -> None:
    """The optional hand-off at enqueue: a fresh, due job without a concurrency key is
    stored handed off under exactly its claim's lease and settles under it; a duplicate, a
    job not due and a keyed job are stored (or returned) untouched, their claims unwon."""
    store = ctx.store
    if not isinstance(store, SupportsEnqueueHandedOff):
        raise CheckSkipped("adapter does not offer enqueue_handed_off")
    existing = await _enqueue(store, idempotency_key="taken")
    fresh, later, keyed = (
        _spec(),
        _spec(run_at=START + timedelta(minutes=5)),
        _spec(concurrency_key="k", concurrency_limit=1),
    )
    dup = _spec(idempotency_key="taken")
    specs = [fresh, later, keyed, dup]
    claims = [Claim(spec.id, uuid.uuid4(), "worker-9") for spec in specs]
    results = await store.enqueue_handed_off(specs, claims)
    assert [r.duplicate for r in results] == [False, False, False, True]
    assert results[0].job.status is JobStatus.HANDED_OFF
    assert results[0].job.handoff_id == claims[0].handoff_id
    stored = await _get(store, fresh.id)
    assert stored.status is JobStatus.HANDED_OFF and stored.handoff_id == claims[0].handoff_id
    assert stored.worker_id == "worker-9" and stored.handed_off_at == START
    for result in results[1:3]:
        assert result.job.status is JobStatus.QUEUED and result.job.handoff_id is None
    assert results[3].job.id == existing.id and results[3].job.handoff_id is None
    assert [j.id for j in await store.handoffs_for_worker("worker-9")] == [fresh.id]
    assert not await store.complete(fresh.id, uuid.uuid4())  # fenced like any claim
    assert await store.complete(fresh.id, claims[0].handoff_id, result=1)
    assert (await _get(store, fresh.id)).status is JobStatus.COMPLETED
    # An unknown outcome is recovered as for a claim: the exact lease goes back.
    other = _spec()
    lease = uuid.uuid4()
    await store.enqueue_handed_off([other], [Claim(other.id, lease, WORKER)])
    assert await store.return_to_queue(other.id, lease)
    assert (await _get(store, other.id)).status is JobStatus.QUEUED


@_check
async def check_enqueue_columns_stores_what_its_specs_would(ctx: Context) -> None:
    """The optional bulk enqueue by column: every job of every chunk stored, in order, as
    ``enqueue_many`` of its spec stores it (queued, at the store's clock, the template's
    options and its own arguments and id), more than 1,000 at once too; the ids
    returned are the jobs'. A chunk that raises as it is taken refuses the whole:
    nothing of the chunks before it is stored."""
    store = ctx.store
    if not isinstance(store, SupportsEnqueueColumns):
        raise CheckSkipped("adapter does not offer enqueue_columns")
    template = _spec(queue="bulk", priority=3, max_attempts=2)
    first, second = (
        SpecColumns.of(template, [[i] for i in part], [{"k": i} for i in part])
        for part in (range(1000), range(1000, 1500))
    )
    assert await store.enqueue_columns(iter([first, second]), 1500) == first.ids + second.ids
    specs = first.specs() + second.specs()
    for spec in (specs[0], specs[999], specs[-1]):
        assert await _get(store, spec.id) == Job.from_spec(spec, START)
    page = await store.list_jobs(JobFilter(queues=["bulk"]), limit=1501)
    assert len(page.jobs) == 1500

    def refused() -> Iterator[SpecColumns]:
        yield SpecColumns.of(_spec(queue="refused"), [[i] for i in range(1000)])
        raise InvalidJobError("the second chunk is refused")

    try:
        await store.enqueue_columns(refused(), 2000)
    except InvalidJobError:
        pass
    else:
        raise AssertionError("a chunk's refusal did not reach the caller")
    assert not (await store.list_jobs(JobFilter(queues=["refused"]), limit=1)).jobs


# --- several mains: the election and the epoch fence ----------------------------------


def _leadership(ctx: Context, store: StorageAdapter) -> SupportsLeadership:
    ctx.require("leader_election")
    assert isinstance(store, SupportsLeadership), (
        "an adapter declaring leader_election implements SupportsLeadership"
    )
    return store


@_check
async def check_one_leader_until_its_lease_runs_out_or_it_resigns(ctx: Context) -> None:
    """One main holds the leader row at a time: a live lease is neither taken over nor
    renewed by another, and a takeover (after the lease, or a resignation) grows the
    epoch, after which the old holder's renewal is refused."""
    a = _leadership(ctx, ctx.store)
    b = _leadership(ctx, await ctx.peer())
    first = await a.elect("main-a", "a.example:7600", 60)
    assert first is not None and (first.holder, first.live) == ("main-a", True)
    seen = await b.elect("main-b", "b.example:7600", 60)
    assert seen == first, "a live lease is not taken over; the answer names the leader"
    assert await a.renew("main-a", first.epoch, 60)
    assert not await b.renew("main-b", first.epoch, 60), "only the holder renews"
    await a.resign("main-a", first.epoch)
    taken = await b.elect("main-b", "b.example:7600", 60)
    assert taken is not None and (taken.holder, taken.address) == ("main-b", "b.example:7600")
    assert taken.epoch == first.epoch + 1 and taken.live
    assert not await a.renew("main-a", first.epoch, 60), "the old leader learns it is deposed"


@_check
async def check_a_lease_that_ran_out_is_renewed_unless_another_main_took_over(
    ctx: Context,
) -> None:
    """A holder paused past its lease keeps it while the row still names it (nobody led
    meanwhile, so a main with no standby goes on instead of exiting); once another main
    took over, or the holder resigned, its renewal is refused. A lease of 0 s has run
    out by the store's clock at the next call."""
    a = _leadership(ctx, ctx.store)
    b = _leadership(ctx, await ctx.peer())
    first = await a.elect("main-a", "a.example:7600", 0)
    assert first is not None and first.holder == "main-a"
    assert await a.renew("main-a", first.epoch, 0), "run out, nobody took over: renewed"
    taken = await b.elect("main-b", "b.example:7600", 60)
    assert taken is not None and (taken.holder, taken.epoch) == ("main-b", first.epoch + 1)
    assert not await a.renew("main-a", first.epoch, 60), "main-b took over"
    await b.resign("main-b", taken.epoch)
    assert not await b.renew("main-b", taken.epoch, 60), "a resigned lease stays resigned"
    again = await a.elect("main-c", "c.example:7600", 60)
    assert again is not None and again.holder == "main-c", "the resigned row is free"


@_check
async def check_a_deposed_leader_changes_nothing(ctx: Context) -> None:
    """Under an older epoch, every claim and settle (return and hand-off at enqueue
    included) raises DeposedError, reports it to the fence's callback and changes
    nothing; the new leader settles the lease the old one granted, as it adopts it."""
    old = _leadership(ctx, ctx.store)
    new = _leadership(ctx, await ctx.peer())
    elected = await old.elect("main-old", "old:7600", 0)  # a lease run out at once
    assert elected is not None
    refused: list[str] = []
    old.fence(elected.epoch, refused.append)
    store = ctx.store
    running = await _claim(store, await _enqueue(store))  # the leader's own claims pass
    waiting = await _enqueue(store)
    keyed = await _enqueue(store, concurrency_key="k", concurrency_limit=2)
    takeover = await new.elect("main-new", "new:7600", 60)
    assert takeover is not None and takeover.epoch == elected.epoch + 1
    new.fence(takeover.epoch)
    assert running.handoff_id is not None
    attempts: list[Callable[[], Awaitable[object]]] = [
        lambda: store.mark_handed_off_many([Claim(waiting.id, uuid.uuid4(), WORKER)]),
        lambda: store.mark_handed_off(keyed.id, uuid.uuid4(), WORKER),
        lambda: store.complete(running.id, running.handoff_id, "stale"),  # type: ignore[arg-type]
        lambda: store.return_to_queue(running.id, running.handoff_id),  # type: ignore[arg-type]
    ]
    fresh = _spec()
    if isinstance(store, SupportsEnqueueHandedOff):
        attempts.append(
            lambda: store.enqueue_handed_off([fresh], [Claim(fresh.id, uuid.uuid4(), WORKER)])
        )
    for attempt in attempts:
        try:
            await attempt()
        except DeposedError:
            continue
        raise AssertionError("a deposed leader's claim or settle went through")
    assert len(refused) == len(attempts), refused
    peer = ctx._peers[0]
    assert await peer.get_job(fresh.id) is None, "the fenced enqueue stored nothing"
    for job in (waiting, keyed):
        assert (await _get(peer, job.id)).status is JobStatus.QUEUED
    assert (await _get(peer, running.id)).handoff_id == running.handoff_id
    assert await peer.complete(running.id, running.handoff_id, "done")
    assert (await _get(peer, running.id)).status is JobStatus.COMPLETED
