"""Report settlement: the store side of the reports the handoff core accepted.

Reports are applied in group commits (every report that arrived while a batch was
committing goes into the next), each acknowledged only once it is durable or known to be
stale; :meth:`broker.core.handoff.Handoff.settled` then decides what the answers mean for the
leases. Store errors are retried while transient and isolated by splitting the batch
otherwise, so one bad report never holds up the others.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from broker.core.handoff import Handoff
from broker.exceptions import transient
from broker.jobs import Clock, JobStatus, Outcome, Settlement
from broker.main.loops import BatchWriter, retrying
from broker.main.metrics import MainMetrics
from broker.model.logs import log_event
from broker.payload import result_problem
from broker.retry import RetryDelay, lost_attempt, next_run_after_failure
from broker.settlement import statuses_after
from broker.storage import StorageAdapter
from broker.wire import messages as protocol

logger = logging.getLogger("broker.main")

_ERROR_SHOWN = 500
"""Characters of a job's error the main's line about its failure shows (the worker's
line, and the job itself, have all of it)."""

Acknowledge = Callable[[list[tuple[int, protocol.Report]], list[protocol.AckStatus]], None]


class ReportSettler:
    """Applies accepted reports to the store, in batches, and hands back each answer."""

    def __init__(
        self,
        store: StorageAdapter,
        handoff: Handoff,
        *,
        acknowledged: Acknowledge,
        stopping: Callable[[], bool],
        clock: Clock,
        retry_delay: RetryDelay,
        max_recoveries: int,
        batch: int,
        retry_interval: float,
        max_payload_bytes: int | None,
        max_payload_depth: int,
        max_payload_containers: int | None,
        metrics: MainMetrics | None = None,
    ) -> None:
        self._store = store
        self._metrics = metrics
        self._handoff = handoff
        self._acknowledged = acknowledged
        self._stopping = stopping
        self._clock = clock
        self._retry_delay = retry_delay
        self._max_recoveries = max_recoveries
        self._retry_interval = retry_interval
        self._max_payload_bytes = max_payload_bytes
        self._max_payload_depth = max_payload_depth
        self._max_payload_containers = max_payload_containers
        self.writer: BatchWriter[tuple[int, protocol.Report], list[protocol.AckStatus]] = (
            BatchWriter(
                "applying reports",
                write=self._settle_batch,
                written=acknowledged,
                unstorable=self._settle_unstorable,
                batch=batch,
                retry_interval=retry_interval,
                stopping=stopping,
                logger=logger,
                count_as="reports",
            )
        )
        """Accepted reports (connection id, report), group-committed: each batch is
        acknowledged only once it is durable (or known to be stale); one that fails for
        good is halved until the report behind the failure stands alone and becomes an
        outcome of its own (:meth:`_settle_unstorable`): one bad report never holds up the
        others."""

    def add(self, peer: int, report: protocol.Report) -> None:
        self.writer.add((peer, report))

    async def wait_idle(self) -> None:
        """Until every queued report has been settled and acknowledged."""
        await self.writer.wait_idle()

    async def run(self) -> None:
        await self.writer.run()

    async def _settle_batch(
        self, batch: list[tuple[int, protocol.Report]]
    ) -> list[protocol.AckStatus]:
        """Apply a batch of fenced reports; the answer to each."""
        now = self._clock()  # once per batch: a clock read per report was ~1% of the main
        settlements = [await self._settlement(msg, now) for _, msg in batch]
        applied = await self._store.settle_many(settlements)
        statuses = [
            protocol.AckStatus.APPLIED if ok else await self._why_not_applied(msg, settlement)
            for ok, (_, msg), settlement in zip(applied, batch, settlements, strict=True)
        ]
        self._count(batch, settlements, applied)
        self._log_failures(settlements, applied)
        return statuses

    async def _settle_unstorable(self, report: tuple[int, protocol.Report], exc: Exception) -> None:
        """A report that can never be applied: its job fails, without retry, with an error
        saying why (the same outcome would fail the same way again). If even that cannot be
        stored, the report is answered ``refused`` and its lease goes back to the queue.
        Either way the worker is answered, so it forgets the report instead of re-sending
        it on every connection."""
        peer, msg = report
        log_event(
            logger,
            logging.ERROR,
            "report could not be stored",
            job_id=msg.job_id,
            handoff_id=msg.handoff_id,
            outcome=msg.type,
            session=peer,
            error=repr(exc),
        )
        failure = Settlement(
            msg.job_id,
            msg.handoff_id,
            Outcome.FAIL,
            error=f"report could not be stored: the worker's {msg.type} report failed with "
            f"{type(exc).__name__}: {str(exc)[:1000]}",
            run_at=None,
        )

        async def record() -> protocol.AckStatus:
            [applied] = await self._store.settle_many([failure])
            self._count([report], [failure], [applied])
            if applied:
                return protocol.AckStatus.APPLIED
            return await self._why_not_applied(msg, failure)

        try:
            status = await retrying(
                "recording a failed report",
                record,
                interval=self._retry_interval,
                logger=logger,
                retry_if=transient,
                stopping=self._stopping,
            )
        except Exception as err:
            if transient(err):  # the main is stopping: the worker sends it again
                return
            log_event(
                logger,
                logging.ERROR,
                "recording the failure failed too, refusing the report",
                job_id=msg.job_id,
                handoff_id=msg.handoff_id,
                error=repr(err),
            )
            status = protocol.AckStatus.REFUSED
        self._acknowledged([report], [status])

    def _count(
        self,
        batch: list[tuple[int, protocol.Report]],
        settlements: list[Settlement],
        applied: list[bool],
    ) -> None:
        """Count the applied outcomes (the jobs as the core still holds them, before
        :meth:`Handoff.settled` lets their leases go)."""
        if self._metrics is None:
            return
        now = self._clock()
        for ok, (_, msg), settlement in zip(applied, batch, settlements, strict=True):
            if ok:
                self._metrics.settled(self._handoff.held_job(msg.handoff_id), settlement, now)

    def _log_failures(self, settlements: list[Settlement], applied: list[bool]) -> None:
        """A job failed (or lost its attempt) and will run again: INFO; failed for good:
        WARNING. Each names its job as handed off (before its lease is let go); nothing
        is looked up unless the level is on."""
        retried = logger.isEnabledFor(logging.INFO)
        if not retried and not logger.isEnabledFor(logging.WARNING):
            return
        for ok, settlement in zip(applied, settlements, strict=True):
            if not ok or settlement.outcome not in (Outcome.FAIL, Outcome.LOST):
                continue
            dead = settlement.run_at is None
            if not dead and not retried:
                continue
            job = self._handoff.held_job(settlement.handoff_id)
            log_event(
                logger,
                logging.WARNING if dead else logging.INFO,
                "job dead" if dead else "job will run again",
                job_id=settlement.job_id,
                handoff_id=settlement.handoff_id,
                task=job.task if job else None,
                queue=job.queue if job else None,
                attempt=job.attempts + 1 if job else None,
                outcome=settlement.outcome,
                run_at=settlement.run_at,
                error=(settlement.error or "")[:_ERROR_SHOWN],
            )

    async def _why_not_applied(
        self, msg: protocol.Report, settlement: Settlement
    ) -> protocol.AckStatus:
        """A fenced-out report is a *duplicate* when its lease already settled this job (two
        copies were in flight: a reconnected worker re-sent a report its old connection had
        sent), and *stale* when a newer lease owns the job or it was cancelled. Read from
        the store, so the answer is the same whichever main gives it."""
        job = await self._store.get_job(msg.job_id)
        if job is None or job.handoff_id != msg.handoff_id:
            return protocol.AckStatus.STALE
        settled_as = statuses_after(settlement.outcome)
        if settlement.outcome is Outcome.FAIL and not isinstance(msg, protocol.FailedReport):
            # Recorded as a failure in its place (an oversized result, an unstorable
            # report): never retried, so only a dead job shows it landed.
            settled_as = frozenset({JobStatus.FAILED})
        if job.status in settled_as:
            return protocol.AckStatus.DUPLICATE
        return protocol.AckStatus.STALE

    async def _settlement(self, msg: protocol.Report, now: datetime) -> Settlement:
        match msg:
            case protocol.CompletedReport(job_id=job_id, handoff_id=lease, result=result):
                problem = result_problem(
                    result,
                    self._max_payload_bytes,
                    self._max_payload_depth,
                    self._max_payload_containers,
                )
                if problem is not None:
                    # Never write an oversized or too deeply nested result (the walk stops
                    # at the container bound, so judging it is cheap): the job fails,
                    # without retry (the same arguments would produce the same result).
                    log_event(
                        logger,
                        logging.WARNING,
                        "result refused",
                        job_id=job_id,
                        handoff_id=lease,
                        reason=problem,
                    )
                    return Settlement(job_id, lease, Outcome.FAIL, error=problem, run_at=None)
                return Settlement(job_id, lease, Outcome.COMPLETE, result=result)
            case protocol.FailedReport(job_id=job_id, handoff_id=lease, error=error, lost=True):
                # The worker's child died under the job: a recovery, not a failure. The job
                # as handed off names the count the fenced settlement will find.
                job = self._handoff.held_job(lease) or await self._store.get_job(job_id)
                if job is not None:
                    return lost_attempt(job, lease, error, now, self._max_recoveries)
                return Settlement(job_id, lease, Outcome.LOST, error=error, run_at=now)
            case protocol.FailedReport(
                job_id=job_id, handoff_id=lease, error=error, retry=retry, retry_delay=wait
            ):
                job = self._handoff.held_job(lease) or await self._store.get_job(job_id)
                # The task's own backoff ran in the worker and sent its wait (decoded, so
                # checked: 0 to ten years); else the main's backoff decides.
                delay = self._retry_delay if wait is None else _fixed(wait)
                retry_at = (
                    next_run_after_failure(job, now, delay) if retry and job is not None else None
                )
                return Settlement(job_id, lease, Outcome.FAIL, error=error, run_at=retry_at)
            case protocol.RescheduleReport(job_id=job_id, handoff_id=lease, delay=delay):
                run_at = now + timedelta(seconds=delay)
                return Settlement(job_id, lease, Outcome.RESCHEDULE, run_at=run_at)
            case protocol.ReleaseReport(job_id=job_id, handoff_id=lease):
                return Settlement(job_id, lease, Outcome.RETURN)


def _fixed(seconds: float) -> RetryDelay:
    return lambda _failures: timedelta(seconds=seconds)
