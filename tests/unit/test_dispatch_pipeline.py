"""The dispatcher's pipelining and the core's spreading of ties, on the memory adapter with a
claim that can be held open: a pass runs while an earlier claim is still in flight, no job
is claimed twice, the number of claims in flight is capped, a read leaves out the jobs
being claimed and asks for no more jobs than one mode can take, and workers with equal
credit share the jobs."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters.memory import MemoryAdapter
from broker.core import pacing
from broker.core.drained import CHANGE_LOG
from broker.core.handoff import LINE, Dispatch, Handoff, HandoffEffect, pass_size
from broker.jobs import (
    Claim,
    ExecutionMode,
    Job,
    JobSpec,
    utcnow,
)
from broker.main.dispatcher import Dispatcher
from broker.wire import messages as protocol
from tests.unit.test_handoff import won

POOLED = ExecutionMode.POOLED


class HeldClaims(MemoryAdapter):
    """Claims wait for the test to let them through, one ``release`` per claim call."""

    def __init__(self) -> None:
        super().__init__()
        self.started: asyncio.Queue[Sequence[Claim]] = asyncio.Queue()
        self.release = asyncio.Semaphore(0)

    async def mark_handed_off_many(self, claims: Sequence[Claim]) -> list[Job]:
        self.started.put_nowait(claims)
        await self.release.acquire()
        return await super().mark_handed_off_many(claims)


def worker(
    core: Handoff,
    peer_id: int,
    slots: int,
    prefetch_modes: Sequence[ExecutionMode] = (),
    **others: int,
) -> None:
    """A worker with ``slots`` pooled slots free, and ``others`` of the modes they name
    (``inline=3``): it serves those modes alone; ``prefetch_modes`` have a window (their
    last credit is kept for a job that overtakes no waiting job)."""
    credits = {POOLED: slots, **{ExecutionMode(mode): n for mode, n in others.items()}}
    peer = core.new_peer(peer_id, 0.0)
    core.hello(
        peer,
        protocol.Hello(
            role=protocol.Role.WORKER,
            protocol=protocol.PROTOCOL_VERSION,
            worker_id=f"w{peer_id}",
            modes=list(credits),
            prefetch_modes=list(prefetch_modes),
        ),
    )
    core.ready(peer_id, credits, seen=0)


def _still() -> float:
    """The loop's clock as the dispatcher sees it here: standing still, so that a pass's
    read-ahead never ages between two steps of a test, however slow the machine."""
    return 1000.0


def dispatcher(
    store: MemoryAdapter,
    core: Handoff,
    sent: list[Dispatch],
    now: Callable[[], float] = _still,
    **kw: float,
) -> Dispatcher:
    def carry(effects: Sequence[HandoffEffect]) -> None:
        sent.extend(e for e in effects if isinstance(e, Dispatch))

    return Dispatcher(
        store,
        core,
        carry=carry,
        stopping=lambda: False,
        clock=utcnow,
        claim_batch=int(kw.get("claim_batch", 4)),
        poll_interval=kw.get("poll_interval", 0.05),
        notify_fallback_interval=1.0,
        retry_interval=0.05,
        now=now,
        max_claims_in_flight=int(kw.get("max_claims_in_flight", 2)),
    )


async def test_a_pass_reads_and_claims_while_an_earlier_claim_is_in_flight() -> None:
    store = HeldClaims()
    await store.enqueue_many([JobSpec(task="t") for _ in range(8)])
    core = Handoff()
    worker(core, 1, 8)
    sent: list[Dispatch] = []
    run = asyncio.create_task(dispatcher(store, core, sent).run())
    first = await store.started.get()
    second = await store.started.get()  # started while the first is still held
    assert len(first) == len(second) == 4
    assert not {c.job_id for c in first} & {c.job_id for c in second}
    assert store.started.empty()  # the cap: no third claim while two are out
    store.release.release()
    store.release.release()
    while len(sent) < 8:
        await asyncio.sleep(0)
    assert len({d.job.id for d in sent}) == 8
    assert core.credit() == 0 and not core.claiming
    run.cancel()


async def test_the_claims_in_flight_are_capped_and_the_first_answer_wakes_a_pass() -> None:
    store = HeldClaims()
    await store.enqueue_many([JobSpec(task="t") for _ in range(6)])
    core = Handoff()
    worker(core, 1, 6)
    sent: list[Dispatch] = []
    run = asyncio.create_task(
        dispatcher(store, core, sent, claim_batch=2, max_claims_in_flight=1).run()
    )
    claims = [await store.started.get()]
    assert store.started.empty()
    for _ in range(2):
        store.release.release()
        claims.append(await store.started.get())  # the answer woke the next pass
    store.release.release()
    while len(sent) < 6:
        await asyncio.sleep(0)
    assert [len(c) for c in claims] == [2, 2, 2]
    assert len({d.job.id for d in sent}) == 6
    run.cancel()


class CountedReads(HeldClaims):
    """Notes how many claims were held open at each read of the next run time."""

    def __init__(self) -> None:
        super().__init__()
        self.held = 0
        self.next_run_reads: list[int] = []
        self.next_run_read = asyncio.Event()

    async def mark_handed_off_many(self, claims: Sequence[Claim]) -> list[Job]:
        self.held += 1
        try:
            return await super().mark_handed_off_many(claims)
        finally:
            self.held -= 1

    async def next_run_at(self, **kw: object) -> datetime | None:
        self.next_run_reads.append(self.held)
        self.next_run_read.set()
        return await super().next_run_at(**kw)  # type: ignore[arg-type]


async def test_no_next_run_read_while_a_claim_is_in_flight() -> None:
    """The claim's answer wakes the dispatcher anyway: reading the next run time while it
    is out cost the store a scan of the queued rows per pass for nothing."""
    store = CountedReads()
    await store.enqueue_many([JobSpec(task="t")])
    core = Handoff()
    worker(core, 1, 4)  # credit left after the pass: the dispatcher would sleep on a timer
    sent: list[Dispatch] = []
    run = asyncio.create_task(dispatcher(store, core, sent).run())
    await store.started.get()
    store.release.release()
    await store.next_run_read.wait()
    assert store.next_run_reads == [0], store.next_run_reads
    assert len(sent) == 1
    run.cancel()


class CountedSelects(MemoryAdapter):
    def __init__(self) -> None:
        super().__init__()
        self.selects: list[tuple[set[ExecutionMode], int]] = []

    async def select_eligible(self, **kw: Any) -> list[Job]:
        self.selects.append((set(kw["modes"]), kw["limit"]))
        return await super().select_eligible(**kw)


async def test_reads_ask_for_the_largest_free_credit_and_the_modes_left_are_read_once() -> None:
    """A pooled backlog; the worker's inline and forked slots are free too. The first
    read asks for the largest free credit of one mode (3), not their sum (6): a job
    takes a slot of its own mode. It fills with pooled jobs, of which two have a slot:
    one more read for the inline and forked modes together, not one per mode, and as
    it comes back short, the pass reports no more work."""
    store = CountedSelects()
    await store.enqueue_many([JobSpec(task="t") for _ in range(12)])
    core = Handoff()
    worker(core, 1, 2, inline=3, forked=1)
    assert not await dispatcher(store, core, [], claim_batch=8).dispatch_once()
    assert store.selects == [
        (set(ExecutionMode), 3),
        ({ExecutionMode.INLINE, ExecutionMode.FORKED}, 3),
    ]


async def test_a_fleet_wider_than_the_batch_takes_a_line_per_worker_in_one_pass() -> None:
    """64 workers with eight free credits each, a claim batch of 256: one pass places
    all 512 jobs, eight to each worker, instead of four to each (the batch spread over
    them) and the other four a pass later, in a second line."""
    store = HeldClaims()
    await store.enqueue_many([JobSpec(task="t") for _ in range(600)])
    core = Handoff()
    for peer_id in range(1, 65):
        worker(core, peer_id, 8)
    d = dispatcher(store, core, [], claim_batch=256)
    assert not await d.dispatch_once()  # every credit taken: no more work this pass
    claims = await store.started.get()
    assert len(claims) == 512
    assert set(Counter(claim.worker_id for claim in claims).values()) == {8}
    assert core.credit() == 0
    store.release.release()


async def test_a_pass_over_a_wide_fleet_gives_each_worker_a_line_at_most() -> None:
    """16 workers with more free credit than a line each: one pass places a line (LINE
    jobs) on each, not all of their credit (the batch, 256, is below 16 lines)."""
    store = HeldClaims()
    await store.enqueue_many([JobSpec(task="t") for _ in range(1000)])
    core = Handoff()
    for peer_id in range(1, 17):
        worker(core, peer_id, LINE + 8)
    d = dispatcher(store, core, [], claim_batch=256)
    assert await d.dispatch_once()  # credit is left, and the read came back full
    claims = await store.started.get()
    assert len(claims) == 16 * LINE > 256
    assert set(Counter(claim.worker_id for claim in claims).values()) == {LINE}
    store.release.release()


@given(
    batch=st.integers(1, 300),
    credits=st.lists(st.integers(0, 3 * LINE), max_size=80),
)
def test_a_pass_takes_the_batch_or_a_line_per_worker_and_never_more_than_the_credit(
    batch: int, credits: list[int]
) -> None:
    """:func:`pass_size`: never more than the credit; all of it up to the batch; a line
    (or the credit under it) for every worker, a line being at most the batch; and never
    more than a line per worker beyond the batch, so one worker's pass is the batch, as
    before."""
    size = pass_size(batch, credits)
    total = sum(credits)
    line = min(LINE, batch)
    lines = sum(min(credit, line) for credit in credits)
    assert size <= total
    assert size >= min(total, batch)
    assert size >= lines
    assert size <= max(batch, line * len(credits))
    if lines <= batch:
        assert size == min(total, batch)


class SeenReads(HeldClaims):
    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[int, set[uuid.UUID]]] = []

    async def select_eligible(self, **kw: Any) -> list[Job]:
        self.reads.append((kw["limit"], set(kw["skip"])))
        return await super().select_eligible(**kw)


async def test_a_read_during_a_claim_leaves_the_claimed_jobs_out() -> None:
    """The store still shows the jobs being claimed queued: the read skips them rather
    than returning them for the plan to pass over."""
    store = SeenReads()
    await store.enqueue_many([JobSpec(task="t") for _ in range(8)])
    core = Handoff()
    worker(core, 1, 8)
    run = asyncio.create_task(dispatcher(store, core, []).run())
    first = await store.started.get()
    await store.started.get()
    assert store.reads[:2] == [(4, set()), (4, {c.job_id for c in first})]
    store.release.release()
    store.release.release()
    run.cancel()


def test_workers_with_equal_credit_take_turns() -> None:
    """Steady state under load: every worker has the same free credit each time a job
    comes up (its previous job just finished), so only the tie rule decides."""
    core = Handoff()
    for peer_id in range(1, 5):
        worker(core, peer_id, 4)
    store = MemoryAdapter()
    results = asyncio.run(store.enqueue_many([JobSpec(task="t") for _ in range(40)]))
    per_worker: Counter[str] = Counter()
    for result in results:
        [planned] = core.plan([result.job], 0.0)
        per_worker[planned.worker_id] += 1
        core.claim_unknown([planned])  # frees the credit again, as a finished job does
    assert per_worker == {"w1": 10, "w2": 10, "w3": 10, "w4": 10}


class Observed(MemoryAdapter):
    """Notes the modes of every read of eligible jobs and counts next run time reads."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[set[ExecutionMode]] = []
        self.next_run_reads = 0

    async def select_eligible(self, **kw: Any) -> list[Job]:
        self.reads.append(set(kw["modes"]))
        return await super().select_eligible(**kw)

    async def next_run_at(self, **kw: Any) -> datetime | None:
        self.next_run_reads += 1
        return await super().next_run_at(**kw)


async def listening(d: Dispatcher) -> asyncio.Task[None]:
    """The dispatcher's listener, once the store's notifications are live."""
    task = asyncio.create_task(d.listen())
    while not d.pacing.listening:
        await asyncio.sleep(0)
    return task


async def dispatched(d: Dispatcher, sent: list[Dispatch], n: int) -> None:
    """One pass, and its claim answered with ``n`` jobs sent in all."""
    await d.dispatch_once()
    while len(sent) < n:
        await asyncio.sleep(0)


async def test_a_freed_slot_does_not_read_the_modes_proven_drained_again() -> None:
    """A pooled backlog; the worker's inline slots are free all along. Once a read has
    found no inline job, a slot freed (a nudge) reads the pooled backlog alone; an insert
    (a wake) may have brought an inline job, so the next pass reads inline again. In a
    pooled drain, those empty reads were most of the dispatcher's reads."""
    store = Observed()
    await store.enqueue_many([JobSpec(task="t") for _ in range(8)])
    core = Handoff()
    worker(core, 1, 2, inline=3)
    sent: list[Dispatch] = []
    d = dispatcher(store, core, sent)
    listener = await listening(d)
    await dispatched(d, sent, 2)
    assert store.reads == [{POOLED, ExecutionMode.INLINE}, {ExecutionMode.INLINE}]
    assert ExecutionMode.INLINE in core.drained
    core.ready(1, {POOLED: 2, ExecutionMode.INLINE: 3}, seen=2)  # two jobs finished
    d.nudge()
    await dispatched(d, sent, 4)
    assert store.reads[2:] == [{POOLED}]
    core.ready(1, {POOLED: 2, ExecutionMode.INLINE: 3}, seen=4)
    d.wake()
    await dispatched(d, sent, 6)
    assert store.reads[3:] == [{POOLED, ExecutionMode.INLINE}, {ExecutionMode.INLINE}]
    listener.cancel()


async def test_without_notifications_a_busy_dispatcher_still_polls_the_drained_modes() -> None:
    """Without live notifications, another process's inline job is found only by
    reading: past the poll interval (here none) a pass reads the drained modes again,
    even though freed slots alone keep waking it."""
    store = Observed()
    await store.enqueue_many([JobSpec(task="t") for _ in range(8)])
    core = Handoff()
    worker(core, 1, 2, inline=3)
    sent: list[Dispatch] = []
    d = dispatcher(store, core, sent, poll_interval=0)
    await dispatched(d, sent, 2)
    core.ready(1, {POOLED: 2, ExecutionMode.INLINE: 3}, seen=2)
    d.nudge()
    await dispatched(d, sent, 4)
    assert store.reads[2:] == [{POOLED, ExecutionMode.INLINE}, {ExecutionMode.INLINE}]


async def test_the_dispatcher_listens_only_while_a_worker_has_a_free_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A notification helps only a main that can hand the job off: with no free slot the
    dispatcher stops listening (after ``LISTEN_LINGER``, here none), so producers writing
    to the store do not wake it. A job inserted meanwhile is not lost: listening again
    starts with a wake, which forgets the modes proven drained."""
    monkeypatch.setattr(pacing, "LISTEN_LINGER", 0.0)
    store = Observed()
    core = Handoff()
    d = dispatcher(store, core, [])
    listener = asyncio.create_task(d.listen())
    for _ in range(5):
        await asyncio.sleep(0)
    assert not d.pacing.listening and not store._listeners  # no worker: nobody to wake
    worker(core, 1, 2)
    d.nudge()  # a ready: free credit
    while not d.pacing.listening:
        await asyncio.sleep(0)
    assert store._listeners
    core.read_eligible(core.queue_changes, {POOLED}, full=False, queues=None)
    assert POOLED in core.drained
    core.draining(1)  # the only worker stops taking jobs
    d.nudge()
    while d.pacing.listening:
        await asyncio.sleep(0)
    assert not store._listeners
    await store.enqueue_many([JobSpec(task="t")])  # unannounced: nobody listens
    assert POOLED in core.drained
    worker(core, 2, 2)
    d.nudge()
    while not d.pacing.listening:
        await asyncio.sleep(0)
    assert POOLED not in core.drained  # the next pass reads the queue again
    listener.cancel()
    await asyncio.gather(listener, return_exceptions=True)


async def test_with_no_free_slot_a_wake_costs_no_pass_and_loses_no_job() -> None:
    """Every enqueue wakes the dispatcher; while no worker has a free slot the pass is
    left out. The job enqueued meanwhile goes out with the first slot freed."""
    store = Observed()
    core = Handoff()
    sent: list[Dispatch] = []
    d = dispatcher(store, core, sent)
    passes = 0
    real = d.dispatch_once

    async def counted() -> bool:
        nonlocal passes
        passes += 1
        return await real()

    d.dispatch_once = counted  # type: ignore[method-assign]
    run = asyncio.create_task(d.run())
    while passes == 0:  # the first pass, at start
        await asyncio.sleep(0)
    [result] = await store.enqueue_many([JobSpec(task="t")])
    for _ in range(3):
        d.wake()
        for _ in range(5):
            await asyncio.sleep(0)
    assert passes == 1
    worker(core, 1, 2)
    d.nudge()  # a ready: a slot free
    while not sent:
        await asyncio.sleep(0)
    assert sent[0].job.id == result.job_id
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)


async def test_a_cancellation_that_comes_with_a_wake_still_ends_the_loops() -> None:
    """The main stops its dispatcher and listener by cancelling them. A wake in the same
    instant (a report, an insert) must not swallow the cancellation: on Python 3.11,
    ``asyncio.wait_for`` returned the woken wait instead, and the loop ran on."""
    store = Observed()
    core = Handoff()
    worker(core, 1, 2)
    d = dispatcher(store, core, [])
    run = asyncio.create_task(d.run())
    listener = await listening(d)
    while store.next_run_reads == 0:  # the dispatcher is idle, waiting to be woken
        await asyncio.sleep(0)
    for task in (run, listener):
        d.wake()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_a_settled_report_counts_as_a_change_only_when_a_job_may_be_eligible() -> None:
    """A completion of a job without a concurrency key makes nothing eligible: the modes
    proven drained stay so. A release puts its job back in the queue, and a keyed
    completion frees a slot of its key: either is a change."""
    specs = [
        JobSpec(task="t"),
        JobSpec(task="t"),
        JobSpec(task="t", concurrency_key="k", concurrency_limit=1),
    ]
    core = Handoff()
    worker(core, 1, 4)
    plan = core.plan([Job.from_spec(spec, utcnow()) for spec in specs], 0.0)
    core.claimed(plan, [won(planned) for planned in plan])
    core.read_eligible(core.queue_changes, [POOLED], full=False, queues=None)
    assert POOLED in core.drained
    [first, second, keyed] = plan
    applied = protocol.AckStatus.APPLIED

    def settle(report: protocol.Report) -> None:
        core.report(1, report)
        core.settled([(1, report, applied)])

    settle(protocol.CompletedReport(job_id=first.job.id, handoff_id=first.lease))
    assert POOLED in core.drained
    settle(protocol.CompletedReport(job_id=keyed.job.id, handoff_id=keyed.lease))
    assert not core.drained
    core.read_eligible(core.queue_changes, [POOLED], full=False, queues=None)
    settle(protocol.ReleaseReport(job_id=second.job.id, handoff_id=second.lease, reason="x"))
    assert not core.drained


def test_a_claim_that_does_not_win_its_job_counts_as_a_change() -> None:
    """The reads during the claim skipped its job, which may still be queued: a mode is
    no longer proven drained once the claim comes back without it."""
    core = Handoff()
    worker(core, 1, 2)
    [planned] = core.plan([Job.from_spec(JobSpec(task="t"), utcnow())], 0.0)
    core.read_eligible(core.queue_changes, [POOLED], full=False, queues=None)
    assert POOLED in core.drained
    core.claimed([planned], [])
    assert not core.drained


class ReadSizes(MemoryAdapter):
    """Notes the limit of every read of eligible jobs."""

    def __init__(self) -> None:
        super().__init__()
        self.limits: list[int] = []

    async def select_eligible(self, **kw: Any) -> list[Job]:
        self.limits.append(kw["limit"])
        return await super().select_eligible(**kw)


async def finish(core: Handoff, sent: list[Dispatch], slots: int) -> None:
    """Every job sent so far completes: settled, and its slot advertised free again."""
    applied = protocol.AckStatus.APPLIED
    for d in sent:
        if d.job.handoff_id is not None and core.held_job(d.job.handoff_id) is not None:
            report = protocol.CompletedReport(job_id=d.job.id, handoff_id=d.job.handoff_id)
            core.report(1, report)
            core.settled([(1, report, applied)])
    core.ready(1, {POOLED: slots}, seen=len(sent))


async def steady_drain() -> tuple[ReadSizes, Handoff, list[Dispatch], Dispatcher]:
    """A backlog of 40 drained two slots at a time, 10 passes: 20 jobs sent and done."""
    store = ReadSizes()
    await store.enqueue_many([JobSpec(task="t") for _ in range(40)])
    core = Handoff()
    worker(core, 1, 2)
    sent: list[Dispatch] = []
    d = dispatcher(store, core, sent, claim_batch=8)
    for n in range(2, 22, 2):
        await dispatched(d, sent, n)
        await finish(core, sent, 2)
        d.nudge()
    return store, core, sent, d


async def test_a_steady_drain_reads_ahead_and_a_change_reads_the_store_again() -> None:
    """A backlog drained two slots at a time: while nothing changes in the queue, a read
    that ran out is followed by one twice its size (up to the claim batch), and the
    passes between take their jobs from it. An insert (a wake) makes the next pass read
    the store again, asking only for what it needs, so the higher-priority job inserted
    goes next."""
    store, _, sent, d = await steady_drain()
    # 2 jobs per pass, 10 passes: reads of 2, 4, 8 and 8 cover the 20 jobs.
    assert store.limits == [2, 4, 8, 8]
    [urgent] = await store.enqueue_many([JobSpec(task="t", priority=5)])
    d.wake()
    await dispatched(d, sent, 22)
    assert store.limits[4:] == [2]
    assert urgent.job.id in {s.job.id for s in sent[20:]}
    assert len({s.job.id for s in sent}) == 22  # no job sent twice


async def test_an_enqueue_behind_the_read_ahead_keeps_it_and_one_ahead_goes_express() -> None:
    """The main's own enqueue of a job that stands after everything the read-ahead holds
    leaves it serving: producers enqueueing one job at a time while the workers drain
    cost no read each. A job that stands before (a higher priority) takes its place in
    the read-ahead and makes the next pass an express one (issue 35): it claims that one
    job alone, without a read, and the read-ahead goes on serving the backlog."""
    store, core, sent, d = await steady_drain()
    assert store.limits == [2, 4, 8, 8]  # the last read of 8 holds 2 jobs more
    d.enqueued(await store.enqueue_many([JobSpec(task="t")]))
    await dispatched(d, sent, 22)
    assert store.limits == [2, 4, 8, 8]
    await finish(core, sent, 2)
    [urgent] = await store.enqueue_many([JobSpec(task="t", priority=5)])
    d.enqueued([urgent])
    await dispatched(d, sent, 23)
    assert sent[22].job.id == urgent.job.id, "claimed alone, first"
    await dispatched(d, sent, 24)
    assert store.limits[4:] == [8], "the backlog's next read, at the read-ahead's size"
    assert len({s.job.id for s in sent}) == 24  # no job sent twice


@pytest.mark.parametrize("aged", [False, True])
async def test_an_express_pass_takes_the_spare_credit_the_backlog_leaves(aged: bool) -> None:
    """A worker with a prefetch window: the backlog's passes leave its last credit, and
    an urgent job stored queued goes out on it in an express pass, without waiting for
    the worker's next ``ready``; also when the read-ahead had aged (long jobs: no pass
    for a while), which the express pass reads past."""
    store = MemoryAdapter()
    await store.enqueue_many([JobSpec(task="t") for _ in range(10)])
    core = Handoff()
    worker(core, 1, 3, prefetch_modes=[POOLED])
    sent: list[Dispatch] = []
    clock = [1000.0]
    d = dispatcher(store, core, sent, now=lambda: clock[0], claim_batch=8)
    await dispatched(d, sent, 2)
    assert core.credit() == 0 and core.credit(leading=True) == 1
    assert not await d.dispatch_once(), "no pass of the backlog takes the spare"
    if aged:
        clock[0] += 10.0  # far past READ_AHEAD_MAX_AGE
    [urgent] = await store.enqueue_many([JobSpec(task="t", priority=5)])
    d.enqueued([urgent])
    await dispatched(d, sent, 3)
    assert sent[2].job.id == urgent.job.id
    assert core.credit(leading=True) == 0


def test_jobs_added_to_one_mode_leave_the_others_drained() -> None:
    inline = ExecutionMode.INLINE
    core = Handoff()
    core.read_eligible(core.queue_changes, {POOLED, inline}, full=False, queues=None)
    assert core.drained == {POOLED, inline}
    core.jobs_added({POOLED})
    assert core.drained == {inline}
    # A read spanning inserts into other modes only still proves its modes drained,
    started = core.queue_changes
    core.jobs_added({inline})
    core.read_eligible(started, {POOLED}, full=False, queues=None)
    assert core.drained == {POOLED}
    # but not the modes they touched,
    started = core.queue_changes
    core.jobs_added({inline})
    core.read_eligible(started, {inline}, full=False, queues=None)
    assert core.drained == {POOLED}
    # nor any mode across a change of unknown modes (which forgets every drained mode),
    started = core.queue_changes
    core.queue_changed()
    core.read_eligible(started, {POOLED}, full=False, queues=None)
    assert core.drained == set()
    # nor across more changes than are remembered.
    started = core.queue_changes
    for _ in range(CHANGE_LOG + 1):
        core.jobs_added({inline})
    core.read_eligible(started, {POOLED}, full=False, queues=None)
    assert core.drained == set()
    core.read_eligible(core.queue_changes, {POOLED}, full=False, queues=None)
    assert core.drained == {POOLED}


async def test_a_backlog_no_worker_declared_never_hides_the_jobs_behind_it() -> None:
    """Routing by task: 10,000 jobs of a task no connected worker declared stand first in
    the queue; one pass of a worker with one slot still reads and dispatches the job
    behind them, since the read leaves out the tasks nobody declared."""
    store = MemoryAdapter()
    await store.enqueue_many([JobSpec(task="new.task", priority=1) for _ in range(10_000)])
    [behind] = await store.enqueue_many([JobSpec(task="old.task")])
    core = Handoff()
    worker(core, 1, 1)
    core.declared(1, ["old.task"])
    sent: list[Dispatch] = []
    assert await dispatcher(store, core, sent).dispatch_once() is False
    await asyncio.gather(*asyncio.all_tasks() - {asyncio.current_task()})  # the claim
    assert [d.job.id for d in sent] == [behind.job.id]
