"""The dispatcher's pipelining and the core's spreading of ties, on the memory adapter with a
claim that can be held open: a pass runs while an earlier claim is still in flight, no job
is claimed twice, the number of claims in flight is capped, a pass does not read the jobs
being claimed again for fewer new ones, a read asks for no more jobs than one mode can
take, and workers with equal credit share the jobs."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Collection, Sequence

from adapters.memory import MemoryAdapter
from broker import protocol
from broker.dispatch import Dispatcher
from broker.handoff import Dispatch, Handoff, HandoffEffect, LeaseMinter
from broker.jobs import Claim, ExecutionMode, Job, JobSpec, utcnow

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


class CountedReads(HeldClaims):
    """Held claims, and the limit of every read of eligible jobs."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[int] = []

    async def select_eligible(
        self,
        *,
        modes: Collection[ExecutionMode],
        queues: Collection[str] | None = None,
        limit: int = 100,
    ) -> list[Job]:
        self.reads.append(limit)
        return await super().select_eligible(modes=modes, queues=queues, limit=limit)


def worker(core: Handoff, peer_id: int, slots: int, inline: int = 0) -> None:
    peer = core.new_peer(peer_id, 0.0)
    core.hello(
        peer,
        protocol.Hello(
            role=protocol.Role.WORKER,
            protocol=protocol.PROTOCOL_VERSION,
            worker_id=f"w{peer_id}",
            modes=[POOLED, ExecutionMode.INLINE] if inline else [POOLED],
        ),
    )
    core.ready(peer_id, {POOLED: slots, ExecutionMode.INLINE: inline}, seen=0)


def dispatcher(store: MemoryAdapter, core: Handoff, sent: list[Dispatch], **kw: int) -> Dispatcher:
    def carry(effects: Sequence[HandoffEffect]) -> None:
        sent.extend(e for e in effects if isinstance(e, Dispatch))

    return Dispatcher(
        store,
        core,
        carry=carry,
        stopping=lambda: False,
        clock=utcnow,
        claim_batch=kw.get("claim_batch", 4),
        poll_interval=0.05,
        notify_fallback_interval=1.0,
        retry_interval=0.05,
        max_claims_in_flight=kw.get("max_claims_in_flight", 2),
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


async def test_a_pass_does_not_read_the_jobs_being_claimed_again_for_fewer_new_ones() -> None:
    """Two slots free up while a claim of eight is in flight: a pass now would read ten
    jobs to plan two, so it waits for the claim's answer and then reads just the two."""
    store = CountedReads()
    await store.enqueue_many([JobSpec(task="t") for _ in range(12)])
    core = Handoff()
    worker(core, 1, 8)
    sent: list[Dispatch] = []
    d = dispatcher(store, core, sent, claim_batch=8)
    await d.dispatch_once()
    assert len(await store.started.get()) == 8  # held open
    core.ready(1, {POOLED: 10}, seen=0)
    assert not await d.dispatch_once()
    assert store.reads == [8]
    store.release.release()
    while len(sent) < 8:
        await asyncio.sleep(0)
    await d.dispatch_once()
    assert store.reads == [8, 2]
    assert len(await store.started.get()) == 2
    store.release.release()
    while len(sent) < 10:
        await asyncio.sleep(0)


async def test_a_read_asks_for_no_more_jobs_than_the_mode_with_most_free_slots() -> None:
    """Four pooled and three inline slots free, only pooled jobs queued: one read of four
    plans them all (reading seven would decode three rows for nothing, and leave the
    inline slots to a read of their own)."""
    store = CountedReads()
    await store.enqueue_many([JobSpec(task="t") for _ in range(10)])
    core = Handoff()
    worker(core, 1, 4, inline=3)
    sent: list[Dispatch] = []
    d = dispatcher(store, core, sent, claim_batch=8)
    await d.dispatch_once()
    assert len(await store.started.get()) == 4
    assert store.reads == [4]
    store.release.release()
    while len(sent) < 4:
        await asyncio.sleep(0)


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


def test_minted_leases_are_distinct_version_4_uuids() -> None:
    mint = LeaseMinter()
    leases = [mint() for _ in range(1000)]
    assert len(set(leases)) == 1000
    assert {lease.version for lease in leases} == {4}
