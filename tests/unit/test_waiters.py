"""The waiter registry (broker.core.waiters) and its shell's race: a waiter is answered
at most once, every waiter on an ended job is answered, a connection's bound holds, and a
job that ends between the subscription and the read is not missed."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from datetime import UTC, datetime

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from broker.core.waiters import Waiter, Waiters
from broker.exceptions import OverLimitError
from broker.jobs import Job, JobSpec, JobStatus
from broker.main.waits import Waits
from broker.wire import messages as protocol

JOBS = [uuid.UUID(int=n) for n in range(4)]
PEERS = [1, 2, 3]
BOUND = 3


class WaiterMachine(RuleBasedStateMachine):
    """Random subscriptions, ends, answers by timer and disconnects, against a model:
    the set of waiters not answered yet."""

    def __init__(self) -> None:
        super().__init__()
        self.waiters = Waiters(BOUND)
        self.open: dict[tuple[int, str], Waiter] = {}
        self.answered: set[tuple[int, str]] = set()
        self.ids = 0

    def _answer(self, waiter: Waiter) -> None:
        key = (waiter.peer, waiter.request_id)
        assert key not in self.answered, "a waiter was answered twice"
        assert self.open.pop(key) is waiter
        self.answered.add(key)

    @rule(peer=st.sampled_from(PEERS), job=st.sampled_from(JOBS))
    def subscribe(self, peer: int, job: uuid.UUID) -> None:
        self.ids += 1
        rid = f"r{self.ids}"
        mine = sum(1 for p, _ in self.open if p == peer)
        if mine >= BOUND:
            with pytest.raises(OverLimitError):
                self.waiters.subscribe(peer, rid, job, 0.0)
            return
        self.open[peer, rid] = self.waiters.subscribe(peer, rid, job, 0.0)

    @rule(job=st.sampled_from(JOBS))
    def end(self, job: uuid.UUID) -> None:
        expected = {k for k, w in self.open.items() if w.job_id == job}
        assert bool(self.waiters.waited_on([job])) == bool(expected)
        woken = self.waiters.ended(job)
        assert {(w.peer, w.request_id) for w in woken} == expected
        for waiter in woken:
            self._answer(waiter)

    @precondition(lambda self: bool(self.open) or bool(self.answered))
    @rule(data=st.data())
    def take(self, data: st.DataObject) -> None:
        """A timer (or the read after subscribing) answers one waiter, maybe one that a
        notice answered already: then nothing happens."""
        keys = sorted(self.open) + sorted(self.answered)
        key = data.draw(st.sampled_from(keys))
        waiter = self.open.get(key)
        if waiter is None:  # answered: a stale timer finds nothing
            stale = Waiter(key[0], key[1], JOBS[0], 0.0)
            assert not self.waiters.take(stale)
            return
        assert self.waiters.take(waiter)
        self._answer(waiter)
        assert not self.waiters.take(waiter)

    @rule(peer=st.sampled_from(PEERS))
    def disconnect(self, peer: int) -> None:
        self.waiters.disconnected(peer)
        for key in [k for k in self.open if k[0] == peer]:
            del self.open[key]

    @invariant()
    def waited_on_matches_the_model(self) -> None:
        assert set(self.waiters.waited_on(JOBS)) == {w.job_id for w in self.open.values()}


TestWaiterMachine = WaiterMachine.TestCase


def _job(job_id: uuid.UUID, status: JobStatus) -> Job:
    job = Job.from_spec(JobSpec(task="t", id=job_id), datetime(2026, 1, 1, tzinfo=UTC))
    return dataclasses.replace(job, status=status)


class _Session:
    def __init__(self) -> None:
        self.id = 7
        self.replies: list[protocol.Message] = []

    def reply(self, msg: protocol.Message) -> None:
        self.replies.append(msg)


async def test_an_end_between_the_subscription_and_the_read_is_not_missed() -> None:
    """The read saw the job still running; its end was settled (and notified) while the
    read was under way: the notice finds the subscription and answers it."""
    job_id = uuid.uuid4()
    stored = {"job": _job(job_id, JobStatus.HANDED_OFF)}
    session = _Session()
    waits: Waits

    async def read(_: uuid.UUID) -> Job | None:
        before = stored["job"]
        stored["job"] = _job(job_id, JobStatus.COMPLETED)  # settled meanwhile...
        waits.ended([job_id])  # ...and notified, before this read returns
        return before

    waits = Waits(read, lambda _peer: session, per_connection=10)  # type: ignore[arg-type,return-value]
    msg = protocol.WaitJob(request_id="r1", job_id=job_id, timeout=30)
    assert await waits.wait(session, msg) is None  # type: ignore[arg-type]
    while not session.replies:
        await asyncio.sleep(0)  # the notice's read is a task of its own
    [reply] = session.replies
    assert isinstance(reply, protocol.JobInfo) and reply.job is not None
    assert reply.job["status"] == "completed"
    assert not waits.waiters.waited_on([job_id])


async def test_a_waiter_answered_by_its_read_is_not_answered_again_by_a_notice() -> None:
    job_id = uuid.uuid4()
    session = _Session()

    async def read(_: uuid.UUID) -> Job | None:
        return _job(job_id, JobStatus.COMPLETED)

    waits = Waits(read, lambda _peer: session, per_connection=10)  # type: ignore[arg-type,return-value]
    msg = protocol.WaitJob(request_id="r1", job_id=job_id, timeout=30)
    reply = await waits.wait(session, msg)  # type: ignore[arg-type]
    assert isinstance(reply, protocol.JobInfo)
    waits.ended([job_id])
    assert not waits.waiters.waited_on([job_id]) and session.replies == []
