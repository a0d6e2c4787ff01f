"""The recovery ledger's I/O: gives back to the store the leases the main decided to return.

Which leases wait to go back is handoff state, kept in one place:
:attr:`broker.core.handoff.Handoff.returns`. Three situations put a lease there, and all three
are handled the same way:

* a claim call raised, so nobody knows whether the store committed it;
* a claim committed, but its worker disconnected or began draining meanwhile;
* a worker's connection ended while it held the lease (or an orphan was not adopted).

For each entry this loop calls ``return_to_queue(job_id, lease)``, which is conditional
on that exact lease still owning the job: a claim that never committed, or a lease
already replaced by a newer one, is left alone. An entry whose attempt was lost (the
last two situations, where the job may have run: :attr:`broker.core.handoff.Handoff.losses`)
is settled instead as :func:`broker.retry.lost_attempt` says, fenced the same way: it
counts a recovery in the same statement, and past the job's recovery limit ends it dead.
Any answer from the store (``True`` or ``False``) settles the entry; an exception keeps
it and it is retried on the error-retry timer, for as long as it takes. Which of the two
an entry gets is :func:`broker.core.reports.taken_back`'s to say, the rule a lost report
shares.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

from broker.core import reports
from broker.core.handoff import Handoff
from broker.exceptions import StorageError
from broker.jobs import DEFAULT_MAX_RECOVERIES, Clock, utcnow
from broker.main.loops import retrying
from broker.model.logs import log_event
from broker.storage import StorageAdapter

logger = logging.getLogger("broker.recovery")


class RecoveryLedger:
    def __init__(
        self,
        store: StorageAdapter,
        handoff: Handoff,
        *,
        retry_interval: float = 1.0,
        on_returned: Callable[[], None] = lambda: None,
        ended: Callable[[list[uuid.UUID]], None] = lambda _: None,
        clock: Clock = utcnow,
        max_recoveries: int = DEFAULT_MAX_RECOVERIES,
    ) -> None:
        self._store = store
        self._clock = clock
        self._max_recoveries = max_recoveries
        self._handoff = handoff
        self._retry_interval = retry_interval
        self._on_returned = on_returned
        self._ended = ended
        """Told of a job a lost attempt settled (past its recovery limit it ended dead):
        its waiters are answered (:class:`broker.main.waits.Waits`)."""
        self._kick = asyncio.Event()

    def kick(self) -> None:
        """The core queued a lease for return: try soon."""
        self._kick.set()

    def __contains__(self, handoff_id: object) -> bool:
        return handoff_id in self._handoff.returns

    def __len__(self) -> int:
        return len(self._handoff.returns)

    def pending(self) -> dict[uuid.UUID, uuid.UUID]:
        """A copy of the ledger, lease → job id, for status output and tests."""
        return dict(self._handoff.returns)

    async def flush(self) -> bool:
        """Try every entry once; ``True`` when the ledger is empty afterwards."""
        returned_any = False
        for handoff_id, job_id in self.pending().items():
            loss = self._handoff.losses.get(handoff_id)
            settlement = reports.taken_back(
                job_id, handoff_id, loss, self._clock(), self._max_recoveries
            )
            try:
                if settlement is None:
                    returned = await self._store.return_to_queue(job_id, handoff_id)
                else:
                    [returned] = await self._store.settle_many([settlement])
                    if returned:
                        self._ended([job_id])
            except Exception as exc:
                log_event(
                    logger,
                    logging.WARNING,
                    "returning lease failed, will retry",
                    job_id=job_id,
                    handoff_id=handoff_id,
                    error=repr(exc),
                )
                continue
            self._handoff.returned(handoff_id, job_id)
            log_event(
                logger,
                logging.INFO,
                "lease returned to queue" if returned else "lease already settled (no-op)",
                job_id=job_id,
                handoff_id=handoff_id,
                lost=loss is not None,
            )
            returned_any = returned_any or returned
        if returned_any:
            self._on_returned()
        return not self._handoff.returns

    async def run(self) -> None:
        """Flush whenever kicked; while entries remain, retry on the error-retry timer (or
        at once when another lease is queued)."""
        while True:
            await self._kick.wait()
            self._kick.clear()
            await retrying(
                "returning leases",
                self._flush_all,
                interval=self._retry_interval,
                logger=logger,
                wake=self._kick,
            )

    async def _flush_all(self) -> None:
        if not await self.flush():
            raise StorageError(f"{len(self)} leases could not be returned yet")
