"""Report settlement: the store side of the reports the handoff core accepted.

Reports are applied in group commits (every report that arrived while a batch was
committing goes into the next), each acknowledged only once it is durable or known to be
stale; :meth:`broker.core.handoff.Handoff.settled` then decides what the answers mean for the
leases. What each report settles to, and what a fenced-out one was, is decided in
:mod:`broker.core.reports`: this module reads the jobs those rules need, and writes. Store
errors are retried while transient and isolated by splitting the batch otherwise, so one
bad report never holds up the others.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from datetime import datetime

from broker.core import reports
from broker.core.handoff import Handoff
from broker.exceptions import transient
from broker.jobs import Clock, Job, Outcome, Settlement
from broker.main.loops import BatchWriter, retrying
from broker.main.metrics import MainMetrics
from broker.model.logs import log_event
from broker.retry import RetryDelay
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
        ended: Callable[[list[uuid.UUID]], None],
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
        self._ended = ended
        """Told the jobs each batch settled, once the store confirmed it: the waiters on
        those that ended are answered (:class:`broker.main.waits.Waits`)."""
        self._stopping = stopping
        self._clock = clock
        self._policy = reports.Policy(
            retry_delay=retry_delay,
            max_recoveries=max_recoveries,
            max_payload_bytes=max_payload_bytes,
            max_payload_depth=max_payload_depth,
            max_payload_containers=max_payload_containers,
        )
        self._retry_interval = retry_interval
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
        # A report that does not need its job settles without a coroutine of its own.
        settlements = [
            await self._settlement(msg, now)
            if reports.needs_job(msg)
            else self._settled(msg, None, now)
            for _, msg in batch
        ]
        applied = await self._store.settle_many(settlements)
        statuses = [
            protocol.AckStatus.APPLIED if ok else await self._why_not_applied(msg, settlement)
            for ok, (_, msg), settlement in zip(applied, batch, settlements, strict=True)
        ]
        self._count(batch, settlements, applied)
        self._log_failures(settlements, applied)
        self._ended([s.job_id for ok, s in zip(applied, settlements, strict=True) if ok])
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
        failure = reports.unstorable(msg, exc)

        async def record() -> protocol.AckStatus:
            [applied] = await self._store.settle_many([failure])
            self._count([report], [failure], [applied])
            if applied:
                self._ended([failure.job_id])
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
        """A fenced-out report: *duplicate* or *stale*, judged on the job as stored
        (:func:`broker.core.reports.not_applied`)."""
        return reports.not_applied(msg, settlement, await self._store.get_job(msg.job_id))

    async def _settlement(self, msg: protocol.Report, now: datetime) -> Settlement:
        """What ``msg`` settles to (:func:`broker.core.reports.settlement`), with the job
        as handed off (or as stored) when that depends on it."""
        job = None
        if reports.needs_job(msg):
            job = self._handoff.held_job(msg.handoff_id) or await self._store.get_job(msg.job_id)
        return self._settled(msg, job, now)

    def _settled(self, msg: protocol.Report, job: Job | None, now: datetime) -> Settlement:
        """What ``msg`` settles to, given ``job`` (see :meth:`_settlement`)."""
        settlement = reports.settlement(msg, job, now, self._policy)
        if settlement.outcome is Outcome.FAIL and isinstance(msg, protocol.CompletedReport):
            log_event(
                logger,
                logging.WARNING,
                "result refused",
                job_id=msg.job_id,
                handoff_id=msg.handoff_id,
                reason=settlement.error,
            )
        return settlement
