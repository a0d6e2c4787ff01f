"""The pending-recovery ledger: leases the main has decided to give back.

Three situations put a lease here, and all three are handled the same way:

* a claim call raised, so nobody knows whether the store committed it;
* a claim committed, but its worker disconnected or began draining meanwhile;
* a worker's connection ended while it held the lease.

For each entry the ledger calls ``return_to_queue(job_id, lease)``, which is
conditional on that exact lease still owning the job: a claim that never
committed, or a lease already replaced by a newer one, is left alone. Any answer
from the store (``True`` or ``False``) settles the entry; an exception keeps it
and it is retried on the error-retry timer, for as long as it takes.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

from broker.exceptions import StorageError
from broker.storage import StorageAdapter
from broker.supervise import retrying

logger = logging.getLogger("broker.recovery")


class RecoveryLedger:
    def __init__(
        self,
        store: StorageAdapter,
        *,
        retry_interval: float = 1.0,
        on_returned: Callable[[], None] = lambda: None,
    ) -> None:
        self._store = store
        self._retry_interval = retry_interval
        self._on_returned = on_returned
        self._pending: dict[uuid.UUID, uuid.UUID] = {}
        self._kick = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    def add(self, job_id: uuid.UUID, handoff_id: uuid.UUID, reason: str) -> None:
        logger.info(
            "lease queued for return job_id=%s handoff_id=%s reason=%s",
            job_id,
            handoff_id,
            reason,
        )
        self._pending[handoff_id] = job_id
        self._idle.clear()
        self._kick.set()

    def __contains__(self, handoff_id: object) -> bool:
        return handoff_id in self._pending

    def __len__(self) -> int:
        return len(self._pending)

    def pending(self) -> dict[uuid.UUID, uuid.UUID]:
        """A copy of the ledger, lease → job id, for status output and tests."""
        return dict(self._pending)

    async def flush(self) -> bool:
        """Try every entry once; ``True`` when the ledger is empty afterwards."""
        returned_any = False
        for handoff_id, job_id in list(self._pending.items()):
            try:
                returned = await self._store.return_to_queue(job_id, handoff_id)
            except Exception as exc:
                logger.warning(
                    "returning lease failed, will retry job_id=%s handoff_id=%s error=%r",
                    job_id,
                    handoff_id,
                    exc,
                )
                continue
            if self._pending.get(handoff_id) == job_id:
                del self._pending[handoff_id]
            logger.info(
                "lease %s job_id=%s handoff_id=%s",
                "returned to queue" if returned else "already settled (no-op)",
                job_id,
                handoff_id,
            )
            returned_any = returned_any or returned
        if returned_any:
            self._on_returned()
        if not self._pending:
            self._idle.set()
        return not self._pending

    async def run(self) -> None:
        """Flush whenever kicked; while entries remain, retry on the error-retry timer (or
        at once when another lease is added)."""
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
            raise StorageError(f"{len(self._pending)} leases could not be returned yet")

    async def wait_empty(self) -> None:
        await self._idle.wait()
