"""The transition table (broker/settlement.py) on its own, and the memory store against it."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.memory import MemoryAdapter
from broker import settlement
from broker.jobs import Claim, Job, JobSpec, JobStatus, Outcome, Settlement
from broker.retry import next_run_after_failure

NOW = datetime(2030, 1, 1, tzinfo=UTC)
LATER = NOW + timedelta(minutes=5)
JOB = uuid.uuid4()
LEASE = uuid.uuid4()


def handed_off(attempts: int = 0, max_attempts: int = 3, key: str | None = None) -> Job:
    spec = JobSpec(
        "t",
        id=JOB,
        max_attempts=max_attempts,
        concurrency_key=key,
        concurrency_limit=None if key is None else 1,
    )
    job = Job.from_spec(spec, NOW - timedelta(hours=1))
    job = replace(job, attempts=attempts)
    return settlement.apply(job, settlement.hand_off(Claim(JOB, LEASE, "w"), NOW))


# outcome, result, error, run_at -> status, attempts added, run_at, result, last_error
SETTLE_TABLE = [
    (Outcome.COMPLETE, {"ok": 1}, None, None, JobStatus.COMPLETED, 0, "unchanged"),
    (Outcome.FAIL, None, "boom", LATER, JobStatus.QUEUED, 1, LATER),
    (Outcome.FAIL, None, "boom", None, JobStatus.FAILED, 1, "unchanged"),
    (Outcome.RESCHEDULE, None, None, LATER, JobStatus.QUEUED, 0, LATER),
    (Outcome.RESCHEDULE, None, None, None, JobStatus.QUEUED, 0, NOW),
    (Outcome.RETURN, None, None, None, JobStatus.QUEUED, 0, NOW),
]


@pytest.mark.parametrize("attempts", [0, 2])
@pytest.mark.parametrize("key", [None, "k"])
@pytest.mark.parametrize(
    ("outcome", "result", "error", "run_at", "status", "added", "new_run_at"), SETTLE_TABLE
)
def test_settle_table(
    attempts: int,
    key: str | None,
    outcome: Outcome,
    result: object,
    error: str | None,
    run_at: datetime | None,
    status: JobStatus,
    added: int,
    new_run_at: object,
) -> None:
    job = handed_off(attempts=attempts, max_attempts=5, key=key)
    s = Settlement(JOB, LEASE, outcome, result=result, error=error, run_at=run_at)
    assert settlement.accepts(job.status, job.handoff_id, s)
    move = settlement.settle(s, NOW)
    after = settlement.apply(job, move)
    assert after.status is status
    assert after.attempts == attempts + added
    assert after.run_at == (job.run_at if new_run_at == "unchanged" else new_run_at)
    assert after.result == result
    assert after.last_error == (error if outcome is Outcome.FAIL else None)
    assert after.updated_at == NOW
    assert move.releases_slot  # every accepted settlement gives the slot back
    # The lease stays on the row as a record of the last handoff; the fence is the status.
    assert after.handoff_id == LEASE and after.worker_id == "w"


@pytest.mark.parametrize(
    ("attempts", "max_attempts", "status"),
    [
        (0, 1, JobStatus.FAILED),  # one run allowed: the first failure is final
        (0, 3, JobStatus.QUEUED),
        (1, 3, JobStatus.QUEUED),
        (2, 3, JobStatus.FAILED),  # the third failure exhausts three runs
    ],
)
def test_retries_exhausted_leave_the_job_dead(
    attempts: int, max_attempts: int, status: JobStatus
) -> None:
    job = handed_off(attempts=attempts, max_attempts=max_attempts)
    retry_at = next_run_after_failure(job, NOW)
    s = Settlement(JOB, LEASE, Outcome.FAIL, error="boom", run_at=retry_at)
    after = settlement.apply(job, settlement.settle(s, NOW))
    assert after.status is status
    assert after.attempts == attempts + 1
    assert after.run_at == (job.run_at if retry_at is None else retry_at)


@pytest.mark.parametrize(
    ("status", "lease", "accepted"),
    [
        (JobStatus.HANDED_OFF, LEASE, True),
        (JobStatus.HANDED_OFF, uuid.uuid4(), False),  # a stale lease never settles
        (JobStatus.QUEUED, LEASE, False),  # already settled (returned) under this lease
        (JobStatus.COMPLETED, LEASE, False),
        (JobStatus.CANCELLED, LEASE, False),
        (JobStatus.HANDED_OFF, None, False),
    ],
)
def test_fence(status: JobStatus, lease: uuid.UUID | None, accepted: bool) -> None:
    s = Settlement(JOB, LEASE, Outcome.COMPLETE)
    assert settlement.accepts(status, lease, s) is accepted
    assert settlement.accepts(status.value, lease, s) is accepted  # a raw SQL row value


@pytest.mark.parametrize(
    ("status", "releases"),
    [
        (JobStatus.QUEUED, False),
        (JobStatus.HANDED_OFF, True),
        (JobStatus.COMPLETED, None),
        (JobStatus.FAILED, None),
        (JobStatus.CANCELLED, None),
    ],
)
def test_cancel(status: JobStatus, releases: bool | None) -> None:
    move = settlement.cancel(status, NOW)
    if releases is None:
        assert move is None  # a finished job stays as it finished
        return
    assert move is not None
    assert move.releases_slot is releases
    after = settlement.apply(replace(handed_off(attempts=1), status=status), move)
    assert (after.status, after.attempts, after.updated_at) == (JobStatus.CANCELLED, 1, NOW)


def test_statuses_after_each_outcome() -> None:
    """What the main needs to tell a duplicate report from a stale one."""
    assert settlement.statuses_after(Outcome.COMPLETE) == {JobStatus.COMPLETED}
    assert settlement.statuses_after(Outcome.FAIL) == {JobStatus.FAILED, JobStatus.QUEUED}
    assert settlement.statuses_after(Outcome.RESCHEDULE) == {JobStatus.QUEUED}
    assert settlement.statuses_after(Outcome.RETURN) == {JobStatus.QUEUED}


def test_hand_off_takes_no_slot_back_and_records_the_lease() -> None:
    queued = Job.from_spec(JobSpec("t", id=JOB), NOW - timedelta(hours=1))
    move = settlement.hand_off(Claim(JOB, LEASE, "w"), NOW)
    after = settlement.apply(queued, move)
    assert not move.releases_slot and not move.counts_attempt
    assert (after.status, after.handoff_id, after.worker_id) == (JobStatus.HANDED_OFF, LEASE, "w")
    assert after.handed_off_at == after.updated_at == NOW
    assert after.attempts == 0


def test_moves_of_one_shape_share_a_statement() -> None:
    """The SQL store groups a batch by shape; two moves share one only when they set the
    same fields."""
    shape = {
        name: settlement.settle(Settlement(JOB, LEASE, outcome, run_at=run_at), NOW).shape
        for name, outcome, run_at in [
            ("complete", Outcome.COMPLETE, None),
            ("retry", Outcome.FAIL, LATER),
            ("dead", Outcome.FAIL, None),
            ("reschedule", Outcome.RESCHEDULE, LATER),
            ("return", Outcome.RETURN, None),
        ]
    }
    assert shape["reschedule"] == shape["return"]
    assert len({shape[n] for n in ("complete", "retry", "dead", "return")}) == 4


# ------------------------------------------------------------ the memory store agrees

_step = st.tuples(
    st.sampled_from(list(Outcome)),
    st.booleans(),  # report under the current lease (else a stale one)
    st.none() | st.integers(min_value=0, max_value=3600),  # run_at, seconds from now
    st.none() | st.integers() | st.lists(st.text(max_size=3), max_size=2),  # result
)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    max_attempts=st.integers(min_value=1, max_value=4),
    keyed=st.booleans(),
    steps=st.lists(_step, min_size=1, max_size=8),
)
def test_memory_settle_agrees_with_the_table(
    max_attempts: int, keyed: bool, steps: list[tuple[Outcome, bool, int | None, object]]
) -> None:
    asyncio.run(_drive_memory(max_attempts, keyed, steps))


async def _drive_memory(
    max_attempts: int, keyed: bool, steps: list[tuple[Outcome, bool, int | None, object]]
) -> None:
    clock = [NOW]
    store = MemoryAdapter(clock=lambda: clock[0])
    key = "k" if keyed else None
    spec = JobSpec(
        "t", max_attempts=max_attempts, concurrency_key=key, concurrency_limit=1 if keyed else None
    )
    await store.enqueue(spec)
    lease = uuid.uuid4()
    for outcome, current, offset, result in steps:
        job = await store.get_job(spec.id)
        assert job is not None
        if job.status is JobStatus.QUEUED:  # hand it off again, when it is due
            clock[0] = max(clock[0], job.run_at) + timedelta(seconds=1)
            lease = uuid.uuid4()
            assert await store.mark_handed_off(spec.id, lease, "w") is not None
            job = await store.get_job(spec.id)
            assert job is not None
        clock[0] += timedelta(seconds=1)
        run_at = None if offset is None else clock[0] + timedelta(seconds=offset)
        s = Settlement(
            spec.id,
            lease if current else uuid.uuid4(),
            outcome,
            result=result if outcome is Outcome.COMPLETE else None,
            error="boom" if outcome is Outcome.FAIL else None,
            run_at=run_at,
        )
        [applied] = await store.settle_many([s])
        accepted = settlement.accepts(job.status, job.handoff_id, s)
        assert applied is accepted
        expected = settlement.apply(job, settlement.settle(s, clock[0])) if accepted else job
        assert await store.get_job(spec.id) == expected
        if keyed:  # the slot is held exactly while the job is handed off
            held = store._active_by_key.get("k", 0)
            assert held == (1 if expected.status is JobStatus.HANDED_OFF else 0)
        if expected.status.is_terminal:
            break
