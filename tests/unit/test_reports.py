"""Report semantics (:mod:`broker.core.reports`) without a store: what each report settles
to, what a lease the main takes back settles to, and whether a report the store fenced
out was a duplicate or stale."""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from broker.core import reports
from broker.core.handoff import Loss
from broker.jobs import Job, JobSpec, JobStatus, JSONValue, Outcome, Settlement
from broker.wire import messages as protocol

NOW = datetime(2030, 1, 1, tzinfo=UTC)
LEASE = uuid.uuid4()
MAIN_WAIT = timedelta(seconds=7)
POLICY = reports.Policy(
    retry_delay=lambda _failures: MAIN_WAIT,
    max_recoveries=2,
    max_payload_bytes=100,
    max_payload_depth=4,
    max_payload_containers=None,
)


def handed_off(attempts: int = 0, max_attempts: int = 3, recoveries: int = 0) -> Job:
    job = Job.from_spec(JobSpec("t", max_attempts=max_attempts), NOW - timedelta(hours=1))
    return replace(
        job,
        status=JobStatus.HANDED_OFF,
        handoff_id=LEASE,
        worker_id="w",
        attempts=attempts,
        recoveries=recoveries,
    )


JOB = handed_off()


def failed(**fields: Any) -> protocol.FailedReport:
    return protocol.FailedReport(job_id=JOB.id, handoff_id=LEASE, error="boom", **fields)


def completed(result: JSONValue = None) -> protocol.CompletedReport:
    return protocol.CompletedReport(job_id=JOB.id, handoff_id=LEASE, result=result)


def test_only_a_failure_needs_its_job() -> None:
    assert reports.needs_job(failed())
    assert reports.needs_job(failed(lost=True))
    assert not reports.needs_job(completed())
    assert not reports.needs_job(
        protocol.ReleaseReport(job_id=JOB.id, handoff_id=LEASE, reason="drain")
    )


def test_a_completion_stores_its_result_unless_it_is_too_large_or_too_deep() -> None:
    done = reports.settlement(completed({"n": 1}), None, NOW, POLICY)
    assert done == Settlement(JOB.id, LEASE, Outcome.COMPLETE, result={"n": 1})
    for refused in ("x" * 200, [[[[[1]]]]]):
        settled = reports.settlement(completed(refused), None, NOW, POLICY)
        assert settled.outcome is Outcome.FAIL and settled.result is None
        assert settled.run_at is None, "never retried: the same run gives the same result"
        assert settled.error


def test_a_failure_runs_again_after_the_tasks_own_wait_else_the_mains_backoff() -> None:
    assert reports.settlement(failed(), JOB, NOW, POLICY).run_at == NOW + MAIN_WAIT
    own = reports.settlement(failed(retry_delay=2.0), JOB, NOW, POLICY)
    assert own == Settlement(
        JOB.id, LEASE, Outcome.FAIL, error="boom", run_at=NOW + timedelta(seconds=2)
    )
    assert reports.settlement(failed(retry_delay=0.0), JOB, NOW, POLICY).run_at == NOW


@pytest.mark.parametrize(
    ("report", "job"),
    [
        (failed(retry=False), JOB),
        (failed(), handed_off(attempts=2, max_attempts=3)),
        (failed(retry_delay=2.0), handed_off(attempts=2, max_attempts=3)),
        (failed(), None),
    ],
    ids=["not-retryable", "attempts-spent", "own-wait-attempts-spent", "job-gone"],
)
def test_a_failure_is_dead(report: protocol.FailedReport, job: Job | None) -> None:
    settled = reports.settlement(report, job, NOW, POLICY)
    assert (settled.outcome, settled.run_at, settled.error) == (Outcome.FAIL, None, "boom")


def test_a_lost_report_is_a_recovery_not_a_failure() -> None:
    settled = reports.settlement(failed(lost=True, retry_delay=5.0), JOB, NOW, POLICY)
    assert (settled.outcome, settled.run_at) == (Outcome.LOST, NOW), "at once, no backoff"
    assert settled.error is not None and "1 of 2 recoveries" in settled.error
    spent = reports.settlement(failed(lost=True), handed_off(recoveries=2), NOW, POLICY)
    assert (spent.outcome, spent.run_at) == (Outcome.LOST, None)
    assert spent.error is not None and spent.error.startswith("recovery limit reached")
    unknown = reports.settlement(failed(lost=True), None, NOW, POLICY)
    assert unknown == Settlement(JOB.id, LEASE, Outcome.LOST, error="boom", run_at=NOW)


def test_reschedule_and_release() -> None:
    later = reports.settlement(
        protocol.RescheduleReport(job_id=JOB.id, handoff_id=LEASE, delay=30.0), None, NOW, POLICY
    )
    assert later == Settlement(
        JOB.id, LEASE, Outcome.RESCHEDULE, run_at=NOW + timedelta(seconds=30)
    )
    back = reports.settlement(
        protocol.ReleaseReport(job_id=JOB.id, handoff_id=LEASE, reason="drain"), None, NOW, POLICY
    )
    assert back == Settlement(JOB.id, LEASE, Outcome.RETURN)


def test_a_lease_taken_back_returns_to_the_queue_unless_its_attempt_was_lost() -> None:
    assert reports.taken_back(JOB.id, LEASE, None, NOW, 2) is None
    loss = Loss(JOB, "worker connection ended")
    settled = reports.taken_back(JOB.id, LEASE, loss, NOW, 2)
    assert settled == Settlement(
        JOB.id,
        LEASE,
        Outcome.LOST,
        error="attempt lost (1 of 2 recoveries used): worker connection ended",
        run_at=NOW,
    )
    # The same rule as a lost report's.
    lost_report = protocol.FailedReport(
        job_id=JOB.id, handoff_id=LEASE, error="worker connection ended", lost=True
    )
    assert settled == reports.settlement(lost_report, JOB, NOW, POLICY)


def test_an_unstorable_report_fails_its_job_without_retry_saying_why() -> None:
    settled = reports.unstorable(completed(), ValueError("x" * 2000))
    assert (settled.outcome, settled.run_at) == (Outcome.FAIL, None)
    assert settled.error is not None
    assert settled.error.startswith(
        "report could not be stored: the worker's completed report failed with ValueError: "
    )
    assert len(settled.error) < 1100, "the exception's text is cut"


def stored(status: JobStatus, lease: uuid.UUID | None = LEASE) -> Job:
    return replace(JOB, status=status, handoff_id=lease)


@pytest.mark.parametrize(
    ("report", "job", "answer"),
    [
        # Its lease no longer owns the job (a newer one does, or none), or no such job.
        (completed(), None, "stale"),
        (completed(), stored(JobStatus.HANDED_OFF, uuid.uuid4()), "stale"),
        (completed(), stored(JobStatus.CANCELLED, None), "stale"),
        # Its lease settled the job as this report would have: a copy already applied.
        (completed(), stored(JobStatus.COMPLETED), "duplicate"),
        (failed(), stored(JobStatus.QUEUED), "duplicate"),
        (failed(), stored(JobStatus.FAILED), "duplicate"),
        (completed(), stored(JobStatus.QUEUED), "stale"),
        # A result recorded as a failure in its place is never retried: only a dead job
        # shows it landed.
        (completed("x" * 200), stored(JobStatus.FAILED), "duplicate"),
        (completed("x" * 200), stored(JobStatus.QUEUED), "stale"),
    ],
)
def test_a_fenced_out_report_is_a_duplicate_or_stale(
    report: protocol.Report, job: Job | None, answer: str
) -> None:
    settled = reports.settlement(report, JOB, NOW, POLICY)
    assert reports.not_applied(report, settled, job) is protocol.AckStatus(answer)


def test_an_unstorable_report_is_a_duplicate_only_once_its_job_is_dead() -> None:
    report = protocol.RescheduleReport(job_id=JOB.id, handoff_id=LEASE, delay=1.0)
    settled = reports.unstorable(report, ValueError("bad"))
    assert reports.not_applied(report, settled, stored(JobStatus.FAILED)).value == "duplicate"
    assert reports.not_applied(report, settled, stored(JobStatus.QUEUED)).value == "stale"
