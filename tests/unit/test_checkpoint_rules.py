"""The checkpoint and progress rules of the worker (``WorkerState``), the main
(``Handoff``) and the store (``broker.settlement``), without I/O."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import replace
from datetime import UTC, datetime

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters.memory import MemoryAdapter
from broker.core.handoff import Handoff, Send, StoreCheckpoint, StoreProgress
from broker.core.worker_effects import CheckpointSettled, ProgressLater, WakeSender
from broker.core.worker_state import WorkerState
from broker.jobs import CheckpointSave, Job, JobSpec, JobStatus
from broker.main.checkpoints import CheckpointSaver
from broker.main.settings import MainSettings
from broker.payload import DEFAULT_MAX_CHECKPOINT_BYTES, LINE_HEADROOM_BYTES
from broker.settlement import accepts_checkpoint, apply, save_checkpoint
from broker.wire import messages as protocol
from broker.wire.messages import AckStatus, ErrorCode
from tests.unit.test_worker_state import INLINE, job, lookup, welcome

NOW = datetime(2030, 1, 1, tzinfo=UTC)


def running(
    max_checkpoint_bytes: int | None = None,
) -> tuple[WorkerState, tuple[uuid.UUID, uuid.UUID]]:
    state = WorkerState(
        modes=[INLINE], queues=None, lookup_task=lookup, logger=logging.getLogger("test")
    )
    state.connected(msgspec.structs.replace(welcome(), max_checkpoint_bytes=max_checkpoint_bytes))
    msg = job(1)
    state.job_received(msg, {INLINE: 1})
    key = (msg.job_id, msg.handoff_id)
    state.run_entered(key)
    state.outgoing()
    return state, key


def test_a_checkpoint_goes_out_and_again_on_a_new_connection_until_answered() -> None:
    state, key = running()
    assert state.checkpoint_requested(key, 1, {"n": 1}) == [WakeSender()]
    [sent] = state.outgoing()
    assert sent == protocol.SaveCheckpoint(*key, seq=1, state={"n": 1})
    state.disconnected()
    state.connected(welcome([key]))
    assert protocol.SaveCheckpoint(*key, seq=1, state={"n": 1}) in state.outgoing()
    answer = protocol.CheckpointAck(*key, 1, AckStatus.DUPLICATE)
    assert state.checkpoint_ack_received(answer) == [CheckpointSettled(key, 1)]
    assert state.checkpoint_ack_received(answer) == [], "answered once"
    state.disconnected()
    state.connected(welcome([key]))
    assert not any(isinstance(m, protocol.SaveCheckpoint) for m in state.outgoing())


def test_a_stale_answer_fails_the_save_with_its_code() -> None:
    state, key = running()
    state.checkpoint_requested(key, 1, None)
    stale = protocol.CheckpointAck(*key, 1, AckStatus.STALE, ErrorCode.CHECKPOINT_REJECTED, "gone")
    assert state.checkpoint_ack_received(stale) == [
        CheckpointSettled(key, 1, ErrorCode.CHECKPOINT_REJECTED, "gone")
    ]


def test_a_checkpoint_over_the_limit_or_after_the_run_is_refused_at_once() -> None:
    state, key = running(max_checkpoint_bytes=10)
    [refused] = state.checkpoint_requested(key, 1, "x" * 20)
    assert isinstance(refused, CheckpointSettled) and refused.code == ErrorCode.PAYLOAD_TOO_LARGE
    assert state.outgoing() == []
    state.run_finished(key, None)
    [late] = state.checkpoint_requested(key, 2, 1)
    assert isinstance(late, CheckpointSettled) and late.code == ErrorCode.CHECKPOINT_REJECTED


def test_a_checkpoint_over_the_container_bound_is_refused_at_once() -> None:
    state, key = running()
    state.connected(msgspec.structs.replace(welcome([key]), max_payload_containers=50))
    state.outgoing()
    [refused] = state.checkpoint_requested(key, 1, [[]] * 60)
    assert isinstance(refused, CheckpointSettled) and refused.code == ErrorCode.PAYLOAD_TOO_LARGE
    assert refused.message is not None and "more than 50 lists and objects" in refused.message
    assert state.outgoing() == [], "never sent"
    assert state.checkpoint_requested(key, 2, [[]] * 40) == [WakeSender()]


def test_progress_is_rate_limited_to_the_latest_value_per_interval() -> None:
    state, key = running()
    assert state.progress_reported(key, 0.1, "a", now=100.0) == [WakeSender()]
    assert state.outgoing(now=100.0) == [protocol.Progress(*key, fraction=0.1, message="a")]
    [later] = state.progress_reported(key, 0.2, "b", now=100.2)
    assert isinstance(later, ProgressLater) and later.delay == pytest.approx(0.8)
    assert state.progress_reported(key, 0.3, "c", now=100.5) == [], "one timer at a time"
    assert state.outgoing(now=100.5) == []
    assert state.progress_due(now=101.0) == [WakeSender()]
    assert state.outgoing(now=101.0) == [protocol.Progress(*key, fraction=0.3, message="c")]
    state.progress_reported(key, 0.9, "d", now=101.1)
    state.run_finished(key, None)
    assert state.progress_due(now=103.0) == [], "the outcome supersedes unsent progress"


def _handoff_holding() -> tuple[Handoff, Job]:
    handoff = Handoff()
    peer = handoff.new_peer(1, 0.0)
    handoff.hello(peer, protocol.Hello(role=protocol.Role.WORKER, protocol=3, worker_id="w"))
    held = replace(Job.from_spec(JobSpec(task="t"), NOW), handoff_id=uuid.uuid4())
    assert held.handoff_id is not None
    handoff.holders.hold(peer, held.handoff_id, held)
    return handoff, held


def test_the_main_takes_checkpoints_and_progress_only_from_the_lease_holder() -> None:
    handoff, held = _handoff_holding()
    assert held.handoff_id is not None
    mine = protocol.SaveCheckpoint(held.id, held.handoff_id, seq=1, state=[1])
    assert handoff.checkpoint(1, mine) == [StoreCheckpoint(1, mine)]
    forged = protocol.SaveCheckpoint(held.id, uuid.uuid4(), seq=1, state=[1])
    [answer] = handoff.checkpoint(1, forged)
    assert isinstance(answer, Send) and isinstance(answer.message, protocol.CheckpointAck)
    assert answer.message.status is AckStatus.STALE
    assert handoff.checkpoint(2, mine)[0] != StoreCheckpoint(2, mine), "another connection"
    [store] = handoff.progress(1, protocol.Progress(held.id, held.handoff_id, fraction=0.5))
    assert isinstance(store, StoreProgress) and store.update.fraction == 0.5
    assert handoff.progress(1, protocol.Progress(held.id, uuid.uuid4(), fraction=0.5)) == []


@given(st.lists(st.integers(min_value=1, max_value=20), max_size=30), st.booleans())
def test_the_stored_checkpoint_only_ever_moves_forward(seqs: list[int], other_lease: bool) -> None:
    """Whatever order saves arrive in (resends, overtaken copies, a stale lease), the
    stored checkpoint is the highest-numbered one the current lease sent."""
    lease, stale = uuid.uuid4(), uuid.uuid4()
    job_ = Job.from_spec(JobSpec(task="t"), NOW)
    job_ = replace(job_, status=JobStatus.HANDED_OFF, handoff_id=lease)
    best = 0
    for seq in seqs:
        save = CheckpointSave(job_.id, stale if other_lease and seq % 2 else lease, seq, seq)
        if accepts_checkpoint(job_.status, job_.handoff_id, job_.checkpoint_seq, save):
            job_ = apply(job_, save_checkpoint(save, NOW))
        if save.handoff_id == lease:
            best = max(best, seq)
    assert job_.checkpoint_seq == best
    assert job_.checkpoint == (best if best else None)


def test_the_checkpoint_limit_leaves_room_for_the_jobs_payload_in_a_line() -> None:
    assert MainSettings().checkpoint_limit == DEFAULT_MAX_CHECKPOINT_BYTES == 4 << 20
    widest = MainSettings(max_payload_bytes=32 << 20, max_line_bytes=64 << 20)
    assert widest.checkpoint_limit == (1 << 20) - LINE_HEADROOM_BYTES, "a worker's line bound"
    tight = MainSettings(max_payload_bytes=1000, max_line_bytes=1000 + LINE_HEADROOM_BYTES + 10)
    assert tight.checkpoint_limit == 10
    assert MainSettings(max_checkpoint_bytes=None, max_payload_bytes=None).checkpoint_limit is None


async def test_the_saver_answers_applied_duplicate_stale_and_refused() -> None:
    store = MemoryAdapter()
    job_ = (await store.enqueue(JobSpec(task="t"))).job
    lease = uuid.uuid4()
    assert await store.mark_handed_off(job_.id, lease, "w") is not None
    answers: list[protocol.CheckpointAck] = []
    saver = CheckpointSaver(
        store,
        answer=lambda acks: answers.extend(ack for _, ack in acks),
        stopping=lambda: False,
        batch=10,
        retry_interval=0.01,
        max_checkpoint_bytes=100,
        max_payload_depth=8,
        max_payload_containers=100,
    )
    running_saver = asyncio.create_task(saver.run())
    try:
        saver.add(1, protocol.SaveCheckpoint(job_.id, lease, seq=1, state="x" * 200))
        saver.add(1, protocol.SaveCheckpoint(job_.id, lease, seq=1, state={"n": 1}))
        saver.add(1, protocol.SaveCheckpoint(job_.id, lease, seq=1, state={"n": 1}))
        saver.add(1, protocol.SaveCheckpoint(job_.id, uuid.uuid4(), seq=2, state={"n": 2}))
        while len(answers) < 4:
            await asyncio.sleep(0.01)
    finally:
        running_saver.cancel()
    statuses = [(a.status, a.code) for a in answers]
    assert statuses == [
        (AckStatus.REFUSED, ErrorCode.PAYLOAD_TOO_LARGE),
        (AckStatus.APPLIED, None),
        (AckStatus.DUPLICATE, None),
        (AckStatus.STALE, ErrorCode.CHECKPOINT_REJECTED),
    ]
    stored = await store.get_job(job_.id)
    assert stored is not None and stored.checkpoint == {"n": 1}
