"""Report semantics: what a worker's report, or a lease the main took back, does to its
job, and what a report the store fenced out was.

Rule: every decision of that kind lives in this module, as pure functions. The shells
read what they need first (the job as handed off, or as stored: ``job: Job | None``),
then ask here, then write: :class:`broker.main.settler.ReportSettler` for the reports the
handoff core accepted, :class:`broker.main.recovery.RecoveryLedger` for the leases it
gives back. Both settle a lost attempt through :func:`lost`, so a child that died under
its job and a worker that disconnected holding it count the same recovery.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from broker.core.handoff import Loss
from broker.jobs import Job, JobStatus, Outcome, Settlement
from broker.payload import result_problem
from broker.retry import RetryDelay, lost_attempt, next_run_after_failure
from broker.settlement import statuses_after
from broker.wire import messages as protocol


@dataclass(frozen=True, slots=True)
class Policy:
    """The main's settings the settlement of a report depends on."""

    retry_delay: RetryDelay
    """The main's backoff, for a failure whose task sent no wait of its own."""
    max_recoveries: int
    """Lost attempts a job may have when it declares no limit of its own."""
    max_payload_bytes: int | None
    max_payload_depth: int
    max_payload_containers: int | None


def needs_job(report: protocol.Report) -> bool:
    """Whether :func:`settlement` needs the job: a failure's depends on its attempts (when
    it runs again) or its recoveries (a lost attempt); the others' on the report alone."""
    return isinstance(report, protocol.FailedReport)


def settlement(
    report: protocol.Report, job: Job | None, now: datetime, policy: Policy
) -> Settlement:
    """What ``report`` does to its job, at ``now``. ``job`` is the job as handed off under
    the report's lease (or as stored) when :func:`needs_job` says it matters, else
    anything; ``None`` when it could not be found (the fenced settlement then finds
    nothing to apply to, and the failure is judged dead).

    * A result over the payload limits (or nested too deep) is never written: the job
      fails, without retry (the same arguments would produce the same result). The walk
      stops at the container bound, so judging it is cheap.
    * A failure the worker marks ``lost`` (its child died under the job) is a recovery,
      not a failure (:func:`lost`).
    * A failure to retry runs again after the task's own wait when the worker sent one
      (the task's backoff ran there; decoded, so checked: 0 to ten years), else after
      the main's backoff; past its attempts it is dead.
    """
    match report:
        case protocol.CompletedReport(job_id=job_id, handoff_id=lease, result=result):
            problem = result_problem(
                result,
                policy.max_payload_bytes,
                policy.max_payload_depth,
                policy.max_payload_containers,
            )
            if problem is not None:
                return Settlement(job_id, lease, Outcome.FAIL, error=problem, run_at=None)
            return Settlement(job_id, lease, Outcome.COMPLETE, result=result)
        case protocol.FailedReport(job_id=job_id, handoff_id=lease, error=error, lost=True):
            return lost(job_id, lease, job, error, now, policy.max_recoveries)
        case protocol.FailedReport(
            job_id=job_id, handoff_id=lease, error=error, retry=retry, retry_delay=wait
        ):
            delay = policy.retry_delay if wait is None else _fixed(wait)
            retry_at = (
                next_run_after_failure(job, now, delay) if retry and job is not None else None
            )
            return Settlement(job_id, lease, Outcome.FAIL, error=error, run_at=retry_at)
        case protocol.RescheduleReport(job_id=job_id, handoff_id=lease, delay=delay):
            return Settlement(
                job_id, lease, Outcome.RESCHEDULE, run_at=now + timedelta(seconds=delay)
            )
        case protocol.ReleaseReport(job_id=job_id, handoff_id=lease):
            return Settlement(job_id, lease, Outcome.RETURN)


def lost(
    job_id: uuid.UUID,
    lease: uuid.UUID,
    job: Job | None,
    reason: str,
    now: datetime,
    max_recoveries: int,
) -> Settlement:
    """An attempt lost under ``lease`` (its worker, child or connection died): settled as
    :func:`broker.retry.lost_attempt` says for ``job`` as handed off (which names the
    recovery count the fenced settlement will find). Without the job, a recovery that runs
    again at once: the fence decides whether it applies at all."""
    if job is not None:
        return lost_attempt(job, lease, reason, now, max_recoveries)
    return Settlement(job_id, lease, Outcome.LOST, error=reason, run_at=now)


def taken_back(
    job_id: uuid.UUID,
    lease: uuid.UUID,
    loss: Loss | None,
    now: datetime,
    max_recoveries: int,
) -> Settlement | None:
    """How a lease the main gives back is settled: ``None`` when its job simply goes back
    to the queue as it was (``return_to_queue``: a claim whose outcome nobody knows, so
    the attempt never ran); a lost attempt (``loss``: the job may have run, and its worker
    left or never took it) counts a recovery (:func:`lost`)."""
    if loss is None:
        return None
    return lost(job_id, lease, loss.job, loss.reason, now, max_recoveries)


def unstorable(report: protocol.Report, exc: Exception) -> Settlement:
    """A report the store can never take (it raised, not transiently, on the report
    alone): its job fails, without retry, with an error saying why (the same outcome
    would fail the same way again)."""
    return Settlement(
        report.job_id,
        report.handoff_id,
        Outcome.FAIL,
        error=f"report could not be stored: the worker's {report.type} report failed with "
        f"{type(exc).__name__}: {str(exc)[:1000]}",
        run_at=None,
    )


def not_applied(
    report: protocol.Report, settled: Settlement, job: Job | None
) -> protocol.AckStatus:
    """What a report the store fenced out was, given ``job`` as stored now (``None``: no
    such job). A *duplicate* when its lease already settled this job as ``settled``
    would have (two copies were in flight: a reconnected worker re-sent a report its old
    connection had sent); *stale* when a newer lease owns the job or it was cancelled.
    The job comes from the store, so the answer is the same whichever main gives it."""
    if job is None or job.handoff_id != report.handoff_id:
        return protocol.AckStatus.STALE
    settled_as = statuses_after(settled.outcome)
    if settled.outcome is Outcome.FAIL and not isinstance(report, protocol.FailedReport):
        # Recorded as a failure in its place (an oversized result, an unstorable
        # report): never retried, so only a dead job shows it landed.
        settled_as = frozenset({JobStatus.FAILED})
    if job.status in settled_as:
        return protocol.AckStatus.DUPLICATE
    return protocol.AckStatus.STALE


def _fixed(seconds: float) -> RetryDelay:
    return lambda _failures: timedelta(seconds=seconds)
