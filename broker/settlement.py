"""What a claim, a report or a cancel does to its job: the transition table, written once.

Every store applies the same moves into and out of ``handed_off`` (see the diagram in
:mod:`broker.jobs`), so the rule lives here as pure functions and each store only
carries it out: the memory adapter replaces its :class:`~broker.jobs.Job` value, the
SQL adapter turns the same :class:`Move` into the ``SET`` of one fenced ``UPDATE``
(an executemany per shape when a batch is grouped). Nothing here reads a clock or a
store; ``now`` comes in, the changes go out.

================  ===============================  =========  ==================
move              status                           attempts   run_at
================  ===============================  =========  ==================
claim             ``handed_off`` (lease, worker)   unchanged  unchanged
claim at enqueue  ``handed_off`` (lease, worker)   0          now
``COMPLETE``      ``completed`` (``result`` kept)  unchanged  unchanged
``FAIL`` + retry  ``queued`` (``last_error``)      + 1        the retry time
``FAIL``, dead    ``failed`` (``last_error``)      + 1        unchanged
``RESCHEDULE``    ``queued``                       unchanged  its time, else now
``RETURN``        ``queued``                       unchanged  now
``LOST``          ``queued`` (``last_error``)      unchanged  now (its time)
``LOST``, dead    ``failed`` (``last_error``)      unchanged  unchanged
payload refused   ``failed`` (``last_error``)      + 1        unchanged
cancel            ``cancelled``                    unchanged  unchanged
revive            ``queued`` (from ``failed``)     0          now
checkpoint        unchanged (``checkpoint`` kept)  unchanged  unchanged
progress          unchanged (``progress`` kept)    unchanged  unchanged
================  ===============================  =========  ==================

``COMPLETE`` also sets ``progress`` to 1.0: a completed job is done, whatever fraction its
task last reported (a task that reports 0.875 and returns did not stop at seven eighths),
so every reader (``get_job``, ``broker job``, the dashboard) shows it done without a rule
of its own. The last ``progress_message`` is kept.

A checkpoint and a progress update are fenced by the lease like a settlement; a
checkpoint is also taken only when it is newer than the stored one.

*payload refused* is ``FAIL``, dead, made by the store itself within a claim whose job's
offloaded value failed its integrity check (:func:`payload_refused`): the claim has just
persisted its lease, so the move is fenced by that lease like any report, counts the
attempt that could not start, and gives the slot back; it is never retried, since the
same value would fail again.

``LOST`` counts a recovery (``recoveries + 1``) instead of an attempt, and sets the
job's ``state_holder``, which every claim clears. revive also zeroes ``recoveries``.

A claim takes the job's concurrency slot (the store checks there is room); every
accepted settlement gives back the job's concurrency slot; a cancel gives it back
only when the job was handed off (a queued job holds none).
"""

from __future__ import annotations

import uuid
from collections import ChainMap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, TypeVar

from broker.jobs import (
    ACTIVE_STATUSES,
    JOB_DEFAULTS,
    CheckpointSave,
    Claim,
    Job,
    JobSpec,
    JobStatus,
    Outcome,
    ProgressUpdate,
    Settlement,
    new_job_fields,
)
from broker.storage import PayloadIntegrityError


@dataclass(frozen=True, slots=True)
class Move:
    """The changes one transition makes to a job.

    ``changes`` maps :class:`~broker.jobs.Job` field names to their new values (always
    ``status`` and ``updated_at`` for a transition; a checkpoint or progress move sets
    only its own fields); fields it does not name keep theirs. ``attempts`` is
    not among them but counted by ``counts_attempt``, because a store may add the one
    in the database (``attempts = attempts + 1``) without reading the row first.
    """

    changes: Mapping[str, Any]
    counts_attempt: bool = False
    counts_recovery: bool = False
    releases_slot: bool = True
    """Whether the job's concurrency slot (if it has a key) is given back."""

    @property
    def shape(self) -> tuple[Any, ...]:
        """What moves sharing one ``UPDATE`` statement have in common: the fields set."""
        return (self.counts_attempt, self.counts_recovery, *sorted(self.changes))


def hand_off(claim: Claim, now: datetime) -> Move:
    """The move a won claim makes to its queued job: handed off under the claim's lease."""
    changes = {
        "status": JobStatus.HANDED_OFF,
        "handoff_id": claim.handoff_id,
        "worker_id": claim.worker_id,
        "handed_off_at": now,
        "state_holder": None,
        "updated_at": now,
    }
    return Move(changes, releases_slot=False)


def claimable_at_enqueue(spec: JobSpec, now: datetime) -> bool:
    """Whether a job may be stored already handed off, under a claim the main made for it
    before the insert: only a job due at once, without a concurrency key (whose slot
    must be counted inside a claim, which an insert does not do) and without parents (it
    waits for them)."""
    return (
        spec.concurrency_key is None
        and not spec.depends_on
        and (spec.run_at is None or spec.run_at <= now)
    )


_H = TypeVar("_H")


def blocking_holder(
    spec: JobSpec,
    by_idempotency_key: Callable[[str], _H | None],
    by_id: Callable[[uuid.UUID], _H | None],
    by_active_unique_key: Callable[[str], _H | None],
) -> _H | None:
    """What keeps ``spec`` from being enqueued, in this order: the job holding its
    idempotency key, else the job with its id, else the job holding its unique key while
    queued or handed off; ``None``: nothing does, and its job is written. The enqueue
    then returns the holder as a duplicate (after
    :func:`~broker.jobs.check_idempotent_repeat`, for a held idempotency key). Each store
    looks the three up its own way; the order is this one."""
    holder = None
    if spec.idempotency_key is not None:
        holder = by_idempotency_key(spec.idempotency_key)
    if holder is None:
        holder = by_id(spec.id)
    if holder is None and spec.unique_key is not None:
        holder = by_active_unique_key(spec.unique_key)
    return holder


def enqueued(spec: JobSpec, now: datetime, claim: Claim | None = None) -> Job:
    """The job a store writes for ``spec`` enqueued at ``now``: queued, or, with a claim
    the main made at enqueue time for a job :func:`claimable_at_enqueue`, handed off
    under that claim exactly as if it had been claimed at once (a claim naming another
    job is ignored)."""
    return Job(**enqueued_fields(spec, now, claim))


def enqueued_fields(spec: JobSpec, now: datetime, claim: Claim | None = None) -> dict[str, Any]:
    """The fields of :func:`enqueued`'s job by name, for a store that writes the row
    without building the job (see :meth:`~broker.jobs.EnqueueResult.inserted`)."""
    job_fields = new_job_fields(spec, now)
    if claim is not None and claim.job_id == spec.id and claimable_at_enqueue(spec, now):
        job_fields.update(_changes(hand_off(claim, now), ChainMap(job_fields, JOB_DEFAULTS)))
    return job_fields


DONE = 1.0
"""The progress of a completed job."""


def accepts(status: str, handoff_id: uuid.UUID | None, s: Settlement | ProgressUpdate) -> bool:
    """The fence: only the lease the job is handed off under may settle it, so a report
    from an older attempt can never change a newer one."""
    return status == JobStatus.HANDED_OFF and handoff_id == s.handoff_id


def settle(s: Settlement, now: datetime) -> Move:
    """The move ``s`` makes once :func:`accepts` lets it through."""
    changes: dict[str, Any]
    match s.outcome:
        case Outcome.COMPLETE:
            changes = {"status": JobStatus.COMPLETED, "result": s.result, "progress": DONE}
        case Outcome.FAIL:
            # No retry time means no retry: the job is dead.
            changes = {"status": JobStatus.FAILED if s.run_at is None else JobStatus.QUEUED}
            changes["last_error"] = s.error
            if s.run_at is not None:
                changes["run_at"] = s.run_at
        case Outcome.RESCHEDULE:
            changes = {"status": JobStatus.QUEUED, "run_at": s.run_at or now}
        case Outcome.RETURN:
            changes = {"status": JobStatus.QUEUED, "run_at": now}
        case Outcome.LOST:
            changes = {"status": JobStatus.FAILED if s.run_at is None else JobStatus.QUEUED}
            changes["last_error"] = s.error
            changes["state_holder"] = s.state_holder
            if s.run_at is not None:
                changes["run_at"] = s.run_at
    changes["updated_at"] = now
    return Move(
        changes,
        counts_attempt=s.outcome is Outcome.FAIL,
        counts_recovery=s.outcome is Outcome.LOST,
    )


def accepts_checkpoint(
    status: str, handoff_id: uuid.UUID | None, checkpoint_seq: int, save: CheckpointSave
) -> bool:
    """The checkpoint fence: the lease that may settle the job (:func:`accepts`), and a
    checkpoint newer than the one stored, so a copy sent again after a reconnect, or one
    overtaken by a later save, never brings an older state back."""
    return (
        status == JobStatus.HANDED_OFF
        and handoff_id == save.handoff_id
        and checkpoint_seq < save.seq
    )


def save_checkpoint(save: CheckpointSave, now: datetime) -> Move:
    """The move a checkpoint makes once :func:`accepts_checkpoint` lets it through: the
    state and its number, nothing else (the job stays handed off, ``updated_at`` is the
    job's last move, which retention reads)."""
    changes = {"checkpoint": save.state, "checkpoint_seq": save.seq, "checkpoint_at": now}
    return Move(changes, releases_slot=False)


def record_progress(update: ProgressUpdate) -> Move:
    """The move a progress update makes; fenced by :func:`accepts` (its lease)."""
    changes = {"progress": update.fraction, "progress_message": update.message}
    return Move(changes, releases_slot=False)


def payload_refused(claim: Claim, error: PayloadIntegrityError) -> Settlement:
    """The settlement a store makes, inside a claim, for a job it just handed off under
    ``claim`` whose offloaded value failed its check (``error``): dead at once with the
    error's text, so the rest of the claim's batch goes out and this job never blocks it
    again (see :class:`~broker.storage.SupportsOffload`)."""
    return Settlement(claim.job_id, claim.handoff_id, Outcome.FAIL, error=error.detail)


def statuses_after(outcome: Outcome) -> frozenset[JobStatus]:
    """Every status a settlement with ``outcome`` may leave its job in, whatever its retry
    time: a report seen again whose job is in one of them was already applied (a
    duplicate), where any other status means a stale one."""
    return frozenset(
        settle(Settlement(_NO_ID, _NO_ID, outcome, run_at=run_at), _PROBE).changes["status"]
        for run_at in (None, _PROBE)
    )


_NO_ID = uuid.UUID(int=0)
_PROBE = datetime(2000, 1, 1, tzinfo=UTC)
"""Any time will do: the status a move sets does not depend on when."""


def cancel(status: str, now: datetime) -> Move | None:
    """The move an operator's cancel makes, or ``None`` when the job has already
    finished (a cancel never rewrites history)."""
    if JobStatus(status) not in ACTIVE_STATUSES:
        return None
    return Move(
        {"status": JobStatus.CANCELLED, "updated_at": now},
        releases_slot=status == JobStatus.HANDED_OFF,
    )


def revive(now: datetime) -> Move:
    """The move an operator's retry makes to a dead (``failed``) job: queued again at
    once, with a fresh count of attempts. A queued job holds no slot, so none is given."""
    changes = {
        "status": JobStatus.QUEUED,
        "attempts": 0,
        "recoveries": 0,
        "run_at": now,
        "updated_at": now,
    }
    return Move(changes, releases_slot=False)


def apply(job: Job, move: Move) -> Job:
    """``job`` after ``move``: how a store that keeps :class:`Job` values carries it out."""
    return replace(job, **_changes(move, {"attempts": job.attempts, "recoveries": job.recoveries}))


def _changes(move: Move, counts: Mapping[str, Any]) -> dict[str, Any]:
    """The fields ``move`` sets, the counts it adds to included (``counts``: the job's
    ``attempts`` and ``recoveries`` before it)."""
    changes = dict(move.changes)
    if move.counts_attempt:
        changes["attempts"] = counts["attempts"] + 1
    if move.counts_recovery:
        changes["recoveries"] = counts["recoveries"] + 1
    return changes
